"""Which torch device a name means: ``resolve_device("auto")`` and friends."""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available()


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """``"auto"``: this process's CUDA GPU, then Apple MPS, then the CPU; any other name is
    checked (ValueError when it is malformed or its backend is not available here).

    `local_rank` picks the GPU for "auto" and a bare "cuda" under torchrun.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r} (use auto, cpu, cuda, cuda:N or mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for but CUDA is not available here")
        if dev.index is None:
            dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} was asked for but there are {torch.cuda.device_count()} GPU(s)")
    if dev.type == "mps" and not _mps_available():
        raise ValueError(f"device {name!r} was asked for but MPS is not available here")
    return dev

"""Checkpoints: model + optimizer state, the iteration, and whatever the trainer adds.

A checkpoint is a ``torch.save`` of a dict with plain contents (tensors, numbers, strings,
lists, dicts), so ``torch.load(..., weights_only=True)`` reads it: RNG states are stored as
tensors and tuples of ints, never numpy objects. Writes to a path are atomic: the data goes
to a temporary file in the same directory, is fsynced, then renamed over the target, so a
crash or a full disk leaves the previous checkpoint intact. A sha256 over the contents is
stored with them and checked on load, so a flipped bit is an error, not a silent resume.

    save_checkpoint(model, optimizer, iteration, "ckpt.pt", config=cfg_dict)
    iteration = load_checkpoint("ckpt.pt", model, optimizer)
"""

from __future__ import annotations

import hashlib
import io
import os
import random
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np
import torch

from ferrolm._util import atomic_open

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "apply_checkpoint",
    "CheckpointError",
    "get_rng_state",
    "set_rng_state",
    "unwrap_model",
    "content_checksum",
]

FORMAT = "ferrolm-checkpoint"
FORMAT_VERSION = 1

Target = Union[str, "os.PathLike[str]", BinaryIO]


class CheckpointError(ValueError):
    """A checkpoint is unreadable, not a ferrolm checkpoint, or does not fit the model."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


# ---------------------------------------------------------------------------------------
# RNG state as weights_only-loadable values
# ---------------------------------------------------------------------------------------


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and CUDA) RNG states as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states saved by `get_rng_state` (missing entries are left alone)."""
    if "python" in state:
        random.setstate(_to_tuple(state["python"]))
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state(
            (s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
        )
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])


# ---------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------


def save_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, iteration: int, out: Target, **extra: Any
) -> None:
    """Save model and optimizer state and `iteration` to `out` (a path or a binary file).

    Keyword arguments are stored beside them (e.g. ``config=...``, ``rng=get_rng_state()``,
    ``tokenizer_fingerprint=...``); they must be plain values or tensors. A path is written
    atomically: on any failure (e.g. a full disk) the file at `out` is left as it was.
    """
    reserved = {"format", "format_version", "model", "optimizer", "iteration", "checksum"} & set(extra)
    if reserved:
        raise ValueError(f"save_checkpoint: {sorted(reserved)} are reserved checkpoint keys")
    obj = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "iteration": int(iteration),
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        **extra,
    }
    obj["checksum"] = content_checksum(obj)
    if isinstance(out, (str, os.PathLike)):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(out) as f:
            torch.save(obj, f)
    else:
        torch.save(obj, out)


# ---------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------


def read_checkpoint(src: Target, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint dict at `src`, loaded with weights_only=True; CheckpointError if unusable."""
    name = os.fspath(src) if isinstance(src, (str, os.PathLike)) else getattr(src, "name", "<file object>")
    if isinstance(src, (str, os.PathLike)) and not Path(src).is_file():
        raise FileNotFoundError(f"checkpoint not found: {name}")
    try:
        obj = torch.load(src, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # zip errors, unpickling errors, EOF: all mean the file is unusable
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "weights_only" in first:  # torch's advice to unpickle arbitrary objects does not apply
            first = "it holds data that is not plain tensors and values"
        detail = f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__
        raise CheckpointError(f"checkpoint {name} is corrupt or not a ferrolm checkpoint ({detail})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f'{name} is not a ferrolm checkpoint (no "format": "{FORMAT}" entry)')
    if not isinstance(obj.get("format_version"), int) or obj["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{name}: checkpoint format_version {obj.get('format_version')!r} is newer than this ferrolm reads ({FORMAT_VERSION})"
        )
    if not isinstance(obj.get("model"), dict) or not isinstance(obj.get("iteration"), int):
        raise CheckpointError(f"{name}: checkpoint lacks model weights or iteration")
    if "checksum" in obj and obj["checksum"] != content_checksum(obj):  # older checkpoints have none
        raise CheckpointError(
            f"checkpoint {name} is corrupt: its contents do not match the checksum recorded when it was saved"
        )
    return obj


def content_checksum(obj: dict[str, Any]) -> str:
    """sha256 over a checkpoint's entries but "checksum": every tensor's dtype, shape and
    bytes and every plain value, in the dict's order (which torch.save keeps)."""
    h = hashlib.sha256()
    _hash_value(h, {k: v for k, v in obj.items() if k != "checksum"})
    return h.hexdigest()


def _hash_value(h, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(f"dict {len(value)}\n".encode())
        for k, v in value.items():
            _hash_value(h, k)
            _hash_value(h, v)
    elif isinstance(value, (list, tuple)):
        h.update(f"list {len(value)}\n".encode())
        for v in value:
            _hash_value(h, v)
    else:
        h.update(f"{type(value).__name__} {value!r}\n".encode())


def _describe_mismatch(saved: dict, expected: dict) -> str:
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in saved and isinstance(saved[k], torch.Tensor) and tuple(saved[k].shape) != tuple(expected[k].shape)
    ]
    parts = []
    if shapes:
        parts.append(f"{len(shapes)} shape mismatch(es), e.g. {'; '.join(shapes[:3])}")
    if missing:
        parts.append(f"{len(missing)} missing key(s), e.g. {', '.join(missing[:3])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s), e.g. {', '.join(unexpected[:3])}")
    return "; ".join(parts)


def apply_checkpoint(
    ckpt: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    name: str = "checkpoint",
) -> int:
    """Load a dict from `read_checkpoint` into `model` (and `optimizer`); return its iteration."""
    target = unwrap_model(model)
    expected = target.state_dict()
    mismatch = _describe_mismatch(ckpt["model"], expected)
    if mismatch:
        cfg = ckpt.get("config", {}).get("model") if isinstance(ckpt.get("config"), dict) else None
        hint = f" (it was saved with model config {cfg})" if cfg else ""
        raise CheckpointError(
            f"{name} does not fit this model, was it saved from a different config?{hint}: {mismatch}"
        )
    target.load_state_dict(ckpt["model"])
    if optimizer is not None:
        if ckpt.get("optimizer") is None:
            raise CheckpointError(f"{name} holds no optimizer state")
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{name}: optimizer state does not fit this optimizer ({e})") from None
    return int(ckpt["iteration"])


def load_checkpoint(src: Target, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore `model` (and `optimizer`, when given) from `src`; return the saved iteration.

    Loads with weights_only=True onto the CPU (load_state_dict copies onto the model's
    device). Raises FileNotFoundError when `src` is missing and CheckpointError when it is
    corrupt, not a ferrolm checkpoint, or saved from a model of another shape.
    """
    name = os.fspath(src) if isinstance(src, (str, os.PathLike)) else "checkpoint"
    return apply_checkpoint(read_checkpoint(src), model, optimizer, name=name)


def checkpoint_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, iteration: int, **extra: Any
) -> bytes:
    """The bytes `save_checkpoint` would write (handy for tests and in-memory copies)."""
    buf = io.BytesIO()
    save_checkpoint(model, optimizer, iteration, buf, **extra)
    return buf.getvalue()

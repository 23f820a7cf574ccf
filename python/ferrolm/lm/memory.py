"""Before allocating: roughly how much memory a training configuration needs, and whether
the device has it. A shape that cannot fit is refused with both figures, instead of
building layers until the kernel kills the process or the allocator raises.

The estimate, in bytes, for fp32 weights trained with AdamW:

    weights + gradients + optimizer state   16 P      (4 + 4 + 2 x 4 bytes per parameter;
                                                        divided over the processes with FSDP)
    activations kept for the backward pass  4 B T (L (10 d + 4 f) + V)
                                                       (per token: about ten d-wide and four
                                                        FFN-wide tensors per layer, one row of
                                                        logits)

with P parameters, B sequences of T tokens per micro-batch, L layers of width d, FFN width
f and V tokens in the vocabulary. It leaves out the allocator's slack, the data and
torch's own workspace, so a configuration that passes may still be tight; one that fails
needs more than the device has free. When the estimate is wrong (a device whose free
memory is not what it reports, say), ``FERROLM_MEMORY_CHECK=0`` in the environment skips
the check.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ferrolm.lm.model import ModelConfig, count_parameters

__all__ = ["training_memory_estimate", "available_memory", "check_training_memory", "InsufficientMemoryError"]

ENV_SWITCH = "FERROLM_MEMORY_CHECK"  # "0" skips the check


class InsufficientMemoryError(ValueError):  # a ValueError: the CLI reports it as bad input
    """A configuration needs more memory than the device has available."""


def training_memory_estimate(cfg: ModelConfig, batch_size: int, shards: int = 1) -> dict[str, int]:
    """Bytes a training step needs, by part: "state" (weights, gradients, AdamW moments;
    divided over ``shards`` processes with FSDP), "activations", and "total"."""
    params = count_parameters(cfg)
    state = 16 * params // max(1, shards)
    per_token = cfg.num_layers * (10 * cfg.d_model + 4 * cfg.ffn_hidden) + cfg.vocab_size
    activations = 4 * batch_size * cfg.context_length * per_token
    return {"parameters": params, "state": state, "activations": activations, "total": state + activations}


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes free for a new allocation on ``device``: CUDA's free memory, else the host's
    MemAvailable (MPS shares it). None when it cannot be told."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def check_training_memory(cfg: ModelConfig, batch_size: int, device: torch.device, shards: int = 1) -> None:
    """Raise InsufficientMemoryError when the estimate is above the memory available on ``device``."""
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return
    need = training_memory_estimate(cfg, batch_size, shards)
    have = available_memory(device)
    if have is None or need["total"] <= have:
        return
    raise InsufficientMemoryError(
        f"this configuration needs an estimated {_gb(need['total'])} to train "
        f"({need['parameters']:,} parameters: {_gb(need['state'])} for weights, gradients and AdamW state; "
        f"{_gb(need['activations'])} of activations for batch_size {batch_size} x context_length "
        f"{cfg.context_length}), but {device} has {_gb(have)} available. Make the model or "
        f"schedule.batch_size smaller; if the estimate is wrong, set {ENV_SWITCH}=0 to skip this check"
    )

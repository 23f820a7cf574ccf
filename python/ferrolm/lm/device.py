"""Which torch device a name means (``resolve_device("auto")``), and what runs fastest on it:
``use_compile`` and ``use_bf16`` decide the ``"auto"`` of ``run.compile`` and ``run.autocast_bf16``.

What "auto" picks, by measurement (benches/bench_model.py, benches/results/lm_train.md):

- CUDA: torch.compile (fewer, fused kernels) and bf16 autocast where the GPU supports it.
- CPU: eager. With the LM head fused into the loss and the fused AdamW kernel, what
  inductor still fused (RMSNorm, RoPE, SwiGLU's gate) was worth nothing measurable: the
  compiled step ran level with eager (1.00x, side by side on an AVX2 EPYC, TinyStories
  shape) after a 30-100 s compile, holding 20 % more memory. ``run.compile = true`` still
  compiles (it needs a C++ compiler). bf16 autocast only when the CPU has native bf16
  matrix instructions (AMX or AVX512-BF16): without them torch emulates bf16 GEMMs and the
  step runs ~12x slower than fp32. Which kernel runs the float32 matrices (torch's BLAS
  or oneDNN) is measured too: ``ferrolm.lm.gemm`` (``run.cpu_matmul``).
- Anything else (MPS): eager, fp32.

``reuse_freed_memory()`` is what training on a CPU sets up besides: torch allocates every
activation afresh each step, and glibc hands big blocks back to the kernel when they are
freed, so each step page-faults its whole working set in again (about 6 % of a CPU step at
the TinyStories shape, all of it kernel time). Keeping freed blocks for reuse removes that.
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = [
    "resolve_device",
    "unavailable",
    "use_compile",
    "use_bf16",
    "cpu_has_native_bf16",
    "cpu_vector_width",
    "reuse_freed_memory",
    "is_compiling",
]


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
    problem = unavailable(dev)
    if problem:
        raise ValueError(f"device {name!r} was asked for but {problem}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    return dev


def unavailable(dev: torch.device) -> str | None:
    """Why `dev` cannot be used in this process (its backend or its index is missing), or None."""
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available here"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"there are {torch.cuda.device_count()} GPU(s)"
    if dev.type == "mps" and not _mps_available():
        return "MPS is not available here"
    return None


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def _torch_cpu_capability() -> str:
    """torch's name for the vector code it dispatches to here ("AVX2", "AVX512", ...), or ""."""
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return get().upper() if get is not None else ""


def _vector_width(flags: frozenset[str], capability: str) -> str:
    """``cpu_vector_width``'s answer for these cpuinfo flags and torch capability."""
    if "AMX" in capability or "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags or capability.startswith("AVX512"):
        return "AVX-512"
    if "avx2" in flags or capability == "AVX2":
        return "AVX2"
    return capability or "unknown"


# Read once, at import: kernel choices ask for it inside code torch.compile traces.
_CPU_VECTOR_WIDTH = _vector_width(_cpu_flags(), _torch_cpu_capability())


def cpu_vector_width() -> str:
    """The widest vector instructions this CPU runs, as its matrix kernels see them: "AMX",
    "AVX512-BF16", "AVX-512", "AVX2", else torch's own name for its CPU code path (e.g.
    "DEFAULT", "SVE256"; "unknown" where torch has none). From the /proc/cpuinfo flags, with
    torch's capability where there are none."""
    return _CPU_VECTOR_WIDTH


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AMX or AVX512-BF16)."""
    return cpu_vector_width() in ("AMX", "AVX512-BF16")


def _switch(setting: str | bool) -> str:
    if isinstance(setting, bool):
        return "true" if setting else "false"
    return setting.lower()


def use_compile(setting: str | bool, device: torch.device) -> bool:
    """``run.compile``: "true"/"false" as given; "auto" as the module docstring says."""
    setting = _switch(setting)
    if setting != "auto":
        return setting == "true"
    return device.type == "cuda"


def use_bf16(setting: str | bool, device: torch.device) -> bool:
    """``run.autocast_bf16``: "true"/"false" as given (on CUDA and CPU; never on others); "auto"
    as the module docstring says."""
    setting = _switch(setting)
    if device.type == "cuda":
        return setting != "false" and torch.cuda.is_bf16_supported()
    if device.type != "cpu" or setting == "false":
        return False
    return setting == "true" or cpu_has_native_bf16()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead of returning
    it to the kernel (no mmap per large block, no trimming of the heap). For a training
    process this trades a resident size that stays at its peak for no page faults in the
    step. Process-wide; a no-op (False) where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def is_compiling() -> bool:
    """Whether torch.compile is tracing the calling code."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())

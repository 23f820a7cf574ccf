"""Which kernel multiplies the model's float32 matrices on a CPU: torch's BLAS or oneDNN.

torch's CPU matmul (``F.linear``, ``@``) calls its BLAS library (MKL in the x86 wheels),
which chooses its code path by the CPU's vendor as well as by its instructions. torch
also carries oneDNN, which chooses by the instructions alone. On most CPUs the two run
level; on an AMD EPYC with AVX-512 (Zen 5) MKL multiplied the TinyStories shape's float32
matrices at 53-100 GFLOP/s on one core and oneDNN at 157-222 GFLOP/s (the same fp32
arithmetic, results equal to rounding). So the choice is measured, not assumed:
``choose("auto")`` times one GEMM both ways and keeps oneDNN only when it is clearly
faster (``run.cpu_matmul``; ``ferrolm train`` makes the choice on a CPU).

``linear(x, weight)`` is ``x @ weight.T`` through the chosen kernel. It is what the model's
layers and the fused LM head call; with oneDNN chosen it is an autograd function whose
backward also runs on oneDNN (d x = g W, d W = g^T x). Everything else stays torch's: other
dtypes, autocast (bf16 GEMMs already go to oneDNN), and every device but the CPU.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from ferrolm.lm.config import CPU_MATMUL_CHOICES as CHOICES
from ferrolm.lm.device import is_compiling

__all__ = [
    "linear",
    "matmul",
    "add_matmul_",
    "choose",
    "chosen",
    "onednn_available",
    "using_onednn",
    "runs_on_onednn",
    "CHOICES",
]

_use_onednn = False  # process-wide, as torch's own backend switches are

# oneDNN must be at least this much faster on the probe to be chosen: near a tie the
# choice could flip from run to run on a noisy machine, for nothing.
_MARGIN = 1.15


def onednn_available() -> bool:
    """Whether this torch build can run oneDNN's float32 matrix multiply."""
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def using_onednn() -> bool:
    """Whether ``linear`` sends float32 CPU matrices to oneDNN in this process."""
    return _use_onednn


def chosen() -> str:
    """The kernel ``linear`` uses for float32 CPU matrices in this process: "blas" or "onednn"."""
    return "onednn" if _use_onednn else "blas"


def choose(setting: str = "auto", recorded: str | None = None) -> str:
    """Set the kernel ``linear`` uses for float32 CPU matrices and return it ("blas" or
    "onednn"). "auto" measures both on one GEMM of 512 x 1024 x 1024 (about 0.1 s) and
    picks oneDNN when it ran at least 1.15x as fast; "onednn" where this torch has no oneDNN
    is a ValueError. ``recorded``: the kernel an earlier run chose (a resumed checkpoint's),
    which "auto" keeps without measuring where this torch has it (a measurement on a busy
    machine could pick the other kernel, whose sums differ in the last bits)."""
    global _use_onednn
    setting = setting.lower()
    if setting not in CHOICES:
        raise ValueError(f"cpu_matmul must be one of {CHOICES}, got {setting!r}")
    if setting == "auto" and (recorded == "blas" or (recorded == "onednn" and onednn_available())):
        setting = recorded
    if setting == "onednn" and not onednn_available():
        raise ValueError("cpu_matmul = 'onednn', but this torch build has no oneDNN (torch.backends.mkldnn)")
    if setting == "auto":
        _use_onednn = False  # stays off if the probe raises
        _use_onednn = onednn_available() and _probe_speedup() >= _MARGIN
    else:
        _use_onednn = setting == "onednn"
    return chosen()


def _probe_speedup(rounds: int = 3) -> float:
    """BLAS time over oneDNN time (the best of a few rounds each) for one float32 GEMM."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1024, generator=gen)
    w = torch.randn(1024, 1024, generator=gen)

    def best(fn) -> float:
        fn()  # warm: first-call setup, caches
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    try:
        onednn = best(lambda: _onednn_linear(x, w))
    except RuntimeError:
        return 0.0
    return best(lambda: F.linear(x, w)) / max(onednn, 1e-9)


def _onednn_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T by oneDNN; any strides (a transposed view is read in place)."""
    if is_compiling():
        return torch.ops.ferrolm.onednn_linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


# Inductor lowers mkldnn._linear_pointwise only for frozen (constant) weights, so a
# compiled graph calls it through an opaque op of ours instead (torch >= 2.4; on older
# torch a compiled graph keeps torch's matmul).
_compilable = hasattr(torch.library, "custom_op")
if _compilable:

    @torch.library.custom_op("ferrolm::onednn_linear", mutates_args=())
    def _onednn_linear_op(x: Tensor, weight: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

    @_onednn_linear_op.register_fake
    def _(x: Tensor, weight: Tensor) -> Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))


def runs_on_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear``, ``matmul`` and ``add_matmul_`` send these operands to oneDNN."""
    return (
        _use_onednn
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and (_compilable or not is_compiling())
    )


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """y = x @ weight.T for x (..., in) and weight (out, in), by the chosen kernel."""
    if not runs_on_onednn(x, weight):
        return F.linear(x, weight)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _OneDNNLinear.apply(x, weight)
    return _onednn_linear(x, weight)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for 2-D a and b, by the chosen kernel (no autograd: for code computing gradients itself)."""
    if not runs_on_onednn(a, b):
        return a @ b
    return _onednn_linear(a, b.t())


def add_matmul_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """out += a @ b for 2-D tensors (float32 ``out``); in place, with no temporary where
    torch's ``addmm_`` can take the operands as they are."""
    if runs_on_onednn(a, b):
        return out.add_(_onednn_linear(a, b.t()))
    if a.dtype == b.dtype == out.dtype and not torch.is_autocast_enabled(a.device.type):
        return out.addmm_(a, b)
    return out.add_(a @ b)


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T;  d x = g W;  d W = g^T x  (over all leading dims of x), each by oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return _onednn_linear(x, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(grad, weight.t())
        if ctx.needs_input_grad[1]:
            grad_w = _onednn_weight_grad(grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w


def _onednn_weight_grad(g: Tensor, x: Tensor) -> Tensor:
    """gᵀ x (out, in) for g (n, out) and x (n, in), by oneDNN with the narrower side as the
    rows of the product it computes: oneDNN ran the (out, in) = (1366, 256) gradient of a
    SwiGLU's stacked W1/W3 in 6.9 ms as (xᵀ g)ᵀ against 10.9 ms as gᵀ x, and the
    (256, 683) one of W2 faster the direct way (Zen 5, n = 4096, float32)."""
    if g.shape[1] > x.shape[1]:
        return _onednn_linear(x.t().contiguous(), g.t()).t().contiguous()
    return _onednn_linear(g.t(), x.t())

"""The functional building blocks of the Transformer LM, written as their equations.

These are the literal definitions the model is checked against:

    softmax(x)_i   = exp(x_i - max x) / sum_j exp(x_j - max x)
    silu(x)        = x * sigmoid(x)
    cross_entropy  = mean over positions of  logsumexp(logits) - logits[target]
    attention      = softmax(Q K^T / sqrt(d_k) + mask) V

The model's default (fast) path uses torch's fused kernels for SiLU and attention,
which compute the same functions; ``tests/test_functional.py`` holds both to the
equations and to each other.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["softmax", "silu", "cross_entropy", "scaled_dot_product_attention"]


def softmax(x: Tensor, dim: int) -> Tensor:
    """Softmax along ``dim``, stable for large inputs.

    Subtracting the maximum first leaves the result unchanged (it cancels in the ratio)
    and keeps every exponent <= 0, so nothing overflows. Divide ``x`` by a temperature
    before calling to get softmax at that temperature.
    """
    shifted = x - x.amax(dim=dim, keepdim=True)
    exps = torch.exp(shifted)
    return exps / exps.sum(dim=dim, keepdim=True)


def silu(x: Tensor) -> Tensor:
    """SiLU (swish): x * sigmoid(x)."""
    return x * torch.sigmoid(x)


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean negative log-likelihood of ``targets`` under ``softmax(logits)``.

    ``logits`` has shape (..., vocab) and ``targets`` (...) holds class ids; the mean is
    over every position of ``targets``. Per position the loss is

        -log softmax(o)[t] = logsumexp(o) - o[t]
                           = max(o) + log sum_j exp(o_j - max(o)) - o[t]

    so no probability is materialized in the forward pass, and logits of 1e4 stay
    finite. Its gradient with respect to the logits is (softmax(o) - onehot(t)) / N,
    which the backward pass computes directly in one buffer (about twice as fast as
    autograd through logsumexp and gather). bfloat16/float16 logits are reduced in
    float32 (a 10k-way log-sum-exp needs more than 8 bits of mantissa); the loss is
    float32 and the gradient has the logits' dtype.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} plus a vocab dim"
        )
    vocab = logits.shape[-1]
    return _CrossEntropy.apply(logits.reshape(-1, vocab), targets.reshape(-1).long())


class _CrossEntropy(torch.autograd.Function):
    """loss = mean_i (logsumexp(o_i) - o_i[t_i]);  d loss / d o_i = (softmax(o_i) - onehot(t_i)) / N."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:  # logits (N, V), targets (N,)
        work = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        log_normalizer = torch.logsumexp(work, dim=-1)  # (N,)
        target_logit = work.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N,)
        ctx.save_for_backward(logits, targets, log_normalizer)
        return (log_normalizer - target_logit).mean()

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        logits, targets, log_normalizer = ctx.saved_tensors
        n = targets.numel()
        work_dtype = log_normalizer.dtype
        # softmax(o) = exp(o - logsumexp(o)), written into one fresh buffer
        grad = torch.sub(logits.to(work_dtype), log_normalizer.unsqueeze(-1)).exp_()
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad.new_full((n, 1), -1.0))  # - onehot(t)
        grad.mul_(grad_loss / n)
        return grad.to(logits.dtype), None


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(Q K^T / sqrt(d_k) + M) V for q (..., n, d_k), k (..., m, d_k), v (..., m, d_v).

    ``mask`` is boolean, broadcastable to (..., n, m); True means "query i may attend to
    key j". Masked scores become -inf, so they get probability exactly 0. A query whose
    row is entirely masked has no distribution and yields NaN.
    """
    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (..., n, m)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ v

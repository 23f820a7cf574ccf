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

    so no probability is ever materialized, and logits of 1e4 stay finite. Logits in
    bfloat16/float16 are promoted to float32 first (the log-sum-exp of a 10k-way
    distribution needs more than 8 bits of mantissa).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} plus a vocab dim"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    log_normalizer = torch.logsumexp(logits, dim=-1)  # (...,)
    target_logit = logits.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1)  # (...,)
    return (log_normalizer - target_logit).mean()


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

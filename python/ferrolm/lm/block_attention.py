"""Causal self-attention by batched GEMMs over blocks of 32 queries: the training attention
of float32 models on a CPU whose widest vectors are AVX2.

Each block of queries is multiplied against only the keys it may see (of n blocks,
(n + 1) / 2n of the score matrix), over every head at once, and its softmax probabilities
are kept for the backward, which is then GEMMs too. On such a CPU (``device.cpu_vector_width()``
says "AVX2") torch's flash kernel, built for wider vectors, ran forward and back 1.2-1.6x
slower; everywhere else, and for generation (no gradient, nothing kept), the model keeps
torch's kernel. ``block_causal_applies`` makes that choice; ``BlockCausalAttention`` is the
kernel, tested equal to the equation and its gradients.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ferrolm.lm.device import cpu_vector_width, is_compiling

__all__ = ["BlockCausalAttention", "block_causal_applies"]


def block_causal_applies(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, dropout_p: float) -> bool:
    """Whether ``BlockCausalAttention`` runs this attention: training (a gradient wanted) in
    float32 on a CPU whose widest vectors are AVX2, plain causal, one key/value head per
    query head, no dropout, and a sequence T of at most 8 d_head, so that the probabilities
    it keeps (about T^2 / 2 floats a head) stay within 4 times the queries' size (T d_head
    floats a head). There torch's flash kernel, built for wider vectors, ran forward and
    back 1.2-1.3x (heads of 32, 256 positions) to 1.6x (heads of 64, 512 positions) slower
    (Zen 3, one thread)."""
    return (
        is_causal
        and not dropout_p
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (q, k, v))
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and q.shape == k.shape == v.shape
        and 1 < q.shape[-2] <= 8 * q.shape[-1]
        and not is_compiling()
        and cpu_vector_width() == "AVX2"
    )


class BlockCausalAttention(torch.autograd.Function):
    """softmax(Q K^T / sqrt(d) + causal mask) V for q, k, v (batch, heads, T, d), a block
    of queries at a time against only the keys it may see (of n blocks, (n + 1) / 2n of the
    score matrix: 9/16 at 8), by batched GEMMs over the heads; the probabilities P are kept
    for the backward:  d V = P^T g,  d S = P * (g V^T - rowsum(P * g V^T)) (elementwise *),
    d Q = d S K / sqrt(d),  d K = d S^T Q / sqrt(d)  (S the scaled scores)."""

    BLOCK = 32  # queries per block: 32 and 64 ran level; fewer keys wasted on the diagonal

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        batch, heads, seq, d = q.shape
        scale = 1.0 / math.sqrt(d)
        qs = torch.empty(q.shape, dtype=q.dtype)
        torch.mul(q, scale, out=qs)  # the scale on q: d values a query, not T scores
        qs, k, v = qs.view(-1, seq, d), k.reshape(-1, seq, d), v.reshape(-1, seq, d)
        out = torch.empty_like(qs)
        above = torch.ones(BlockCausalAttention.BLOCK, BlockCausalAttention.BLOCK, dtype=torch.bool).triu_(1)
        probs = []
        for start in range(0, seq, BlockCausalAttention.BLOCK):
            end = min(start + BlockCausalAttention.BLOCK, seq)
            scores = torch.bmm(qs[:, start:end], k[:, :end].transpose(1, 2))  # keys 0 .. end - 1
            scores[:, :, start:end].masked_fill_(above[: end - start, : end - start], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            torch.bmm(p, v[:, :end], out=out[:, start:end])
            probs.append(p)
        ctx.save_for_backward(qs, k, v, *probs)
        ctx.scale = scale
        return out.view(batch, heads, seq, d)

    @staticmethod
    def backward(ctx, grad: Tensor):
        qs, k, v, *probs = ctx.saved_tensors
        shape, seq = grad.shape, qs.shape[1]
        g = grad.reshape(qs.shape)
        grad_q, grad_k, grad_v = torch.empty_like(qs), torch.zeros_like(k), torch.zeros_like(v)
        for p, start in zip(probs, range(0, seq, BlockCausalAttention.BLOCK)):
            end = start + p.shape[1]
            g_block = g[:, start:end]
            grad_v[:, :end].baddbmm_(p.transpose(1, 2), g_block)
            grad_s = torch._softmax_backward_data(torch.bmm(g_block, v[:, :end].transpose(1, 2)), p, -1, p.dtype)
            torch.bmm(grad_s, k[:, :end], out=grad_q[:, start:end])
            grad_k[:, :end].baddbmm_(grad_s.transpose(1, 2), qs[:, start:end])
        return grad_q.mul_(ctx.scale).view(shape), grad_k.view(shape), grad_v.view(shape)

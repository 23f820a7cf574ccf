"""The Transformer language model, written to be held against its equations.

Read top to bottom, this file is the model:

    Linear        y = x W^T                           W: (out, in), no bias
    Embedding     e = E[ids]                          E: (vocab, d_model)
    RMSNorm       x / sqrt(mean(x^2) + eps) * g       in float32, cast back
    SwiGLU        W2 (SiLU(W1 x) * W3 x)              W1, W3: (d_ff, d), W2: (d, d_ff)
    RoPE          rotate pairs (x[2k], x[2k+1]) by angle  pos * theta^(-2k/d_head)
    Attention     softmax(Q K^T / sqrt(d_head) + causal mask) V, per head, then W_O
    Block         h = x + Attn(RMSNorm(x));  y = h + SwiGLU(RMSNorm(h))      (pre-norm)
    LM            embedding -> blocks -> RMSNorm -> LM head (untied by default)

Initialization: every Linear is truncated normal with std sqrt(2 / (in + out)) cut at
+-3 std; the embedding is truncated normal with std 1 cut at +-3.

Switches (``ModelConfig``), each off by default; each one's equation is a function of
``ferrolm.lm.functional`` that the tests hold the model to:

    num_kv_heads   grouped-query attention: query head h uses key/value head
                   h // (num_heads / num_kv_heads); W_K, W_V: (num_kv_heads d_head, d)
                   (functional.grouped_query_attention)
    qk_norm        q <- q / sqrt(mean(q^2) + eps), k likewise, per head, after RoPE, with
                   no weight (functional.qk_norm); RoPE keeps each head's norm, so this
                   equals normalizing before RoPE
    qk_norm_gain   with qk_norm, Qwen3's: q <- RMSNorm(q) * g_q, k <- RMSNorm(k) * g_k per head,
                   BEFORE RoPE, g_q and g_k learned (d_head,) gains per layer (the gain does
                   not commute with the rotation, so the order is Qwen3's)
    ffn="relu2"    W2 relu(W1 x)^2 (functional.relu_squared), width d_ff_ungated
                   (default round(3 d_ff / 2): SwiGLU's parameter count)
    logit_softcap  logits <- c tanh(logits / c) (functional.softcap)
    zero_init_output  W_O and the FFN's W2 start at 0: every block starts as the identity
    doc_mask       attention masked to the query's own document (functional.document_mask
                   with the document of each position); RoPE positions run on across
                   documents, which changes nothing since attention never crosses them and
                   RoPE sees only distances
    value_embeds   in layer L-1, L-3, ...: v = x W_V^T + E_v[ids], a (vocab, d_kv) table per
                   such layer (a value residual straight from the token)
    x0_mix         block i reads a_i x + b_i x0 (functional.x0_mix), x0 the token
                   embeddings, a_i and b_i learned and starting at 1 and 0
    embed_norm     x = x0 = E[ids] / sqrt(mean(E[ids]^2) + eps), no weight, before the
                   first block (functional.qk_norm's equation over d_model), as nanochat does

From the modded-nanogpt speedrun:

    unet_skips     with L layers and n = floor(L/2), the outputs skip_i of blocks i < n are
                   kept and block L-1-i reads x + s_i skip_i, s_i learned, starting at 1;
                   the skip is added first, then x0_mix's a x + b x0 (the speedrun's order)
    attn_gate      head h's attention output times sigmoid(x[..., :k] W_g[h]^T) before W_O,
                   x the attention's (normed) input, W_g (num_heads, k), k = min(12, d_model),
                   starting at 0: every gate at 1/2 (``AttentionGate``)
    short_window   w > 0: in the layers ``window_pattern`` marks 'S' (cycled over the layers,
                   the last layer always long), the query at position p attends keys j with
                   p - w < j <= p only (functional.sliding_window_mask, ANDed with doc_mask's
                   mask); long layers stay plain causal, on SDPA's is_causal path
Two switches read the previous token; both act on the token embeddings e_t (after
embed_norm), before absolute positions are added and before x0 is taken:

    smear          x_t = e_t + lambda sigmoid(e_t[:k] . w) e_{t-1},  k = min(12, d_model),
                   w a learned (k,) gate and lambda a learned scalar, both starting at 0
                   (the model starts as without smearing; lambda's gradient is not 0)
    bigram_buckets x_t += T[h(id_{t-1}, id_t)], T a (B, d_model) table starting at 0 and
                   h(p, c) = (1000003 p XOR 69069 c) mod (B - 1) (bigram_hash)

At a sequence's first position, and under doc_mask at a document's first token, there is
no previous token: no smear term, and the reserved bucket B - 1. With a KV cache, the
token before the first new position is read from the cache's token slots (KVCache.tokens).

The original Transformer's parts, as switches:

    positions="sinusoidal"  x = E[ids] + PE[pos], PE[p, 2i] = sin(p / 10000^(2i/d)),
                   PE[p, 2i+1] = cos(same) (functional.sinusoidal_positions); no RoPE
    positions="learned"     x = E[ids] + P[pos], P a (context_length, d_model) table
    norm="layer"   (x - mean x) / sqrt(var x + eps) * g + b (functional.layer_norm)
    ffn="relu"     W2 relu(W1 x)
    dropout        p > 0, in training only: on the embeddings' sum, on the attention
                   weights and on each residual branch's output (functional.dropout)
    label_smoothing  e > 0, in training only: the loss's target is (1 - e) onehot + e / V
                   (functional.linear_cross_entropy, equal to torch's label_smoothing)

A training loss, as a switch (no weights; inference, evaluation and validation unchanged):

    mtp_weight     w > 0, in training only, multi-token prediction with the same final norm
                   and LM head: loss = CE(o_t, x_{t+1}) + sum_{j=1..mtp_depth} w^j CE(o_t, x_{t+1+j}),
                   o_t the logits at position t, each CE the mean over its own counted
                   positions; a target past the row's end, ignored (-100), or, with doc_mask,
                   in a later document than t does not count (functional.future_targets)

Two recipes are built from these: the default model (every switch off) is the CS336
assignment's, trained with AdamW and a cosine schedule (the ``cs336`` preset); the
``cpu-small``, ``tinystories`` and ``owt`` presets turn on qk_norm, ffn="relu2",
zero_init_output, value_embeds, x0_mix and logit_softcap=15, and train with Muon and a
warmup-stable-decay schedule, which learned the most per token and per second at the
cpu-small size (benches/results/learning.md); ``cpu-small`` adds bigram_buckets=524288, the
one speedrun switch that paid at its size (trained with optimizer.sparse_bigram).

The checkpoint format is ``TransformerLM.state_dict()``; its keys are

    token_embeddings.weight
    layers.{i}.ln1.weight
    layers.{i}.attn.{q_proj,k_proj,v_proj,output_proj}.weight
    layers.{i}.ln2.weight
    layers.{i}.ffn.{w1,w2,w3}.weight
    ln_final.weight
    lm_head.weight

Ablations and switches change only what they must: ``norm="none"`` drops every
``ln*`` key, ``ffn="silu"``, ``"relu2"`` and ``"relu"`` have no ``w3``, ``num_kv_heads`` makes
``k_proj``/``v_proj`` narrower; ``value_embeds`` adds ``value_embeddings.{i}.weight`` for
its layers, ``x0_mix`` adds ``residual_scales`` and ``x0_scales`` (one entry a layer),
``qk_norm_gain`` adds ``layers.{i}.attn.{q_norm,k_norm}.weight``, ``unet_skips`` adds
``skip_scales`` (floor(L/2) entries), ``attn_gate`` adds ``layers.{i}.attn.gate.weight``
(num_heads, min(12, d_model)), ``smear`` adds ``smear_gate`` and ``smear_lambda``,
``bigram_buckets`` adds ``bigram_embeddings.weight``, ``positions="learned"``
adds ``position_embeddings.weight`` and ``norm="layer"`` a ``.bias`` beside each norm's
``.weight``; no other switch adds a key; with ``tie_embeddings=True`` both
``token_embeddings.weight`` and ``lm_head.weight`` are saved and hold the same tensor.
RoPE's cos/sin tables are non-persistent buffers and never saved.

Speed: attention uses torch's ``scaled_dot_product_attention`` (flash kernels on CUDA
and CPU) unless ``attention="reference"``, which runs the literal equation from
``ferrolm.lm.functional``; both are tested equal. Training in float32 on a CPU whose widest
vectors are AVX2, it runs a block of queries at a time by batched GEMMs instead
(``ferrolm.lm.block_attention``, tested equal too), where torch's flash kernel was slower. For
generation, ``make_kv_cache`` gives a preallocated key/value cache and ``forward(ids,
kv_cache=...)`` computes only the new positions (one start position for the batch, or one
per row: continuous batching).

Accounting for a ``ModelConfig``: ``count_parameters(cfg)`` and ``flops_per_token(cfg)``
(forward; training is 3x), for MFU.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ferrolm.lm import functional, gemm
from ferrolm.lm.block_attention import BlockCausalAttention, block_causal_applies
from ferrolm.lm.config import _MODEL_CHOICES as _CHOICES
from ferrolm.lm.config import ModelConfig
from ferrolm.lm.device import is_compiling
from ferrolm.lm.hf import hf_architecture, to_hf_llama_state_dict, to_hf_state_dict

__all__ = [
    "ModelConfig",
    "Linear",
    "Embedding",
    "RMSNorm",
    "SwiGLU",
    "SiLUFFN",
    "ReLU2FFN",
    "RotaryEmbedding",
    "AttentionGate",
    "CausalSelfAttention",
    "TransformerBlock",
    "TransformerLM",
    "KVCache",
    "causal_mask",
    "rotate_pairs_real",
    "bigram_hash",
    "count_parameters",
    "flops_per_token",
    # Hugging Face interop lives in ferrolm.lm.hf; these names stay importable from here
    "hf_architecture",
    "to_hf_state_dict",
    "to_hf_llama_state_dict",
]

# --------------------------------------------------------------------------------------
# Parameters: Linear and Embedding
# --------------------------------------------------------------------------------------


def _trunc_normal_(w: Tensor, std: float) -> Tensor:
    return nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Linear(nn.Module):
    """y = x W^T with W of shape (out_features, in_features) and no bias."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _trunc_normal_(self.weight, std=math.sqrt(2.0 / (self.in_features + self.out_features)))

    def forward(self, x: Tensor) -> Tensor:
        return gemm.linear(x, self.weight)  # x @ W^T, one GEMM

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Embedding(nn.Module):
    """Row lookup e = E[ids] in a (num_embeddings, embedding_dim) matrix.

    ``sparse_grad`` (set by the optimizer that wants it) makes the weight's gradient a sparse
    tensor of the rows read, so a large table's step costs what the batch reads, not its size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sparse_grad = False
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _trunc_normal_(self.weight, std=1.0)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight, sparse=self.sparse_grad)  # weight[ids]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


# --------------------------------------------------------------------------------------
# RMSNorm and the feed-forward networks
# --------------------------------------------------------------------------------------


def rms_normalize(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) (times ``weight``) over the last dim, computed in float32
    (fp64 stays) and cast back: RMSNorm's equation and, without a weight, QK-norm's.

    Every path computes the equation's float32 values bit for bit (tested). torch's fused
    kernel (``F.rms_norm``, torch 2.4 and later) runs it where no CPU gradient is wanted: one
    pass forward and one back on a GPU. For a gradient on a CPU, and on older torch,
    ``_RMSNormalize``, the equation with its gradient written out: forward and back
    1.6-1.9x faster on a CPU than ``F.rms_norm``, whose CPU backward is a chain of small ops.
    """
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))
    if not _HAS_RMS_NORM or (wants_grad and x.device.type == "cpu"):
        return _RMSNormalize.apply(x, weight, eps)
    in_dtype = x.dtype
    x = x.to(torch.promote_types(in_dtype, torch.float32))  # bf16/fp16 -> fp32; fp64 stays
    w = None if weight is None else weight.to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), w, eps).to(in_dtype)


_HAS_RMS_NORM = hasattr(F, "rms_norm")


class _RMSNormalize(torch.autograd.Function):
    """y = u w, u = x r, r = rsqrt(mean(x^2) + eps) per row, in float32 (fp64 stays), cast
    back; the gradient written out: d x = r (g w - u mean(g w u)), d w = sum over rows of
    g u. Saves u and r (u in float32: a bf16 x saves twice its size)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
        work = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(work)
        r = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        u = xf * r
        ctx.save_for_backward(u, r, weight)
        return (u if weight is None else u * weight.to(work)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        u, r, weight = ctx.saved_tensors
        gf = grad.to(r.dtype)
        gw = gf if weight is None else gf * weight.to(r.dtype)
        mean = (gw * u).mean(dim=-1, keepdim=True)
        grad_x = torch.addcmul(gw, u, mean, value=-1.0).mul_(r).to(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (gf * u).reshape(-1, u.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g, computed in float32 and cast back."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rms_normalize(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm(x) = (x - mean x) / sqrt(var x + eps) * g + b (``functional.layer_norm``),
    computed in float32 by torch's fused kernel and cast back; g starts at 1, b at 0."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        work = x.float()
        return F.layer_norm(work, (self.d_model,), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class SwiGLU(nn.Module):
    """SwiGLU(x) = W2 (SiLU(W1 x) * W3 x)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        # W1 x and W3 x as one GEMM against the stacked weights (as for Q, K, V);
        # F.silu is torch's fused x * sigmoid(x) (== functional.silu, tested).
        gate, up = gemm.linear(x, torch.cat((self.w1.weight, self.w3.weight))).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class SiLUFFN(nn.Module):
    """The ungated ablation: FFN(x) = W2 SiLU(W1 x)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)))


class ReLU2FFN(nn.Module):
    """The squared-ReLU FFN: FFN(x) = W2 relu(W1 x)^2."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(_ReLUSquared.apply(self.w1(x)))


class ReLUFFN(nn.Module):
    """The original Transformer's FFN without biases: FFN(x) = W2 relu(W1 x)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(torch.relu(self.w1(x)))


class _ReLUSquared(torch.autograd.Function):
    """relu(x)^2 (== functional.relu_squared, tested) with its gradient 2 relu(x) g written
    out: three passes over the (tokens, width) tensor where autograd through relu and
    square makes about seven, the FFN's largest tensor at this width."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        r = torch.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (r,) = ctx.saved_tensors
        return torch.addcmul(grad.new_zeros(()), grad, r, value=2.0)  # 2 r g in one pass


class _X0Mix(torch.autograd.Function):
    """a x + b x0 (== functional.x0_mix, tested) for 0-dim a and b, with its gradients
    written out: d x = a g, d x0 = b g, d a = <g, x>, d b = <g, x0>. Two passes forward and
    four back over the residual stream, where autograd through the equation makes about
    ten and allocates for each (1.6x faster at the cpu-small shape)."""

    @staticmethod
    def forward(ctx, x: Tensor, x0: Tensor, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(x, x0, a, b)
        return torch.addcmul(x * a, x0, b)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, x0, a, b = ctx.saved_tensors
        g = grad.reshape(-1)
        grad_a = torch.dot(g, x.reshape(-1).to(g.dtype)).to(a.dtype).reshape(a.shape)
        grad_b = torch.dot(g, x0.reshape(-1).to(g.dtype)).to(b.dtype).reshape(b.shape)
        return grad * a, grad * b, grad_a, grad_b


_FFNS = {"swiglu": SwiGLU, "silu": SiLUFFN, "relu2": ReLU2FFN, "relu": ReLUFFN}


# --------------------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------------------


def _sinusoidal_table(num_positions: int, d_model: int) -> Tensor:
    """``functional.sinusoidal_positions`` computed at once (tested equal): angle p / 10000^(j / d)
    for each even column j, its sine there and its cosine in column j + 1."""
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
    even = torch.arange(0, d_model, 2, dtype=torch.float64)
    angles = pos / torch.pow(10000.0, even / d_model)
    table = torch.zeros(num_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table.float()


def rotate_pairs_real(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The same rotation in real arithmetic: (x_2k cos - x_2k+1 sin, x_2k sin + x_2k+1 cos),
    the form ``RotaryEmbedding`` takes under torch.compile (inductor has no complex numbers)."""
    x_even, x_odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each pair (x[2k], x[2k+1]) by the angle  position * theta^(-2k/d_head).

        [x'_2k  ]   [cos a  -sin a] [x_2k  ]
        [x'_2k+1] = [sin a   cos a] [x_2k+1]

    which is the complex product  (x_2k + i x_2k+1) * e^(i a)  -- the form used below
    (one fused multiply instead of six elementwise ops; 5-10x faster on CPU).
    Since q and k at positions m and n are both rotated, q'.k' depends on n - m only.
    The cos/sin tables (max_seq_len, d_head/2) are float32 non-persistent buffers; the
    rotation runs in (at least) float32 and the result has the input's dtype.
    """

    def __init__(self, theta: float, d_head: int, max_seq_len: int, device=None):
        super().__init__()
        if d_head % 2:
            raise ValueError(f"RoPE needs an even d_head, got {d_head}")
        self.theta = theta
        self.d_head = d_head
        self.max_seq_len = max_seq_len
        k = torch.arange(0, d_head // 2, device=device, dtype=torch.float64)
        inv_freq = theta ** (-2.0 * k / d_head)  # (d_head/2,)
        positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)  # (max_seq_len, d_head/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, token_positions: Optional[Tensor] = None, *, offset: int = 0) -> Tensor:
        """x: (..., seq, d_head); token_positions: (seq,) or (batch, seq).

        Without token_positions the positions are offset, offset+1, ..., offset+seq-1.
        Positions broadcast against x's leading dims; (batch, seq) positions with an x of
        shape (batch, heads, seq, d_head) broadcast over the heads.
        """
        seq = x.shape[-2]
        if token_positions is None:
            if offset + seq > self.max_seq_len:
                raise ValueError(f"RoPE table has {self.max_seq_len} positions; asked for up to {offset + seq}")
            cos, sin = self.cos[offset : offset + seq], self.sin[offset : offset + seq]
        else:
            if token_positions.dim() >= 2 and x.dim() == token_positions.dim() + 2:
                token_positions = token_positions.unsqueeze(-2)  # (batch, 1, seq): over heads
            cos, sin = self.cos[token_positions], self.sin[token_positions]  # (..., seq, d/2)
        work = x.to(torch.promote_types(x.dtype, torch.float32))
        if is_compiling():  # inductor cannot generate code for complex ops; it fuses this form
            return rotate_pairs_real(work, cos, sin).to(x.dtype)
        if work.stride(-1) != 1 or work.storage_offset() % 2 or any(st % 2 for st in work.stride()[:-1]):
            work = work.contiguous()  # view_as_complex needs (re, im) adjacent and aligned
        pairs = torch.view_as_complex(work.unflatten(-1, (-1, 2)))  # x_2k + i x_2k+1
        rotation = torch.complex(cos.to(work.dtype), sin.to(work.dtype))  # e^(i a)
        return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() / .bfloat16() on the model must not round the tables:
        # follow device moves but keep them float32.
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        self.cos = cos.to(self.cos.device)
        self.sin = sin.to(self.sin.device)
        return self

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_head={self.d_head}, max_seq_len={self.max_seq_len}"


# --------------------------------------------------------------------------------------
# Causal multi-head self-attention
# --------------------------------------------------------------------------------------


_SDPA_HAS_GQA = torch.__version__ >= "2.5"  # F.scaled_dot_product_attention(..., enable_gqa=True)


def causal_mask(num_queries: int, num_keys: int, device=None) -> Tensor:
    """Bool (num_queries, num_keys): query i (at absolute position num_keys - num_queries + i)
    may attend key j iff j <= its position."""
    offset = num_keys - num_queries
    q_pos = torch.arange(offset, num_keys, device=device).unsqueeze(-1)
    k_pos = torch.arange(num_keys, device=device)
    return k_pos <= q_pos


class AttentionGate(nn.Module):
    """The sparse attention gate: sigmoid(x[..., :k] W_g^T), one gate per head and position,
    W_g of shape (num_heads, k). W_g starts at 0: every gate at 1/2, the modded-nanogpt
    speedrun's start; a gate of 1 would need W_g -> infinity, and the halving only rescales
    W_O's input, which the next steps (and Muon's normalized updates) absorb at once."""

    def __init__(self, num_heads: int, width: int, device=None, dtype=None):
        super().__init__()
        self.width = width
        # zeros draw nothing from the random stream: every other weight's init is unchanged
        self.weight = nn.Parameter(torch.zeros(num_heads, width, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        """x (batch, seq, d_model) -> gates (batch, num_heads, seq, 1), to scale the heads' outputs."""
        return torch.sigmoid(gemm.linear(x[..., : self.width], self.weight)).transpose(1, 2).unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"num_heads={self.weight.shape[0]}, width={self.width}"


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate Q, K, V and output projections.

    For each head h:  head_h = softmax(Q_h K_h^T / sqrt(d_head) + M) V_h,  with M the
    causal mask (-inf above the diagonal); out = W_O concat(head_1..head_H).
    RoPE (when given) rotates Q and K; V is never rotated. With ``num_kv_heads`` < num_heads
    (grouped-query attention) K and V have num_kv_heads heads and query head h reads
    key/value head h // (num_heads / num_kv_heads). With ``qk_norm`` each head's q and k
    are divided by their RMS after RoPE (``functional.qk_norm``, no weight); with
    ``qk_norm_gain`` too, before RoPE and times the learned gains ``q_norm.weight`` and
    ``k_norm.weight`` (Qwen3's order). With ``attn_gate`` each head's output is multiplied
    by its ``AttentionGate`` value before W_O.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: Optional[RotaryEmbedding] = None,
        attention: str = "fast",
        device=None,
        dtype=None,
        *,
        num_kv_heads: Optional[int] = None,
        qk_norm: bool = False,
        qk_norm_gain: bool = False,
        eps: float = 1e-5,
        dropout: float = 0.0,
        attn_gate: bool = False,
    ):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if attention not in _CHOICES["attention"]:
            raise ValueError(f"attention must be one of {_CHOICES['attention']}, got {attention!r}")
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.d_head = d_model // num_heads
        self.attention = attention
        self.qk_norm = qk_norm
        self.eps = eps
        self.dropout = dropout
        kv_dim = num_kv_heads * self.d_head
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, kv_dim, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, kv_dim, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.rope = rope
        self.q_norm = self.k_norm = None
        if qk_norm and qk_norm_gain:
            self.q_norm = RMSNorm(self.d_head, eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(self.d_head, eps, device=device, dtype=dtype)
        self.gate = AttentionGate(num_heads, min(12, d_model), device=device, dtype=dtype) if attn_gate else None

    def forward(
        self,
        x: Tensor,
        token_positions: Optional[Tensor] = None,
        *,
        mask: Optional[Tensor] = None,
        kv_cache: Optional[tuple[Tensor, Tensor]] = None,
        start_pos: Union[int, Tensor] = 0,
        value_embed: Optional[Tensor] = None,
    ) -> Tensor:
        """x: (batch, seq, d_model) -> (batch, seq, d_model).

        ``mask``: optional bool mask broadcastable to (batch, heads, seq, keys), True =
        may attend; None means causal (query i, at position start_pos + i, sees keys
        0 .. start_pos + i). ``kv_cache``: this layer's (k, v) buffers of shape
        (batch, kv_heads, max_len, d_head); the new keys (already rotated and normed) and
        values are written at [start_pos, start_pos + seq) and the queries attend over
        [0, start_pos + seq). Use the cache under ``torch.no_grad()`` (generation).
        ``start_pos`` may be a (batch,) tensor for one new token per row, each at its own
        position (continuous batching): row b's key goes to slot start_pos[b], the keys
        cover [0, max(start_pos) + 1) and ``mask`` must hide each row's unused slots.
        ``value_embed``: (batch, seq, kv_heads * d_head), added to the values (before the
        cache, so cached values hold it too).
        """
        batch, seq, _ = x.shape
        d_head = self.d_head

        def split_heads(t: Tensor) -> Tensor:  # (batch, seq, heads * d_head) -> (batch, heads, seq, d_head)
            return t.view(batch, seq, -1, d_head).transpose(1, 2)

        # Q, K, V = x W_Q^T, x W_K^T, x W_V^T as one GEMM against the stacked weights:
        # a wider matrix runs closer to peak than three narrow ones (the weights and their
        # checkpoint keys stay separate; the concatenation is 3 d^2 floats per call).
        qkv = gemm.linear(x, torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)))
        kv_dim = self.num_kv_heads * d_head
        q, k, v = (split_heads(t) for t in qkv.split((self.d_model, kv_dim, kv_dim), dim=-1))
        if value_embed is not None:
            v = v + split_heads(value_embed)

        if self.q_norm is not None:  # Qwen3's order: the gains do not commute with RoPE
            q, k = self._qk_normed(q, self.q_norm.weight), self._qk_normed(k, self.k_norm.weight)
        if self.rope is not None:  # positions default to start_pos, ..., start_pos + seq - 1
            q = self.rope(q, token_positions, offset=start_pos)
            k = self.rope(k, token_positions, offset=start_pos)
        if self.qk_norm and self.q_norm is None:
            q, k = self._qk_normed(q, None), self._qk_normed(k, None)

        if kv_cache is not None and isinstance(start_pos, Tensor):  # one token per row
            k_cache, v_cache = kv_cache
            rows = torch.arange(batch, device=x.device)
            end = int(start_pos.max()) + 1
            k_cache[rows, :, start_pos] = k[:, :, 0]
            v_cache[rows, :, start_pos] = v[:, :, 0]
            k = k_cache[:, :, :end].to(q.dtype)
            v = v_cache[:, :, :end].to(q.dtype)
        elif kv_cache is not None:
            k_cache, v_cache = kv_cache
            end = start_pos + seq
            k_cache[:, :, start_pos:end] = k
            v_cache[:, :, start_pos:end] = v
            k = k_cache[:, :, :end].to(q.dtype)
            v = v_cache[:, :, :end].to(q.dtype)

        # Which mask: given; plain causal (square); none (one new query sees the whole
        # cache); or causal with the queries at the end of a longer key range.
        num_keys = k.shape[-2]
        is_causal = mask is None and num_keys == seq
        if mask is None and seq > 1 and num_keys > seq:
            mask = causal_mask(seq, num_keys, device=x.device)

        drop = self.dropout if self.training else 0.0
        if self.attention == "fast":
            grouped = {}
            if self.num_kv_heads != self.num_heads:
                if _SDPA_HAS_GQA:
                    grouped = {"enable_gqa": True}
                else:
                    group = self.num_heads // self.num_kv_heads
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            if block_causal_applies(q, k, v, is_causal, drop):
                out = BlockCausalAttention.apply(q, k, v)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=drop, **grouped
                )
        else:
            if is_causal:
                mask = causal_mask(seq, num_keys, device=x.device)
            out = functional.grouped_query_attention(q, k, v, mask, drop)

        if self.gate is not None:
            out = out * self.gate(x).to(out.dtype)
        out = out.transpose(1, 2).reshape(batch, seq, self.d_model)  # concat heads
        return self.output_proj(out)

    def _qk_normed(self, t: Tensor, gain: Optional[Tensor]) -> Tensor:
        """functional.qk_norm's equation (times ``gain``); the fast path by torch's fused kernel."""
        if self.attention == "reference":
            t = functional.qk_norm(t, self.eps)
            return t if gain is None else t * gain
        return rms_normalize(t, gain, self.eps)


# --------------------------------------------------------------------------------------
# The Transformer block and the language model
# --------------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm:  h = x + Attn(RMSNorm(x));  y = h + FFN(RMSNorm(h)).
    Post-norm (ablation):  h = RMSNorm(x + Attn(x));  y = RMSNorm(h + FFN(h))."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        rope: Optional[RotaryEmbedding] = None,
        *,
        norm: str = "rms",
        norm_position: str = "pre",
        ffn: str = "swiglu",
        attention: str = "fast",
        eps: float = 1e-5,
        num_kv_heads: Optional[int] = None,
        qk_norm: bool = False,
        dropout: float = 0.0,
        qk_norm_gain: bool = False,
        attn_gate: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if norm_position not in _CHOICES["norm_position"]:
            raise ValueError(f"norm_position must be one of {_CHOICES['norm_position']}, got {norm_position!r}")
        if ffn not in _FFNS:
            raise ValueError(f"ffn must be one of {_CHOICES['ffn']}, got {ffn!r}")
        self.norm_position = norm_position
        self.ln1 = _make_norm(norm, d_model, eps, device, dtype)
        self.attn = CausalSelfAttention(
            d_model,
            num_heads,
            rope,
            attention=attention,
            device=device,
            dtype=dtype,
            num_kv_heads=num_kv_heads,
            qk_norm=qk_norm,
            qk_norm_gain=qk_norm_gain,
            eps=eps,
            dropout=dropout,
            attn_gate=attn_gate,
        )
        self.dropout = dropout
        self.ln2 = _make_norm(norm, d_model, eps, device, dtype)
        self.ffn = _FFNS[ffn](d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor, token_positions: Optional[Tensor] = None, **attn_kwargs) -> Tensor:
        p = self.dropout if self.training else 0.0  # on each branch's output, before the sum
        if self.norm_position == "pre":
            h = x + functional.dropout(self.attn(self.ln1(x), token_positions, **attn_kwargs), p)
            return h + functional.dropout(self.ffn(self.ln2(h)), p)
        h = self.ln1(x + functional.dropout(self.attn(x, token_positions, **attn_kwargs), p))
        return self.ln2(h + functional.dropout(self.ffn(h), p))


def _make_norm(norm: str, d_model: int, eps: float, device, dtype) -> nn.Module:
    if norm == "rms":
        return RMSNorm(d_model, eps, device=device, dtype=dtype)
    if norm == "layer":
        return LayerNorm(d_model, eps, device=device, dtype=dtype)
    if norm == "none":
        return nn.Identity()
    raise ValueError(f"norm must be one of {_CHOICES['norm']}, got {norm!r}")


SMEAR_WIDTH = 12  # smear's gate reads this many leading features of a position's embedding
BIGRAM_HASH_MULTIPLIERS = (1_000_003, 69_069)  # two fixed odd constants (bigram_hash)


def bigram_hash(prev: Tensor, ids: Tensor, buckets: int) -> Tensor:
    """The bigram embedding's bucket of each (previous, current) id pair:

        h(p, c) = (1000003 p XOR 69069 c) mod (buckets - 1)    for p >= 0
        h(-1, c) = buckets - 1                                  (no previous token)

    in int64 (no overflow for ids below 2^31), so always in [0, buckets)."""
    a, b = BIGRAM_HASH_MULTIPLIERS
    prev, ids = prev.long(), ids.long()
    h = torch.bitwise_xor(prev * a, ids * b) % (buckets - 1)
    return torch.where(prev >= 0, h, buckets - 1)


class TransformerLM(nn.Module):
    """ids (batch, seq) -> logits (batch, seq, vocab):
    embedding -> num_layers blocks -> final norm -> LM head (-> soft-cap, when on).

    Built from a ``ModelConfig`` (``from_config``) or from its fields as arguments; the
    switches and their equations are listed in this module's docstring."""

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10000.0,
        *,
        device=None,
        dtype=None,
        **switches: Any,
    ):
        super().__init__()
        cfg = ModelConfig(vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta, **switches)
        if cfg.vocab_size <= 0:
            raise ValueError(f"model.vocab_size must be a positive int, got {cfg.vocab_size!r}")
        self.config = cfg
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        rope = None
        if cfg.positions == "rope":
            rope = RotaryEmbedding(rope_theta, cfg.d_head, context_length, device=device)
        self.layers = nn.ModuleList(
            TransformerBlock(
                d_model,
                num_heads,
                cfg.ffn_hidden,
                rope,
                norm=cfg.norm,
                norm_position=cfg.norm_position,
                ffn=cfg.ffn,
                attention=cfg.attention,
                eps=cfg.norm_eps,
                num_kv_heads=cfg.kv_heads,
                qk_norm=cfg.qk_norm,
                dropout=cfg.dropout,
                qk_norm_gain=cfg.qk_norm_gain,
                attn_gate=cfg.attn_gate,
                device=device,
                dtype=dtype,
            )
            for _ in range(num_layers)
        )
        self.ln_final = _make_norm(cfg.norm, d_model, cfg.norm_eps, device, dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)
        if cfg.tie_embeddings:
            # One matrix, initialized as the LM head (see ModelConfig.tie_embeddings).
            self.token_embeddings.weight = self.lm_head.weight
        if cfg.zero_init_output:
            # After the other inits, so the random stream of every other weight is unchanged.
            with torch.no_grad():
                for layer in self.layers:
                    layer.attn.output_proj.weight.zero_()
                    layer.ffn.w2.weight.zero_()
        # Made last for the same reason; an Embedding's std-1 init matches the values' scale
        # (unit-RMS input through W_V's init).
        self.value_embeddings = nn.ModuleDict(
            {
                str(i): Embedding(vocab_size, cfg.kv_heads * cfg.d_head, device=device, dtype=dtype)
                for i in cfg.value_embed_layers
            }
        )
        if cfg.x0_mix:
            self.residual_scales = nn.Parameter(torch.ones(num_layers, device=device, dtype=dtype))
            self.x0_scales = nn.Parameter(torch.zeros(num_layers, device=device, dtype=dtype))
        # Absolute positions, made after every other weight (the random streams of the rest
        # stay those of the model without them).
        if cfg.positions == "learned":
            self.position_embeddings = Embedding(context_length, d_model, device=device, dtype=dtype)
        elif cfg.positions == "sinusoidal":
            table = _sinusoidal_table(context_length, d_model).to(device=device, dtype=dtype)
            self.register_buffer("position_table", table, persistent=False)
        if cfg.unet_skips:
            # Start at 1, the speedrun's choice: the late blocks read the early features from the
            # first step on (a start at 0 would leave them to the scale's own gradient), and the
            # norms in front of every branch and the head undo the larger residual's scale.
            self.skip_scales = nn.Parameter(torch.ones(num_layers // 2, device=device, dtype=dtype))
        self._short_layers = frozenset(cfg.short_window_layers)
        self._make_previous_token_weights(device, dtype)

    def _make_previous_token_weights(self, device, dtype) -> None:
        """The weights of ``smear`` and ``bigram_buckets``, made after every other weight (the
        random streams of the rest unchanged) and all zero: the model starts as without them."""
        cfg = self.config
        self.reads_previous_token = cfg.smear or cfg.bigram_buckets > 0
        if cfg.smear:
            # lambda starts at 0, not at the gate's 1/2: smearing then starts as a no-op whose
            # gradient <g_t, sigmoid(0) x_{t-1}> is not zero, so training turns it on as it helps.
            self.smear_gate = nn.Parameter(torch.zeros(min(SMEAR_WIDTH, cfg.d_model), device=device, dtype=dtype))
            self.smear_lambda = nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
        if cfg.bigram_buckets:
            self.bigram_embeddings = Embedding(cfg.bigram_buckets, cfg.d_model, device=device, dtype=dtype)
            with torch.no_grad():
                self.bigram_embeddings.weight.zero_()

    @classmethod
    def from_config(cls, cfg: ModelConfig, device=None, dtype=None) -> TransformerLM:
        d = cfg.to_dict()
        core = [
            d.pop(k)
            for k in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta")
        ]
        return cls(*core, device=device, dtype=dtype, **d)

    def forward(
        self,
        ids: Tensor,
        *,
        kv_cache: Optional[KVCache] = None,
        start_pos: Union[int, Tensor, None] = None,
        token_positions: Optional[Tensor] = None,
        targets: Optional[Tensor] = None,
        document_ids: Optional[Tensor] = None,
        head: bool = True,
    ) -> Tensor:
        """Logits (batch, seq, vocab) for ``ids`` (batch, seq); with ``targets`` (batch, seq),
        the mean cross-entropy loss instead; with ``head=False``, the last block's output
        (batch, seq, d_model), before the final norm: a prefill that only fills the cache skips
        the LM head.

        - ``targets``: the LM head and the loss run together
          (``functional.linear_cross_entropy``): the same loss as ``cross_entropy`` of the
          logits, without ever holding the (batch, seq, vocab) logits; what training uses.

        - ``kv_cache`` (from ``make_kv_cache``): the new positions' keys and values are
          stored at [start_pos, start_pos + seq) and attention covers the cached prefix;
          only the new positions are computed. ``start_pos`` defaults to the cache's
          ``length``, which is advanced to start_pos + seq. One start position is shared
          by the whole batch.
        - ``token_positions`` (seq,) or (batch, seq): explicit RoPE positions.
        - ``start_pos`` as a (batch,) LongTensor, with a cache and one new token per row:
          row b's token is at position start_pos[b] and attends to its cache slots
          [0, start_pos[b]] only; the rows of a continuous batch each at its own length.
        - ``document_ids`` (batch, seq) ints, non-decreasing along each row: a query attends
          only to earlier keys of its own document (``functional.document_mask``); what
          training passes with ``doc_mask`` (``functional.document_ids`` of the inputs).
          Not with a cache.
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must be (batch, seq), got shape {tuple(ids.shape)}")
        batch, seq = ids.shape
        cfg = self.config
        if isinstance(start_pos, Tensor):
            if kv_cache is None or seq != 1 or start_pos.shape != (batch,):
                raise ValueError("start_pos as a tensor needs a kv_cache, one new token per row and shape (batch,)")
            if bool((start_pos == start_pos[0]).all()):
                start_pos = int(start_pos[0])  # every row at one length: the plain path
            else:
                return self._forward_rows(ids, kv_cache, start_pos.to(ids.device), targets)
        start = 0
        if kv_cache is not None:
            start = kv_cache.length if start_pos is None else int(start_pos)
            if start + seq > kv_cache.max_seq_len:
                raise ValueError(f"KV cache holds {kv_cache.max_seq_len} positions; {start} + {seq} do not fit")
            if kv_cache.batch_size != batch:
                raise ValueError(f"KV cache is for batch {kv_cache.batch_size}, got batch {batch}")
        elif start_pos:
            raise ValueError("start_pos needs a kv_cache")
        end = start + seq
        if token_positions is None and cfg.positions != "none" and end > cfg.context_length:
            raise ValueError(f"sequence reaches position {end}, beyond context_length {cfg.context_length}")

        mask = None  # None: causal, built by each attention layer as needed
        if document_ids is not None:
            if kv_cache is not None:
                raise ValueError("document_ids cannot be combined with a kv_cache")
            if document_ids.shape != (batch, seq):
                raise ValueError(f"document_ids must be (batch, seq) = {(batch, seq)}, got {tuple(document_ids.shape)}")
            mask = functional.document_mask(document_ids)[:, None]  # (batch, 1, seq, seq): over heads

        short = self._short_mask(torch.arange(start, end, device=ids.device), end, mask)
        x = self._blocks(ids, token_positions, mask, kv_cache, start, short, document_ids)
        if kv_cache is not None:
            kv_cache.length = end
        return self._head(x, targets, document_ids) if head else x

    def _short_mask(self, query_positions: Tensor, num_keys: int, mask: Optional[Tensor]) -> Optional[Tensor]:
        """The short-window layers' mask (``short_window``): ``mask`` (None: causal) AND the
        window, for queries at ``query_positions`` over keys 0 .. num_keys - 1. None where no
        layer is short or the window hides nothing (every key within it): the short layers then
        take ``mask`` as the long ones do, and plain causal stays on SDPA's fast path."""
        if not self._short_layers or num_keys <= self.config.short_window:
            return None
        short = functional.sliding_window_mask(query_positions, num_keys, self.config.short_window)
        return short if mask is None else mask & short

    def _blocks(
        self,
        ids: Tensor,
        positions: Optional[Tensor],
        mask: Optional[Tensor],
        kv_cache: Optional[KVCache],
        start_pos,
        short_mask: Optional[Tensor] = None,
        document_ids: Optional[Tensor] = None,
    ) -> Tensor:
        """Embedding and blocks: the final hidden states of ``ids``; the layers of
        ``short_window`` attend under ``short_mask`` where it is given, the others under ``mask``."""
        x = self._embed(ids)
        if self.reads_previous_token:
            x = self._add_previous_token_terms(x, ids, kv_cache, start_pos, document_ids)
        if self.config.positions in ("sinusoidal", "learned"):
            x = x + self._absolute_positions(ids, positions, start_pos)
        if self.config.dropout and self.training:
            x = functional.dropout(x, self.config.dropout)
        x0 = x
        num_layers = len(self.layers)
        skips: list[Tensor] = []  # unet_skips: the outputs of the first num_layers // 2 blocks
        num_skips = num_layers // 2 if self.config.unet_skips else 0
        for i, layer in enumerate(self.layers):
            if i >= num_layers - num_skips:  # the skip first, then x0_mix (the speedrun's order)
                j = num_layers - 1 - i
                x = x + self.skip_scales[j] * skips[j]
            if self.config.x0_mix:  # the first block's x is x0 itself: one input, the equation
                mix = functional.x0_mix if x is x0 else _X0Mix.apply
                x = mix(x, x0, self.residual_scales[i], self.x0_scales[i])
            table = self.value_embeddings[str(i)] if str(i) in self.value_embeddings else None
            x = layer(
                x,
                positions,
                mask=short_mask if short_mask is not None and i in self._short_layers else mask,
                kv_cache=None if kv_cache is None else (kv_cache.keys[i], kv_cache.values[i]),
                start_pos=start_pos,
                value_embed=None if table is None else table(ids),
            )
            if i < num_skips:
                skips.append(x)
        return x

    def _embed(self, ids: Tensor) -> Tensor:
        """The token embeddings E[ids], divided by their RMS with ``embed_norm``."""
        x = self.token_embeddings(ids)
        return rms_normalize(x, None, self.config.norm_eps) if self.config.embed_norm else x

    def _add_previous_token_terms(
        self, x: Tensor, ids: Tensor, kv_cache: Optional[KVCache], start_pos, document_ids: Optional[Tensor]
    ) -> Tensor:
        """x plus token smearing's and the bigram embedding's terms (module docstring), each
        reading the token before each position: in ``ids``, else in the cache's token slots."""
        prev = self._previous_ids(ids, kv_cache, start_pos, document_ids)
        out = x
        if self.config.smear:
            # x_{t-1}: x shifted by one; before the first new position, the embedding of the
            # cached token (zeros stand for "none" and are multiplied away below)
            before = self._embed(prev[:, :1].clamp(min=0))
            x_prev = torch.cat((before, x[:, :-1]), dim=1) * (prev >= 0).unsqueeze(-1).to(x.dtype)
            gate = torch.sigmoid((x[..., : self.smear_gate.shape[0]] * self.smear_gate).sum(-1, keepdim=True))
            out = out + self.smear_lambda * gate * x_prev
        if self.config.bigram_buckets:
            out = out + self.bigram_embeddings(bigram_hash(prev, ids, self.config.bigram_buckets))
        return out

    def _previous_ids(
        self, ids: Tensor, kv_cache: Optional[KVCache], start_pos, document_ids: Optional[Tensor]
    ) -> Tensor:
        """The id before each position of ``ids`` (batch, seq), -1 where there is none (a
        sequence's first position; a document's first token with ``document_ids``). With a
        cache, the first new position's comes from the cache's token slots, and ``ids`` are
        recorded there (at start_pos, or at start_pos[b] in row b) for the positions after."""
        batch, seq = ids.shape
        first = ids.new_full((batch, 1), -1)
        if kv_cache is not None:
            tokens = kv_cache.tokens
            if isinstance(start_pos, Tensor):  # one new token per row, each at its own position
                rows = torch.arange(batch, device=ids.device)
                first = torch.where(start_pos > 0, tokens[rows, (start_pos - 1).clamp(min=0)], -1)[:, None]
                tokens[rows, start_pos] = ids[:, 0]
            else:
                if start_pos > 0:
                    first = tokens[:, start_pos - 1 : start_pos]
                tokens[:, start_pos : start_pos + seq] = ids
        prev = torch.cat((first, ids[:, :-1]), dim=1)
        if document_ids is not None:  # a document's first token has no previous token of its own
            prev[:, 1:].masked_fill_(document_ids[:, 1:] != document_ids[:, :-1], -1)
        return prev

    def _absolute_positions(self, ids: Tensor, positions: Optional[Tensor], start_pos) -> Tensor:
        """The position vectors added to the token embeddings: rows of the sinusoidal or
        learned table at ``positions``, else at start_pos, ..., start_pos + seq - 1."""
        if positions is None:
            positions = torch.arange(start_pos, start_pos + ids.shape[1], device=ids.device)
        if positions.numel() and int(positions.max()) >= self.config.context_length:
            raise ValueError(f"position {int(positions.max())} is beyond context_length {self.config.context_length}")
        table = self.position_embeddings.weight if self.config.positions == "learned" else self.position_table
        return F.embedding(positions, table).to(self.token_embeddings.weight.dtype)

    def _head(self, x: Tensor, targets: Optional[Tensor], document_ids: Optional[Tensor] = None) -> Tensor:
        """Final norm and LM head (soft-capped when on): logits, or the loss with ``targets``
        (in training, plus multi-token prediction's terms when ``mtp_weight`` is on)."""
        cap = self.config.logit_softcap
        if targets is not None:
            smoothing = self.config.label_smoothing if self.training else 0.0
            if self.training and self.config.mtp_weight:
                return self._mtp_loss(self.ln_final(x), targets, document_ids, smoothing)
            return functional.linear_cross_entropy(
                self.ln_final(x), self.lm_head.weight, targets, softcap_at=cap, label_smoothing=smoothing
            )
        logits = self.lm_head(self.ln_final(x))
        return functional.softcap(logits, cap) if cap else logits

    def _mtp_loss(self, h: Tensor, targets: Tensor, document_ids: Optional[Tensor], smoothing: float) -> Tensor:
        """CE(head(h_t), x_{t+1}) + sum over j = 1..mtp_depth of w^j CE(head(h_t), x_{t+1+j}),
        each term the mean over its own counted positions (``functional.future_targets``),
        all from one pass of the LM head (``functional.multi_target_cross_entropy``)."""
        cfg = self.config
        steps = range(1, cfg.mtp_depth + 1)
        every = torch.stack([targets] + [functional.future_targets(targets, j, document_ids) for j in steps])
        coefs = [1.0] + [cfg.mtp_weight**j for j in steps]
        return functional.multi_target_cross_entropy(
            h, self.lm_head.weight, every, coefs, softcap_at=cfg.logit_softcap, label_smoothing=smoothing
        )

    def _forward_rows(self, ids: Tensor, kv_cache: KVCache, start_pos: Tensor, targets: Optional[Tensor]) -> Tensor:
        """One token per row, row b at position start_pos[b] (see ``forward``)."""
        end = int(start_pos.max()) + 1
        if int(start_pos.min()) < 0 or end > kv_cache.max_seq_len or kv_cache.batch_size != ids.shape[0]:
            raise ValueError(
                f"start positions must lie in [0, {kv_cache.max_seq_len}) and the cache hold {ids.shape[0]} rows"
            )
        if self.config.positions != "none" and end > self.config.context_length:
            raise ValueError(f"sequence reaches position {end}, beyond context_length {self.config.context_length}")
        # (batch, 1, 1, keys): row b sees its own slots 0..start_pos[b], none of another row's longer past
        mask = (torch.arange(end, device=ids.device) <= start_pos[:, None])[:, None, None, :]
        short = self._short_mask(start_pos[:, None, None], end, mask)  # (batch, 1, 1, keys)
        x = self._blocks(ids, start_pos[:, None], mask, kv_cache, start_pos, short)
        kv_cache.length = end
        return self._head(x, targets)

    def make_kv_cache(self, batch_size: int, max_seq_len: Optional[int] = None, device=None, dtype=None) -> KVCache:
        """A zeroed KVCache for ``batch_size`` sequences of up to ``max_seq_len`` positions
        (default context_length), on the parameters' device and dtype unless given."""
        cfg = self.config
        max_seq_len = cfg.context_length if max_seq_len is None else max_seq_len
        if cfg.positions != "none" and max_seq_len > cfg.context_length:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds context_length {cfg.context_length} (the position table)"
            )
        p = self.lm_head.weight
        return KVCache.empty(
            cfg.num_layers,
            batch_size,
            cfg.kv_heads,
            max_seq_len,
            cfg.d_head,
            device=p.device if device is None else device,
            dtype=p.dtype if dtype is None else dtype,
        )

    def num_parameters(self) -> int:
        """Distinct parameters (a tied matrix counted once)."""
        return sum(p.numel() for p in self.parameters())


class KVCache:
    """Preallocated per-layer keys and values, (batch, kv_heads, max_seq_len, d_head) each,
    and the token id of each slot, ``tokens`` (batch, max_seq_len) int64.

    Keys are stored after RoPE. ``length`` is how many positions are filled; the model
    advances it. ``reset()`` reuses the buffers for a new batch of prompts. ``tokens`` is
    written by a model that reads the previous token (``smear``, ``bigram_buckets``): the
    first new position of a forward finds its previous token there.
    """

    def __init__(self, keys: list[Tensor], values: list[Tensor], tokens: Optional[Tensor] = None):
        self.keys = keys
        self.values = values
        if tokens is None:
            batch, _, max_seq_len, _ = keys[0].shape
            tokens = torch.zeros(batch, max_seq_len, dtype=torch.long, device=keys[0].device)
        self.tokens = tokens
        self.length = 0

    @classmethod
    def empty(
        cls, num_layers: int, batch_size: int, num_heads: int, max_seq_len: int, d_head: int, device=None, dtype=None
    ) -> KVCache:
        shape = (batch_size, num_heads, max_seq_len, d_head)
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        return cls(keys, values)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.keys[0].shape[2]

    def reset(self) -> None:
        self.length = 0

    def rows(self, start: int, stop: int) -> KVCache:
        """A cache over rows [start, stop) of this one: views, so writes land here."""
        view = KVCache(
            [k[start:stop] for k in self.keys], [v[start:stop] for v in self.values], self.tokens[start:stop]
        )
        view.length = self.length
        return view

    def copy_prefix(self, src: int, dst: Union[int, slice], length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row(s) ``dst``, in every
        buffer (keys, values and token ids): a row copied for another holds what it holds."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length] = buf[src, :, :length]
        self.tokens[dst, :length] = self.tokens[src, :length]


# --------------------------------------------------------------------------------------
# Accounting: parameters and FLOPs
# --------------------------------------------------------------------------------------


def count_parameters(cfg: ModelConfig) -> int:
    """Number of parameters of ``TransformerLM.from_config(cfg)`` (tied matrix once):

      V d                          token embedding
    + L (2 d^2 + 2 d d_kv          q, output | k, v projections (d_kv = kv_heads d_head)
         + 3 d d_ff | 2 d d_ff'    SwiGLU | SiLU or ReLU^2 FFN (d_ff' = ffn_hidden)
         + 2 d)                    ln1, ln2 gains        (0 with norm="none")
    + d                            final norm gain       (0 with norm="none")
    + V d                          LM head               (0 when tied)
    + V d_kv per value-embedding layer, 2 L with x0_mix, 2 L d_head with qk_norm_gain,
      floor(L / 2) with unet_skips, L num_heads min(12, d) with attn_gate
    + min(12, d) + 1 with smear, B d with bigram_buckets = B
    """
    d, V, L = cfg.d_model, cfg.vocab_size, cfg.num_layers
    norms = d if cfg.norm == "rms" else 0
    per_layer = _matmul_weights_per_layer(cfg) + 2 * norms
    extras = cfg.num_value_embeds * V * cfg.kv_heads * cfg.d_head + (2 * L if cfg.x0_mix else 0)
    extras += 2 * L * cfg.d_head if cfg.qk_norm_gain else 0
    extras += (L // 2 if cfg.unet_skips else 0) + (L * cfg.num_heads * cfg.attn_gate_width if cfg.attn_gate else 0)
    extras += (min(SMEAR_WIDTH, d) + 1 if cfg.smear else 0) + cfg.bigram_buckets * d
    return V * d + L * per_layer + norms + (0 if cfg.tie_embeddings else V * d) + extras


def flops_per_token(cfg: ModelConfig, seq_len: Optional[int] = None) -> int:
    """Forward FLOPs per token at sequence length ``seq_len`` (default context_length):

        2 N_matmul  +  2 * 2 * L * T * d

    N_matmul counts the weights used in matrix multiplies: per layer 2 d^2 + 2 d d_kv
    (attention projections) plus the FFN's, plus V d for the LM head (the embedding is a lookup,
    norms are elementwise). A multiply-add is 2 FLOPs. The second term is attention:
    per layer, Q K^T and (softmax) V each cost 2 T d per token, counted over the whole
    window T, not halved for causality (the convention of Kaplan et al. and PaLM's MFU); a
    ``short_window`` layer's window is min(T, short_window), so L T becomes the sum of the
    layers' windows. Training (forward + backward) is 3x this; MFU = 3 * flops_per_token *
    tokens/s / peak.
    """
    T = cfg.context_length if seq_len is None else seq_len
    d, L = cfg.d_model, cfg.num_layers
    n_matmul = L * _matmul_weights_per_layer(cfg) + cfg.vocab_size * d
    short = set(cfg.short_window_layers)
    windows = sum(min(T, cfg.short_window) if i in short else T for i in range(L))
    return 2 * n_matmul + 2 * 2 * windows * d


def _matmul_weights_per_layer(cfg: ModelConfig) -> int:
    """One block's matrix weights: q and output (d^2 each), k and v (d d_kv each), the FFN's."""
    d = cfg.d_model
    ffn = 3 * d * cfg.d_ff if cfg.ffn == "swiglu" else 2 * d * cfg.ffn_hidden
    return 2 * d * d + 2 * d * cfg.kv_heads * cfg.d_head + ffn

"""The functional building blocks of the Transformer LM, written as their equations.

These are the literal definitions the model is checked against:

    softmax(x)_i   = exp(x_i - max x) / sum_j exp(x_j - max x)
    silu(x)        = x * sigmoid(x)
    cross_entropy  = mean over positions of  logsumexp(logits) - logits[target]
    linear_cross_entropy(h, W, t) = cross_entropy(h W^T, t), without the logits tensor;
                     positions whose target is IGNORE_INDEX are left out of the mean
    attention      = softmax(Q K^T / sqrt(d_k) + mask) V
    grouped_query_attention: attention with key/value head h // (H / H_kv) for query head h
    qk_norm(x)     = x / sqrt(mean(x^2) + eps)              over each head's d_head
    relu_squared(x)= max(x, 0)^2
    softcap(z, c)  = c * tanh(z / c)
    x0_mix(x, x0, a, b) = a x + b x0
    document_ids   = number of end-of-text tokens at or before each position
    document_mask  = causal mask AND (query and key in one document)
    sliding_window_mask: query at p may attend key j iff p - w < j <= p
    layer_norm(x)  = (x - mean x) / sqrt(var x + eps) * g + b
    sinusoidal_positions: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same)
    dropout(x, p)  = x * mask / (1 - p), mask ~ Bernoulli(1 - p)

The model's default (fast) path uses torch's fused kernels for SiLU and attention,
which compute the same functions; ``tests/test_functional.py`` holds both to the
equations and to each other.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ferrolm.lm import gemm
from ferrolm.lm.device import cpu_vector_width, is_compiling

#: A target that ``linear_cross_entropy`` leaves out (torch's and Hugging Face's value): the
#: positions a loss mask turns off, such as every token of a conversation but the assistant's.
IGNORE_INDEX = -100

__all__ = [
    "softmax",
    "silu",
    "cross_entropy",
    "linear_cross_entropy",
    "IGNORE_INDEX",
    "scaled_dot_product_attention",
    "grouped_query_attention",
    "qk_norm",
    "relu_squared",
    "softcap",
    "x0_mix",
    "document_ids",
    "document_mask",
    "sliding_window_mask",
    "future_targets",
    "multi_target_cross_entropy",
]


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


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    softcap_at: float = 0.0,
    chunk_rows: int | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """``cross_entropy(hidden @ weight.T, targets)`` without the (N, vocab) logits; with
    ``softcap_at`` c > 0, of the soft-capped logits ``softcap(hidden @ weight.T, c)``.

    The LM head and the loss as one step: the positions are taken ``chunk_rows`` at a
    time, and for each chunk the logits are computed, reduced to the loss and, when a
    gradient is wanted, turned at once into the gradient (softmax - onehot) / N, which
    gives this chunk's share of d hidden and d weight; then the chunk is dropped. The
    arithmetic is that of ``cross_entropy`` on the full logits (tested equal); what
    changes is that no vocab-sized tensor outlives a chunk, so the softmax passes run in
    cache on a CPU and training memory drops by two (N, vocab) float32 tensors. The
    gradients are computed in the forward pass (the loss is the end of the graph, so
    the backward only scales them by the incoming gradient).

    With the cap, the gradient of the capped logits is multiplied by the derivative of
    c tanh(z / c), 1 - tanh(z / c)^2, kept for the chunk only.

    A target equal to ``IGNORE_INDEX`` adds nothing to the loss or its gradient, and the
    mean is over the other positions (0 when there are none): the loss of a masked batch.

    ``label_smoothing`` e in [0, 1): the target is (1 - e) on the true token plus e / V on
    every token (torch's ``label_smoothing``): per position logsumexp(o) - (1 - e) o[t]
    - e mean(o), with gradient softmax(o) - (1 - e) onehot(t) - e / V.

    ``hidden`` (..., d), ``weight`` (vocab, d), ``targets`` (...) class ids. Under
    autocast the GEMMs run in the autocast dtype and the softmax in float32. The default
    ``chunk_rows`` keeps a chunk's float32 logits near 8 MiB on a CPU (a share of L3)
    and near 256 MiB on a GPU (bounded memory, GEMMs still large), and takes at least 128
    rows (512 on a CPU whose widest vectors are AVX2, where larger GEMMs are what pays).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} must be targets {tuple(targets.shape)} plus a model dim"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight {tuple(weight.shape)} must be (vocab, {hidden.shape[-1]})")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).long()
    # Kept positions as 1.0, ignored ones as 0.0, and their count: tensors, so that no host
    # sync is needed to learn whether a batch is masked; with nothing ignored the products
    # below are exact (times 1.0), so an unmasked loss is bit-identical to the plain one.
    keep = (t != IGNORE_INDEX).to(torch.float32)
    t = t.masked_fill(t == IGNORE_INDEX, 0)
    if chunk_rows is None:
        chunk_rows = _chunk_rows(weight.shape[0], h.device)
    if not (softcap_at >= 0 and math.isfinite(softcap_at)):
        raise ValueError(f"linear_cross_entropy: softcap_at must be >= 0 (0: off), got {softcap_at}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"linear_cross_entropy: label_smoothing must be in [0, 1), got {label_smoothing}")
    # one target a row: the k = 1 case of the weighted loss that multi-token prediction sums
    args = (h, weight, t.unsqueeze(-1), keep.unsqueeze(-1), chunk_rows, float(softcap_at), float(label_smoothing))
    n = keep.sum().clamp(min=1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(*args, n)
    return _head_loss(*args)[0] / n


def _chunk_rows(vocab: int, device: torch.device) -> int:
    budget = (8 << 20) if device.type == "cpu" else (256 << 20)  # bytes of float32 logits
    rows = max(budget // (4 * vocab), 1)
    return max(_min_chunk_rows(device), 1 << (rows.bit_length() - 1))  # a power of two: whole GEMM tiles


def _min_chunk_rows(device: torch.device) -> int:
    """The fewest rows a chunk takes. On a CPU whose widest vectors are AVX2, 512: there the
    three GEMMs of a chunk, not its softmax passes, are the cost, and 128-row GEMMs ran at 3/4
    of the large ones' rate (the head of the TinyStories shape, vocab 10,000 and 2,048
    positions, forward and back: 944 ms in chunks of 128 rows, 851 ms in chunks of 512; 3.31 s
    and 2.95 s at vocab 32,768; Zen 3, one thread). Elsewhere 128."""
    return 512 if device.type == "cpu" and cpu_vector_width() == "AVX2" else 128


def _head_operands(h: Tensor, weight: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    """(the logits' GEMM input, h for d W, the weight), in the GEMM dtype.

    With a cap the logits' input is h (-2 / c) (``_chunk_loss_capped``), scaled in h's
    dtype. Under autocast the three are cast here once, as autocast would cast them at
    each chunk's three GEMMs (the same values: the same rounding, once instead of three
    times a chunk)."""
    head_in = h * (-2.0 / cap) if cap else h
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        return head_in.to(dtype), h.to(dtype), weight.to(dtype)
    return head_in, h, weight


def _head_logits(h: Tensor, weight: Tensor) -> Tensor:
    """float32 logits of a chunk (the GEMM in the autocast dtype, if any)."""
    logits = gemm.linear(h, weight)
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def _smoothed_target(logits: Tensor, targets: Tensor, smoothing: float) -> Tensor:
    """(1 - e) o[t] + e mean(o) for each of a row's targets (rows, k): what the loss subtracts
    from logsumexp(o)."""
    target_logit = logits.gather(-1, targets)
    if not smoothing:
        return target_logit
    return target_logit * (1.0 - smoothing) + logits.mean(dim=-1, keepdim=True) * smoothing


def _chunk_loss(logits: Tensor, targets: Tensor, weights: Tensor, smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """(Sum over the chunk's rows and targets (rows, k) of weights * (logsumexp(o) - o[t])
    (smoothed: see ``linear_cross_entropy``), the row sums of exp(o - max o)); leaves
    ``logits`` holding exp(o - max o)."""
    top = logits.amax(dim=-1, keepdim=True)
    target_logit = _smoothed_target(logits, targets, smoothing)
    exps = logits.sub_(top).exp_()
    sums = exps.sum(dim=-1, keepdim=True)
    return ((sums.log() + top - target_logit) * weights).sum(), sums


def _chunk_loss_capped(
    scaled_h: Tensor, weight: Tensor, targets: Tensor, weights: Tensor, cap: float, smoothing: float = 0.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The chunk's summed loss with capped logits o = c tanh(z / c), z = h W^T, by way of
    s = sigmoid(-2 z / c): c tanh(z / c) - c = -2 c s exactly, and 1 - tanh^2 = 4 s (1 - s).
    A sigmoid costs a quarter of a tanh on a CPU; -2 / c is applied to h before the GEMM
    (``scaled_h`` = h (-2 / c): d values, not vocab); and since o <= c, c is the shift that
    keeps exp in range (no max pass; exp(o - c) >= exp(-2c) stays a normal float for any
    cap up to 40).

    Returns (sum over the rows and targets of weights * (logsumexp(o) - o[t]), exp(o - c), its
    row sums, s).
    """
    gate = _head_logits(scaled_h, weight).sigmoid_()  # s
    shifted = gate * (-2.0 * cap)  # o - c
    target_logit = _smoothed_target(shifted, targets, smoothing)  # the shift c cancels
    exps = shifted.exp_()
    sums = exps.sum(dim=-1, keepdim=True)
    return ((sums.log() - target_logit) * weights).sum(), exps, sums, gate


def _chunk_forward(
    head_in: Tensor, weight: Tensor, targets: Tensor, weights: Tensor, cap: float, smoothing: float = 0.0
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """A chunk's (weighted summed loss, exp(o - shift), its row sums, s) from its rows of
    ``_head_operands``' first tensor, for targets and weights (rows, k): ``_chunk_loss_capped``
    with a cap, else the plain logits' loss (s None)."""
    if cap:
        return _chunk_loss_capped(head_in, weight, targets, weights, cap, smoothing)
    exps = _head_logits(head_in, weight)
    loss, sums = _chunk_loss(exps, targets, weights, smoothing)
    return loss, exps, sums, None


def _chunk_logits_grad(
    exps: Tensor, sums: Tensor, gate: Tensor | None, targets: Tensor, weights: Tensor, cap: float, smoothing: float
) -> Tensor:
    """The gradient of a chunk's weighted loss with respect to its logits, written over ``exps``:
    softmax(o) sum_j a_j - sum_j a_j onehot(t_j) for weights a (rows, k) (smoothed: onehot(t)
    becomes (1 - e) onehot(t) + e / V), through the cap when there is one."""
    w = weights.to(exps.dtype)
    w_sum = w.sum(dim=-1, keepdim=True)
    # exp(o - m) / sum = softmax; with the cap, 4 times the gradient: the 4 of the cap's
    # derivative below, folded in here. A row weighing 0 divides by sum / 0 = inf and adds 0:
    # a zero row, with no extra pass.
    scale = 0.25 if cap else 1.0
    grad = exps.div_(sums.mul_(scale).div_(w_sum))
    grad.scatter_add_(-1, targets, w * (-(1.0 - smoothing) / scale))
    if smoothing:  # and e / V off every token, in proportion to the row's weight
        grad.sub_(w_sum * (smoothing / (grad.shape[-1] * scale)))
    if gate is not None:  # through the cap: d o / d z = 1 - tanh(z / c)^2 = 4 s (1 - s)
        torch.ops.aten.sigmoid_backward.grad_input(grad, gate, grad_input=grad)
    return grad


def _head_loss(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    weights: Tensor,
    chunk_rows: int,
    cap: float,
    smoothing: float,
    grads: bool = False,
    divisor: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(sum_i sum_j weights[i, j] CE(h_i W^T, targets[i, j]), and with ``grads`` its d h and
    d W, the latter possibly a transposed view), for targets and weights (N, k), chunk by
    chunk: each chunk's logits serve its every target, and its gradient is folded into
    d h = G W and d W = G^T h before it is dropped. With ``divisor`` the gradients are those
    of the sum / divisor (the returned sum stays whole)."""
    head_in, h_mm, w_mm = _head_operands(h, weight, cap)
    total = h.new_zeros((), dtype=torch.float32)
    grad_h, grad_w = [], None
    # Where oneDNN runs the GEMMs, d W is accumulated transposed, (d, vocab) += h_cᵀ G_c: the
    # chunk's d x d side as the product's rows ran 1.8x faster there than (vocab, d) += G_cᵀ h_c
    # (Zen 5). torch's BLAS runs the two level (Zen 3, 60 ms each at the TinyStories head), and
    # (vocab, d) needs no transposing copy of the vocab-sized gradient at the end (7-30 ms there).
    transposed = grads and gemm.runs_on_onednn(h_mm, w_mm)
    grad_weights = weights if divisor is None else weights / divisor
    if grads:
        exact = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_w = torch.zeros(weight.shape[::-1] if transposed else weight.shape, dtype=exact, device=weight.device)
    for start in range(0, h.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        loss, exps, sums, gate = _chunk_forward(head_in[rows], w_mm, targets[rows], weights[rows], cap, smoothing)
        total = total + loss
        if not grads:
            continue
        grad = _chunk_logits_grad(exps, sums, gate, targets[rows], grad_weights[rows], cap, smoothing)
        grad = grad.to(w_mm.dtype)  # a no-op in float32; under autocast the GEMMs' dtype
        grad_h.append(gemm.matmul(grad, w_mm))
        if transposed:
            gemm.add_matmul_(grad_w, h_mm[rows].t().contiguous(), grad)
        else:
            gemm.add_matmul_(grad_w, grad.t(), h_mm[rows])
    if not grads:
        return total, None, None
    grad_w = grad_w.t() if transposed else grad_w
    return total, torch.cat(grad_h).to(h.dtype) if grad_h else torch.zeros_like(h), grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    """``_head_loss`` with its gradients formed in the forward pass, chunk by chunk: d loss /
    d logits_i = softmax(o_i) sum_j a_ij - sum_j a_ij onehot(t_ij), folded into d h = G W and
    d W = G^T h. The loss is the end of the graph, so the backward only scales them. With a
    ``divisor`` the loss is the sum / divisor, and the gradients are formed of that (so a mean
    loss's backward() multiplies nothing)."""

    @staticmethod
    def forward(ctx, h, weight, targets, weights, chunk_rows, cap, smoothing, divisor=None):
        total, grad_h, grad_w = _head_loss(h, weight, targets, weights, chunk_rows, cap, smoothing, True, divisor)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total if divisor is None else total / divisor

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        # A CPU loss's backward() starts from exactly 1: then the gradients are the ones formed,
        # with no pass over the vocab-sized d W (autograd copies a kept tensor before adding to it)
        if is_compiling() or grad_loss.device.type != "cpu" or bool(grad_loss != 1):
            grad_h, grad_w = grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss
        return grad_h, grad_w.to(ctx.weight_dtype).contiguous(), None, None, None, None, None, None


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0
) -> Tensor:
    """softmax(Q K^T / sqrt(d_k) + M) V for q (..., n, d_k), k (..., m, d_k), v (..., m, d_v).

    ``mask`` is boolean, broadcastable to (..., n, m); True means "query i may attend to
    key j". Masked scores become -inf, so they get probability exactly 0. A query whose
    row is entirely masked has no distribution and yields NaN. ``dropout_p`` > 0 drops
    attention weights (``dropout``) before they weigh V: what training does with dropout.
    """
    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (..., n, m)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return dropout(softmax(scores, dim=-1), dropout_p) @ v


def grouped_query_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0
) -> Tensor:
    """Attention of H query heads over H_kv key/value heads (H_kv divides H): query head h
    reads key/value head h // (H / H_kv), i.e. each K and V head is repeated H / H_kv times
    in place. q (..., H, n, d_k), k (..., H_kv, m, d_k), v (..., H_kv, m, d_v); with
    H_kv = H this is ``scaled_dot_product_attention``."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if heads % kv_heads:
        raise ValueError(f"grouped_query_attention: {kv_heads} key/value heads do not divide {heads} query heads")
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    return scaled_dot_product_attention(q, k, v, mask, dropout_p)


def dropout(x: Tensor, p: float) -> Tensor:
    """Each element zeroed with probability p, the rest scaled by 1 / (1 - p) (so the
    expectation is x); x itself when p is 0. The mask is drawn by ``torch.rand_like``
    through torch's own dropout (the same draws, so the model's dropout can be compared)."""
    return F.dropout(x, p, training=True) if p > 0 else x


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm (x - mean(x)) / sqrt(var(x) + eps) * g + b over the last dim (the variance
    without Bessel's correction), computed in (at least) float32 and cast back."""
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    mean = work.mean(dim=-1, keepdim=True)
    var = ((work - mean) ** 2).mean(dim=-1, keepdim=True)
    return ((work - mean) / torch.sqrt(var + eps) * weight.to(work.dtype) + bias.to(work.dtype)).to(x.dtype)


def sinusoidal_positions(num_positions: int, d_model: int) -> Tensor:
    """The original Transformer's position table (num_positions, d_model), float32:
    PE[p, 2i] = sin(p / 10000^(2i / d_model)), PE[p, 2i + 1] = cos(p / 10000^(2i / d_model))."""
    table = torch.zeros(num_positions, d_model, dtype=torch.float64)
    for p in range(num_positions):
        for j in range(0, d_model, 2):
            angle = p / 10000 ** (j / d_model)
            table[p, j] = math.sin(angle)
            if j + 1 < d_model:
                table[p, j + 1] = math.cos(angle)
    return table.float()


def qk_norm(x: Tensor, eps: float = 1e-5) -> Tensor:
    """RMS normalization of each head's vector, no weight: x / sqrt(mean(x^2) + eps) over the
    last dim, computed in (at least) float32 and cast back."""
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    return (work / torch.sqrt(work.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def relu_squared(x: Tensor) -> Tensor:
    """ReLU(x)^2 = max(x, 0)^2."""
    return torch.clamp(x, min=0) ** 2


def softcap(z: Tensor, cap: float) -> Tensor:
    """Soft-capping c * tanh(z / c): about z for |z| << c, never beyond +-c."""
    return cap * torch.tanh(z / cap)


def x0_mix(x: Tensor, x0: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """A block's input a x + b x0: the residual stream x scaled, the token embeddings x0 mixed in."""
    return a * x + b * x0


def document_ids(ids: Tensor, eos_id: int) -> Tensor:
    """For ids (..., seq): the number of ``eos_id`` tokens at or before each position. A
    document starts at its end-of-text token, so each eos opens the next document."""
    return torch.cumsum(ids == eos_id, dim=-1)


def document_mask(doc_ids: Tensor) -> Tensor:
    """Bool (..., seq, seq) from doc_ids (..., seq): query i may attend key j iff j <= i and
    both are in one document."""
    seq = doc_ids.shape[-1]
    pos = torch.arange(seq, device=doc_ids.device)
    causal = pos[None, :] <= pos[:, None]
    return causal & (doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2))


def sliding_window_mask(query_positions: Tensor, num_keys: int, window: int) -> Tensor:
    """Bool (*query_positions.shape, num_keys): the query at position p may attend key j iff
    p - window < j <= p (its own position and the window - 1 before it)."""
    keys = torch.arange(num_keys, device=query_positions.device)
    p = query_positions.unsqueeze(-1)
    return (keys <= p) & (keys > p - window)


def future_targets(targets: Tensor, shift: int, doc_ids: Tensor | None = None) -> Tensor:
    """Multi-token prediction's targets: for ``targets`` (..., seq), position i's target
    x_{i+1}, the token ``shift`` positions further on, x_{i+1+shift} = targets[i + shift];
    ``IGNORE_INDEX`` where that falls off the row or, with ``doc_ids`` (the inputs'
    ``document_ids``), lies in a later document than position i (an end-of-text token among
    x_{i+1} .. x_{i+shift}: doc_ids[i + shift] != doc_ids[i]). An ignored target stays ignored."""
    seq = targets.shape[-1]
    out = torch.full_like(targets, IGNORE_INDEX)
    if shift >= seq:
        return out
    ahead = targets[..., shift:]
    if doc_ids is not None:
        ahead = ahead.masked_fill(doc_ids[..., shift:] != doc_ids[..., : seq - shift], IGNORE_INDEX)
    out[..., : seq - shift] = ahead
    return out


def multi_target_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    coefs: list[float],
    *,
    softcap_at: float = 0.0,
    chunk_rows: int | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """sum_j coefs[j] linear_cross_entropy(hidden, weight, targets[j]) with one pass of the
    LM head: each chunk's logits are computed once and serve every target (multi-token
    prediction). ``targets`` (k, ...) with ``hidden`` (..., d); each term is the mean over
    its own kept positions (0 when there are none).

    The gradient of a chunk's logits is softmax(o) sum_j a_j - sum_j a_j onehot(t_j), with
    a_j = coefs[j] keep_j / N_j (label smoothing: onehot(t_j) becomes (1 - e) onehot + e / V),
    one buffer for every target."""
    if targets.shape[1:] != hidden.shape[:-1] or len(coefs) != targets.shape[0]:
        raise ValueError(
            f"multi_target_cross_entropy: targets {tuple(targets.shape)} must be (len(coefs) = {len(coefs)},) "
            f"plus hidden {tuple(hidden.shape)} less its model dim"
        )
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(targets.shape[0], -1).long()
    exact = torch.float64 if h.dtype == torch.float64 else torch.float32  # the loss's own precision
    keep = (t != IGNORE_INDEX).to(exact)
    # a_j per row before the keep mask: coefs[j] / N_j, tensors (no host sync)
    scale = torch.tensor(coefs, dtype=exact, device=h.device) / keep.sum(dim=1).clamp(min=1)
    t = t.masked_fill(t == IGNORE_INDEX, 0)
    if chunk_rows is None:
        chunk_rows = _chunk_rows(weight.shape[0], h.device)
    wants_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    weights = (keep * scale[:, None]).t().contiguous()  # (N, k): a chunk's rows are a slice
    args = (h, weight, t.t().contiguous(), weights, chunk_rows, float(softcap_at), float(label_smoothing))
    return _LinearCrossEntropy.apply(*args) if wants_grad else _head_loss(*args)[0]

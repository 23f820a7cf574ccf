"""AdamW, the cosine learning-rate schedule with warmup, and global-norm gradient clipping.

AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", Algorithm 2), for
each parameter θ with gradient g at step t = 1, 2, ...:

    θ ← θ − lr·λ·θ                          decoupled weight decay (not added to g)
    m ← β1·m + (1 − β1)·g                   first moment
    v ← β2·v + (1 − β2)·g²                  second moment
    m̂ = m / (1 − β1^t),  v̂ = v / (1 − β2^t)  bias correction
    θ ← θ − lr · m̂ / (sqrt(v̂) + ε)

This is the same update (and the same placement of ε) as ``torch.optim.AdamW``; the
tests hold the two together over 1,000 steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["AdamW", "param_groups_for_decay", "cosine_lr", "clip_grad_norm"]


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay and bias correction.

    Per-parameter state (``step``, ``exp_avg`` = m, ``exp_avg_sq`` = v) lives in
    ``self.state`` and therefore in ``state_dict()``, so a checkpoint restores it.
    Set ``group["lr"]`` before each step to follow a schedule (see ``cosine_lr``).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        if lr < 0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        if eps < 0:
            raise ValueError(f"invalid eps: {eps}")
        if weight_decay < 0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]

                p.mul_(1.0 - lr * wd)  # θ ← θ − lr·λ·θ
                m.lerp_(g, 1.0 - beta1)  # m ← β1 m + (1−β1) g  =  m + (1−β1)(g − m)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)  # v ← β2 v + (1−β2) g²
                bias1 = 1.0 - beta1**t
                bias2 = 1.0 - beta2**t
                # θ ← θ − lr · (m / bias1) / (sqrt(v / bias2) + ε)
                denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / bias1)
        return loss


def param_groups_for_decay(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups: matrices that decay, and the rest with weight_decay 0.

    No decay for 1-D parameters (RMSNorm gains, any bias) and for embedding matrices
    (any ``nn.Embedding`` or ``ferrolm.lm.model.Embedding`` weight; a tied embedding/LM-head
    matrix therefore does not decay). Each parameter appears once, in model order.
    """
    from ferrolm.lm.model import Embedding

    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, (Embedding, nn.Embedding))}
    decay, no_decay = [], []
    for p in model.parameters():  # deduplicated: a tied matrix is yielded once
        if not p.requires_grad:
            continue
        if p.dim() < 2 or id(p) in embedding_ids:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def cosine_lr(it: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int) -> float:
    """Learning rate at iteration ``it``: linear warmup, cosine decay, then constant.

    - it < warmup_iters:                       it / warmup_iters · max_lr
    - warmup_iters <= it <= cosine_cycle_iters: min_lr + ½(1 + cos(π (it − warmup)/(cycle − warmup)))(max_lr − min_lr)
    - it > cosine_cycle_iters:                 min_lr

    ``cosine_cycle_iters`` is an iteration number (where the decay ends), not a length.
    """
    if it < warmup_iters:
        return it / warmup_iters * max_lr
    if it > cosine_cycle_iters:
        return min_lr
    if cosine_cycle_iters == warmup_iters:  # a zero-length cycle: the peak, then min_lr
        return max_lr
    progress = (it - warmup_iters) / (cosine_cycle_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


@torch.no_grad()
def clip_grad_norm(params: Iterable[Tensor] | Tensor, max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale all gradients together so their global L2 norm is at most ``max_norm``.

    The global norm is ||(g_1, ..., g_n)||_2 over every parameter's gradient; when it
    exceeds max_norm every gradient is multiplied by max_norm / (norm + eps), otherwise
    they are left untouched (multiplied by exactly 1). Returns the norm before clipping
    as a 0-dim float32 tensor (no host sync; ``float()`` it to log). Parameters
    without a gradient are skipped.
    """
    if isinstance(params, Tensor):
        params = [params]
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads])
    total = torch.linalg.vector_norm(norms)
    scale = torch.clamp(max_norm / (total + eps), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total

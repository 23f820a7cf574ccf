"""AdamW, Muon, the learning-rate schedules (cosine, warmup-stable-decay) and global-norm clipping.

AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", Algorithm 2), for
each parameter θ with gradient g at step t = 1, 2, ...:

    θ ← θ − lr·λ·θ                          decoupled weight decay (not added to g)
    m ← β1·m + (1 − β1)·g                   first moment
    v ← β2·v + (1 − β2)·g²                  second moment
    m̂ = m / (1 − β1^t),  v̂ = v / (1 − β2^t)  bias correction
    θ ← θ − lr · m̂ / (sqrt(v̂) + ε)

This is the same update (and the same placement of ε) as ``torch.optim.AdamW``; the
tests hold the two together over 1,000 steps.

Muon (``Muon``) updates each 2-D hidden matrix W with gradient G by its momentum,
orthogonalised: with momentum μ, Nesterov on, lr η, decoupled decay λ,

    M ← μ·M + (1 − μ)·G                      momentum (an average of gradients)
    U = (1 − μ)·G + μ·M                       Nesterov: look one step ahead (U = M without)
    O = NS₅(U)                                U's singular values pushed towards 1
    W ← W − η·λ·W − η·s·O                     s = max(1, rows / cols)^½

NS₅ is five Newton-Schulz iterations with the quintic of the public Muon implementations:
X ← U / (‖U‖_F + 1e-7), then X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ and
(a, b, c) = (3.4445, −4.7750, 2.0315), on the wide orientation (rows <= cols; a tall matrix
is transposed and back). The iteration maps every singular value in (0, 1] into about
[0.7, 1.2], so O is close to the orthogonal factor of U's polar decomposition without an
SVD. The shape factor s gives a tall matrix (more outputs than inputs, such as the MLP's
up-projection) the same per-entry size of update as a square one. The embeddings, the LM
head, norm gains and other small parameters take AdamW in the same optimizer, each group
with its own learning rate (``muon_param_groups``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ferrolm.lm.device import use_bf16

__all__ = [
    "AdamW",
    "Muon",
    "param_groups_for_decay",
    "parameter_roles",
    "muon_param_groups",
    "newton_schulz",
    "newton_schulz_reference",
    "orthogonalizer_steps",
    "muon_shape_scale",
    "muon_momentum_at",
    "cosine_lr",
    "wsd_lr",
    "clip_grad_norm",
    "coalesce_grads",
]


# A sparse gradient's deferred rows are all brought up to date at least this often (AdamW._update_rows)
DEFERRED_SPAN = 32


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay and bias correction.

    Per-parameter state (``step``, ``exp_avg`` = m, ``exp_avg_sq`` = v) lives in
    ``self.state`` and therefore in ``state_dict()``, so a checkpoint restores it.
    Set ``group["lr"]`` before each step to follow a schedule (see ``cosine_lr``).

    Three ways to compute the same update, all tested equal:

    - ``fused`` (the default where torch has the kernel: CPU and CUDA tensors): torch's
      fused AdamW kernel, one pass over each parameter reading p, g, m, v once. On a CPU
      this is about 6x faster than the multi-tensor ops, which pass over memory once per
      line of the algorithm.
    - ``foreach``: each line of the update applied to a whole group at once with torch's
      multi-tensor ops (used for sharded FSDP2 parameters, and with ``fused=False``).
    - ``foreach=False``: the readable loop over parameters below, the reference.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        foreach: bool = True,
        fused: bool | None = None,
    ):
        if lr < 0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        if eps < 0:
            raise ValueError(f"invalid eps: {eps}")
        if weight_decay < 0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        if fused and not foreach:
            raise ValueError("fused=True and foreach=False ask for two different implementations")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=bool(foreach), fused=fused
        )
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict) -> None:
        # foreach and fused are how to compute, not state: a checkpoint does not switch them
        how = [(group["foreach"], group["fused"]) for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, (foreach, fused) in zip(self.param_groups, how):
            group["foreach"], group["fused"] = foreach, fused
        for state in self.state.values():  # torch casts a state tensor to its parameter's dtype
            if "row_step" in state:
                state["row_step"] = state["row_step"].long()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # refused before any parameter moves
            if group["weight_decay"] and any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
                raise ValueError("a sparse gradient's parameter cannot take weight decay: put it in a group with 0")
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
        for p in params:
            if p.grad.is_sparse:
                self._update_rows(group, p)
        params = [p for p in params if not p.grad.is_sparse]
        if not params:
            return
        if not group.get("foreach", True):
            self._update_loop(group, params)
        elif _use_fused(group.get("fused"), params):
            self._update_fused(group, params)
        else:
            self._update_foreach(group, params)

    def _update_loop(self, group: dict, params: list[Tensor]) -> None:
        """The reference: the algorithm line by line, one parameter at a time."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in params:
            g, state = p.grad, self.state[p]
            t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1.0 - lr * wd)  # θ ← θ − lr·λ·θ
            m.lerp_(g, 1.0 - beta1)  # m ← β1 m + (1−β1) g  =  m + (1−β1)(g − m)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)  # v ← β2 v + (1−β2) g²
            bias1 = 1.0 - beta1**t
            bias2 = 1.0 - beta2**t
            # θ ← θ − lr · (m / bias1) / (sqrt(v / bias2) + ε)
            denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bias1)

    def _update_rows(self, group: dict, p: Tensor) -> None:
        """AdamW for a sparse gradient (an embedding read by rows) at the cost of the rows read.

        Dense AdamW moves a row on every step, read or not: an unread row's gradient is 0, so
        its moments decay (m ← β1 m, v ← β2 v) and it keeps moving by lr m̂ / sqrt(v̂), and
        that tail is most of what a read moves a row. Here the unread rows' steps are
        deferred: each row remembers the step it is current to, and when it is read again (or
        every row is, by ``settle``) the steps it missed are applied at once in closed form.
        Over k missed steps after step s its moments become β1^k m and β2^k v, and it moves
        by −Σ_q lr_q sqrt(1−β2^q)/(1−β1^q) r^(q−s) · m/(sqrt(v) + ε'), r = β1/sqrt(β2): the
        dense updates exactly, but for ε' (ε as it weighs in the first missed step, where
        each later step weighs it more; it matters only where sqrt(v) is as small as ε).
        The coefficient sums are kept per step since the last settle, which comes at least
        every ``DEFERRED_SPAN`` steps, so they stay exact in float64. Weight decay would act
        on every row every step, so ``step`` refuses it before anything moves (no embedding decays).
        """
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]  # no decay: refused in step
        state = self.state[p]
        t = state["step"]
        if "row_step" not in state:  # every row is current before this step
            state["row_step"] = torch.full((p.shape[0],), t - 1, dtype=torch.long, device=p.device)
            state["drift_base"], state["drift_sums"] = t - 1, [0.0]
        base, sums = state["drift_base"], state["drift_sums"]
        r = beta1 / math.sqrt(beta2)
        sums.append(sums[-1] + lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t) * r ** (t - base))
        grad = p.grad.coalesce()  # a row read twice sums its gradients
        rows, g = grad.indices()[0], grad.values()
        w, m, v = self._caught_up(p, state, rows, t - 1, group["betas"], eps)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v.sqrt() / math.sqrt(1.0 - beta2**t)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / (1.0 - beta1**t))
        self._store_rows(p, state, rows, (w, m, v), t)
        if t - base >= DEFERRED_SPAN:
            self._settle_param(p, state, group)

    def _caught_up(self, p: Tensor, state: dict, rows: Tensor, upto: int, betas, eps: float):
        """(weight, m, v) of ``rows`` with their missed steps up to step ``upto`` applied."""
        (beta1, beta2), base = betas, state["drift_base"]
        r = beta1 / math.sqrt(beta2)
        w, m, v = (x.index_select(0, rows) for x in (p, state["exp_avg"], state["exp_avg_sq"]))
        since = state["row_step"].index_select(0, rows)  # each row is current to this step
        sums = torch.tensor(state["drift_sums"], dtype=torch.float64, device=p.device)
        coef = (sums[upto - base] - sums[since - base]) * torch.pow(r, -(since - base).double())
        # ε as it weighs in the first missed step (ε sqrt(1 − β2^(s+1)) / sqrt(β2) beside sqrt(v))
        eps_first = eps * torch.sqrt(1.0 - torch.pow(beta2, since + 1.0)) / math.sqrt(beta2)
        slope = torch.where(v > 0, m / (v.sqrt() + eps_first.to(v.dtype).unsqueeze(1)), torch.zeros_like(m))
        w.sub_(coef.to(w.dtype).unsqueeze(1) * slope)
        missed = (upto - since).double().unsqueeze(1)
        m.mul_(torch.pow(beta1, missed).to(m.dtype))
        v.mul_(torch.pow(beta2, missed).to(v.dtype))
        return w, m, v

    @staticmethod
    def _store_rows(p: Tensor, state: dict, rows: Tensor, values, step: int) -> None:
        for full, part in zip((p, state["exp_avg"], state["exp_avg_sq"]), values):
            full.index_copy_(0, rows, part)
        state["row_step"].index_fill_(0, rows, step)

    def _settle_param(self, p: Tensor, state: dict, group: dict) -> None:
        t = state["step"]
        rows = torch.arange(p.shape[0], device=p.device)
        self._store_rows(p, state, rows, self._caught_up(p, state, rows, t, group["betas"], group["eps"]), t)
        state["drift_base"], state["drift_sums"] = t, [0.0]

    @torch.no_grad()
    def settle(self) -> None:
        """Apply every deferred row update (see ``_update_rows``): the weights and moments
        then equal dense AdamW's. Training settles before evaluating and saving, and
        ``state_dict`` settles, so a checkpoint holds whole weights and moments."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if "row_step" in state and state["drift_base"] < state["step"]:  # else none is behind
                    self._settle_param(p, state, group)

    def state_dict(self) -> dict:
        self.settle()
        return super().state_dict()

    def _update_foreach(self, group: dict, params: list[Tensor]) -> None:
        """The same lines as ``_update_loop``, each applied to every parameter at once.

        The step counts are Python ints (a parameter that once had no gradient can lag),
        so the bias corrections are per-parameter host scalars: no device sync.
        """
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        states = [self.state[p] for p in params]
        m = [s["exp_avg"] for s in states]
        v = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_lerp_(m, grads, 1.0 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, [math.sqrt(1.0 - beta2**t) for t in steps])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m, denom, [-lr / (1.0 - beta1**t) for t in steps])

    def _update_fused(self, group: dict, params: list[Tensor]) -> None:
        """torch's fused kernel: the lines of ``_update_loop`` in one pass per parameter.

        The kernel reads each parameter's step from a tensor; the counts stay Python ints
        in the state (as for the other two ways), and each distinct count becomes one
        scalar made on the device (a fill, no host-to-device copy, no sync).
        """
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        batches: dict[tuple, list[Tensor]] = {}  # the kernel wants one device, dtype and step per call
        for p in params:
            batches.setdefault((p.device, p.dtype, self.state[p]["step"]), []).append(p)
        for (device, _, t), ps in batches.items():
            states = [self.state[p] for p in ps]
            step = torch.full((), float(t), dtype=torch.float32, device=device)
            torch._fused_adamw_(
                ps,
                [p.grad for p in ps],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                [step] * len(ps),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=wd,
                eps=eps,
                amsgrad=False,
                maximize=False,
            )


def _use_fused(fused: bool | None, params: list[Tensor]) -> bool:
    """Whether the fused kernel runs: asked for, or (None) available for every parameter."""
    if fused is False:
        return False
    ok = hasattr(torch, "_fused_adamw_") and all(
        p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        and p.grad.dtype == p.dtype
        and not hasattr(p, "full_tensor")  # a sharded DTensor (FSDP2) takes the multi-tensor ops
        for p in params
    )
    if fused and not ok:
        raise RuntimeError("AdamW(fused=True): torch's fused kernel does not cover these parameters")
    return ok


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


# ---------------------------------------------------------------------------------------
# Muon
# ---------------------------------------------------------------------------------------

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic (a, b, c) of the public Muon implementations
NS_EPS = 1e-7  # keeps a zero update zero in the first normalisation
# Polar Express (Amsel, Persson, Musco & Gower, 2025, arXiv:2505.16932): a quintic per step,
# each the minimax-optimal one for the singular values the steps before it leave, with the
# input normalised by POLAR_EXPRESS_SAFETY ||X||_F (the numbers the modded-nanogpt speedrun
# uses); steps past the fifth repeat the fifth.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02
ORTHOGONALIZERS = ("newton-schulz", "polar-express")
NORMUON_EPS = 1e-10  # under the square root of a row's second moment
GRAM_MIN_ASPECT = 2  # from this cols/rows on, newton_schulz's Gram form takes fewer flops (even at 1.5)
MUON_MIN_SIDE = 16  # a matrix with a side under this (a per-head gate, say) is a few numbers: AdamW


def muon_shape_scale(rows: int, cols: int) -> float:
    """The factor s of a (rows, cols) matrix's orthogonalised update: max(1, rows / cols)^½."""
    return max(1.0, rows / cols) ** 0.5


def orthogonalizer_steps(method: str, steps: int) -> tuple[float, list[tuple[float, float, float]]]:
    """(the factor on ||X||_F of the first normalisation, the (a, b, c) of each step) of
    ``method``: "newton-schulz" (one quintic, every step) or "polar-express"."""
    if method == "newton-schulz":
        return 1.0, [NS_COEFFICIENTS] * steps
    if method == "polar-express":
        table = POLAR_EXPRESS_COEFFICIENTS
        return POLAR_EXPRESS_SAFETY, [table[min(i, len(table) - 1)] for i in range(steps)]
    raise ValueError(f"the orthogonalizer must be one of {ORTHOGONALIZERS}, got {method!r}")


def newton_schulz_reference(u: Tensor, steps: int = 5, method: str = "newton-schulz") -> Tensor:
    """NS₅ of one matrix, written out: the reference the batched ``newton_schulz`` is held to.
    ``method="polar-express"`` takes Polar Express's quintic at each step instead.

    Computed in float32 on the wide orientation; returns a float32 matrix of ``u``'s shape.
    """
    safety, coefficients = orthogonalizer_steps(method, steps)
    x = u.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() * safety + NS_EPS)
    for a, b, c in coefficients:
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.T if tall else x


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """The dtype ``Muon`` orthogonalises in on ``device`` by default: bfloat16 where the
    hardware multiplies bf16 matrices natively (a CUDA GPU with bf16, a CPU with AMX or
    AVX512-BF16), else float32. On an AVX-512 Zen 5 the cpu-small shape's stacks ran 3-6x
    faster in bf16 (benches/results/learning.md); on an AVX2 CPU bf16 is emulated and
    ~30x slower. The update is orthogonalised, not accumulated, so bf16's rounding does not
    build up over steps (as the public Muon implementations run it on GPUs)."""
    return torch.bfloat16 if use_bf16("auto", device) else torch.float32


def newton_schulz(
    u: Tensor, steps: int = 5, dtype: torch.dtype = torch.float32, method: str = "newton-schulz"
) -> Tensor:
    """NS₅ of a stack of same-shape matrices (k, rows, cols) at once, in ``dtype``.

    The same iteration as ``newton_schulz_reference``, as batched matrix products with the
    polynomial's sums folded into them (``baddbmm``): one kernel per product for the whole
    stack, whatever k is. bfloat16 is what a GPU runs it in; on a CPU without bf16 matrix
    units float32 is the faster one (and the default). A float32 stack of matrices at least
    twice as wide as tall takes the Gram form (``_newton_schulz_gram``): the same
    polynomial in fewer flops.
    """
    safety, coefficients = orthogonalizer_steps(method, steps)
    x = u.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) * safety + NS_EPS)
    if dtype in (torch.float32, torch.float64) and x.shape[-1] >= GRAM_MIN_ASPECT * x.shape[-2]:
        x = _newton_schulz_gram(x, coefficients)
    else:
        for a, b, c in coefficients:
            gram = torch.bmm(x, x.mT)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A·A
            x = torch.baddbmm(x, poly, x, beta=a)  # a·X + poly·X
    return x.mT if tall else x


def _newton_schulz_gram(x: Tensor, coefficients: list[tuple[float, float, float]]) -> Tensor:
    """The NS iteration of wide matrices x (k, m, n), m < n, carried on m×m matrices.

    Each step is X ← P X with P = aI + bG + cG², G = X Xᵀ. Every P is a polynomial in
    G₀ = X₀ X₀ᵀ, so all of them commute with each other and with G₀, and after the steps
    X = Q X₀ with Q = P_last ⋯ P_first, while the next Gram matrix is P G P. So X₀ is
    read twice (G₀ and Q X₀: 4m²n flops) instead of twice a step (4m²n each): 4m²n + 34m³
    flops for five steps against 20m²n + 10m³, 44 % fewer at n = 4m. Only in float32 or
    wider: the Gram matrix squares the conditioning, which bfloat16 does not survive.
    """
    gram = torch.bmm(x, x.mT)
    q = None
    steps = len(coefficients)
    for i, (a, b, c) in enumerate(coefficients):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b·G + c·G·G
        poly.diagonal(dim1=-2, dim2=-1).add_(a)  # + a·I
        q = poly if q is None else torch.bmm(poly, q)
        if i + 1 < steps:
            gram = torch.bmm(poly, torch.bmm(gram, poly))  # the Gram matrix of P X
    return torch.bmm(q, x)


def muon_momentum_at(step: int, final: float, start: float, warmup_steps: int) -> float:
    """Muon's momentum at optimizer step ``step`` (0-based): linear from ``start`` to
    ``final`` over the first ``warmup_steps`` steps, then ``final`` (no warm-up at 0)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return final
    frac = step / warmup_steps
    return (1.0 - frac) * start + frac * final


def parameter_roles(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Each trainable parameter of ``model`` by its role, for choosing its optimizer.

    - ``"head"``: the LM head's weight (``model.lm_head``; a tied embedding is this matrix);
    - ``"embedding"``: the weight of every embedding table (any ``nn.Embedding`` or
      ``ferrolm.lm.model.Embedding`` module, wherever it sits: token or value embeddings);
    - ``"matrix"``: every other 2-D parameter with both sides at least ``MUON_MIN_SIDE``:
      the hidden maps of the blocks (attention and MLP projections, whatever their shapes);
    - ``"scalar"``: everything else: norm gains, biases, scalars, small gate matrices, and
      tensors of three or more dimensions.

    The classes are told apart by the module a weight belongs to and by its shape, never by
    its name, so parameters a model adds later land by what they are. Each parameter
    appears once (a tied matrix is yielded once), in model order.
    """
    from ferrolm.lm.model import Embedding

    head = getattr(model, "lm_head", None)
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, (Embedding, nn.Embedding))}
    roles: dict[str, list[nn.Parameter]] = {"matrix": [], "embedding": [], "head": [], "scalar": []}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in head_ids:
            roles["head"].append(p)
        elif id(p) in embedding_ids:
            roles["embedding"].append(p)
        elif p.dim() == 2 and min(p.shape) >= MUON_MIN_SIDE:
            roles["matrix"].append(p)
        else:
            roles["scalar"].append(p)
    return roles


def muon_param_groups(
    model: nn.Module,
    *,
    lr: float,
    embedding_lr: float,
    head_lr: float,
    scalar_lr: float,
    weight_decay: float = 0.0,
    head_weight_decay: float = 0.0,
    bigram_lr: float | None = None,
) -> list[dict]:
    """Parameter groups for ``Muon``: the hidden matrices (Muon, ``lr``, ``weight_decay``)
    and three AdamW groups, embeddings, LM head and scalars, each at its own learning rate.
    With ``bigram_lr`` the bigram table (``model.bigram_embeddings``) leaves the embedding
    group for a fourth, "bigram", at that rate.

    The head decays with ``head_weight_decay`` unless it is tied to the embedding; the
    embeddings and scalars never decay (as in ``param_groups_for_decay``). Each group
    carries ``lr_scale`` = its learning rate / ``lr``: a schedule that sets every group's
    lr to ``schedule(step) * lr_scale`` keeps their ratios. Empty groups are left out.
    """
    if not lr > 0:
        raise ValueError(f"lr must be positive (the other groups' lrs are kept as multiples of it), got {lr}")
    roles = parameter_roles(model)
    tied = bool(roles["head"]) and any(roles["head"][0] is getattr(m, "weight", None) for m in _embeddings(model))
    table = getattr(getattr(model, "bigram_embeddings", None), "weight", None)
    roles["bigram"] = [table] if bigram_lr is not None and table is not None else []
    roles["embedding"] = [p for p in roles["embedding"] if not any(p is q for q in roles["bigram"])]
    spec = [
        ("matrix", "muon", lr, weight_decay),
        ("embedding", "adamw", embedding_lr, 0.0),
        ("bigram", "adamw", bigram_lr, 0.0),
        ("head", "adamw", head_lr, 0.0 if tied else head_weight_decay),
        ("scalar", "adamw", scalar_lr, 0.0),
    ]
    return [
        {
            "params": roles[role],
            "kind": kind,
            "role": role,
            "lr": group_lr,
            "lr_scale": group_lr / lr,
            "weight_decay": wd,
        }
        for role, kind, group_lr, wd in spec
        if roles[role]
    ]


def _embeddings(model: nn.Module) -> list[nn.Module]:
    from ferrolm.lm.model import Embedding

    return [m for m in model.modules() if isinstance(m, (Embedding, nn.Embedding))]


class Muon(AdamW):
    """Muon for the hidden matrices, AdamW for the rest, in one optimizer.

    Each parameter group has ``kind`` "muon" (2-D parameters only) or "adamw" (default:
    "muon"), its own ``lr`` and ``weight_decay``; Muon groups have ``momentum``,
    ``nesterov`` and ``ns_steps``, AdamW groups ``betas`` and ``eps``, and their update is
    ``AdamW``'s (fused kernel where it runs). Build the groups with ``muon_param_groups``.
    The state of a Muon parameter is its ``momentum_buffer`` (and with ``normuon`` its rows'
    ``neuron_second_moment``): it is in ``state_dict()``, so a checkpoint restores it.

    Three switches of the Muon groups, each off by default (the modded-nanogpt speedrun's):

    - ``orthogonalizer="polar-express"``: Polar Express's quintic at each step
      (``orthogonalizer_steps``) instead of Newton-Schulz's one.
    - ``normuon=True`` (NorMuon, Li et al. 2025): each row (output neuron) of O divided by the
      root of its running mean square, v ← β₂ v + (1 − β₂) mean_j O_ij², Ô = O / sqrt(v + ε),
      then Ô rescaled to O's Frobenius norm, so the step's size stays Muon's and only its
      spread over the neurons is evened out (β₂ = ``normuon_beta2``).
    - ``cautious_weight_decay=True`` (Chen et al. 2025): the decay applied only where the
      update and the weight have the same sign (O_ij W_ij >= 0), where decay and update both
      pull the weight towards zero: W ← W − η λ (W ⊙ 1[O ⊙ W >= 0]) − η s O.

    Two ways to compute the Muon update, tested equal:

    - ``fast=True`` (default): the momentum of every matrix with multi-tensor ops; then, for
      each shape, the matrices' updates stacked and orthogonalised together by one batched
      ``newton_schulz`` in ``ns_dtype`` (default: ``newton_schulz_dtype``), and
      the decay and update applied to the whole group at once.
    - ``fast=False``: the readable loop over parameters, one ``newton_schulz_reference``
      each, in float32: the reference.

    Sharded parameters (FSDP2 DTensors) keep sharded momentum; the update of each matrix is
    gathered whole for the orthogonalisation (which needs all of it), computed alike on
    every process, and each keeps its own rows: the result equals one process's.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        fast: bool = True,
        ns_dtype: torch.dtype | None = None,
        fused: bool | None = None,
        orthogonalizer: str = "newton-schulz",
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        cautious_weight_decay: bool = False,
    ):
        self._muon_defaults = dict(
            kind="muon",
            momentum=momentum,
            nesterov=bool(nesterov),
            ns_steps=ns_steps,
            orthogonalizer=orthogonalizer,
            normuon=bool(normuon),
            normuon_beta2=normuon_beta2,
            cautious_weight_decay=bool(cautious_weight_decay),
        )
        self.fast = bool(fast)
        self.ns_dtype = ns_dtype
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)

    def add_param_group(self, param_group: dict) -> None:
        for k, v in self._muon_defaults.items():
            param_group.setdefault(k, v)
        kind = param_group["kind"]
        if kind not in ("muon", "adamw"):
            raise ValueError(f"parameter group kind must be 'muon' or 'adamw', got {kind!r}")
        if not 0.0 <= param_group["momentum"] < 1.0:
            raise ValueError(f"invalid momentum: {param_group['momentum']}")
        steps = param_group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"ns_steps must be a positive integer, got {steps!r}")
        orthogonalizer_steps(param_group["orthogonalizer"], 1)  # a known method, or ValueError
        if not 0.0 <= param_group["normuon_beta2"] < 1.0:
            raise ValueError(f"invalid normuon_beta2: {param_group['normuon_beta2']}")
        if param_group.get("lr", 0.0) < 0 or param_group.get("weight_decay", 0.0) < 0:
            raise ValueError("invalid learning rate or weight_decay in a parameter group")
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if kind == "muon":
            for p in params:
                if p.dim() != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got a parameter of shape {tuple(p.shape)}")
                if param_group["normuon"] and _is_sharded(p):
                    raise ValueError("normuon keeps whole rows' statistics: not with sharded (FSDP) parameters")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        kinds = [g["kind"] for g in self.param_groups]
        saved = [g.get("kind") for g in state_dict.get("param_groups", [])]
        if saved != kinds:
            raise ValueError(f"the saved parameter groups are of kinds {saved}, this optimizer's are {kinds}")
        super().load_state_dict(state_dict)

    def _step_group(self, group: dict) -> None:
        if group["kind"] == "adamw":
            super()._step_group(group)
            return
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["normuon"] and "neuron_second_moment" not in state:
                state["neuron_second_moment"] = torch.zeros(p.shape[0], device=p.device, dtype=torch.float32)
        if not params:
            return
        if self.fast:
            self._muon_fast(group, params)
        else:
            self._muon_loop(group, params)

    def _muon_loop(self, group: dict, params: list[Tensor]) -> None:
        """The reference: the update of the module docstring, one matrix at a time."""
        lr, wd, mu, steps = group["lr"], group["weight_decay"], group["momentum"], group["ns_steps"]
        for p in params:
            g, m = p.grad, self.state[p]["momentum_buffer"]
            m.mul_(mu).add_(g, alpha=1.0 - mu)  # M ← μ M + (1−μ) G
            u = (1.0 - mu) * g + mu * m if group["nesterov"] else m
            full = u.full_tensor() if _is_sharded(u) else u
            o = newton_schulz_reference(full, steps, group["orthogonalizer"])
            if group["normuon"]:  # each row by the root of its running mean square, then O's norm back
                v = self.state[p]["neuron_second_moment"]
                v.mul_(group["normuon_beta2"]).add_((o * o).mean(dim=1), alpha=1.0 - group["normuon_beta2"])
                evened = o / torch.sqrt(v + NORMUON_EPS)[:, None]
                o = evened * (o.norm() / (evened.norm() + NS_EPS))
            o = o * muon_shape_scale(*full.shape)
            if _is_sharded(p):
                o = _own_rows(o, p)
            if group["cautious_weight_decay"]:  # W ← W − η λ W where O and W agree in sign
                p.sub_(p * (o * p >= 0), alpha=lr * wd)
            else:
                p.mul_(1.0 - lr * wd)  # W ← W − η λ W
            p.add_(o.to(p.dtype), alpha=-lr)  # W ← W − η s O

    def _muon_fast(self, group: dict, params: list[Tensor]) -> None:
        """The same update: the momentum of the whole group with multi-tensor ops, then one
        batched Newton-Schulz per shape of matrix."""
        lr, wd, mu, steps = group["lr"], group["weight_decay"], group["momentum"], group["ns_steps"]
        grads = [p.grad for p in params]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_lerp_(bufs, grads, 1.0 - mu)  # M ← μ M + (1−μ) G
        updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
        by_shape: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            by_shape.setdefault((tuple(p.shape), p.dtype, p.device), []).append(i)
        for (shape, dtype, device), idx in by_shape.items():
            stack = torch.stack([updates[i].full_tensor() if _is_sharded(updates[i]) else updates[i] for i in idx])
            ns_dtype = self.ns_dtype or newton_schulz_dtype(device)
            ortho = newton_schulz(stack, steps, ns_dtype, method=group["orthogonalizer"])
            ps = [params[i] for i in idx]
            if group["normuon"]:
                ortho = self._normuon_stack(group, ps, ortho)
            ortho = ortho.to(dtype)
            outs = list(ortho.unbind(0))
            if _is_sharded(ps[0]):
                outs = [_own_rows(o, p) for o, p in zip(outs, ps)]
            if group["cautious_weight_decay"]:  # the decay only where O and W agree in sign
                decays = [p * (o * p >= 0) for o, p in zip(outs, ps)]
                torch._foreach_add_(ps, decays, alpha=-lr * wd)
            else:
                torch._foreach_mul_(ps, 1.0 - lr * wd)  # W ← W − η λ W
            torch._foreach_add_(ps, outs, alpha=-lr * muon_shape_scale(*shape))  # W ← W − η s O

    def _normuon_stack(self, group: dict, ps: list[Tensor], ortho: Tensor) -> Tensor:
        """NorMuon on a stack (k, rows, cols) of orthogonalised updates, in float32: each row
        by the root of its running mean square (the state updated), then each matrix back to
        its norm (the loop's arithmetic, a stack at a time)."""
        o = ortho.float()
        beta2 = group["normuon_beta2"]
        v = torch.stack([self.state[p]["neuron_second_moment"] for p in ps])
        v.mul_(beta2).add_((o * o).mean(dim=-1), alpha=1.0 - beta2)
        for p, row in zip(ps, v.unbind(0)):
            self.state[p]["neuron_second_moment"].copy_(row)
        evened = o / torch.sqrt(v + NORMUON_EPS)[..., None]
        norms = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
        return evened * (norms / (torch.linalg.vector_norm(evened, dim=(-2, -1), keepdim=True) + NS_EPS))


def _is_sharded(t: Tensor) -> bool:
    """A DTensor (an FSDP2 parameter, its gradient or state)."""
    return hasattr(t, "full_tensor")


def _own_rows(full: Tensor, like: Tensor) -> Tensor:
    """``full`` as a DTensor placed as ``like`` is: this process's shard, no communication
    (every process holds the same ``full``)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


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


def wsd_lr(it: float, max_lr: float, min_lr: float, warmup_iters: int, end_iters: int, decay_frac: float) -> float:
    """Learning rate at iteration ``it`` of a warmup-stable-decay schedule.

    - it < warmup_iters:            it / warmup_iters · max_lr
    - warmup_iters <= it < start:   max_lr                         (stable)
    - start <= it <= end_iters:     max_lr − (max_lr − min_lr)·(it − start)/(end_iters − start)
    - it > end_iters:               min_lr

    with start = max(warmup_iters, end_iters − decay_frac·end_iters): the linear warm-down
    takes the last ``decay_frac`` of the schedule (never the warmup). ``end_iters`` is an
    iteration number, as ``cosine_lr``'s cycle end.
    """
    if it < warmup_iters:
        return it / warmup_iters * max_lr
    if it > end_iters:
        return min_lr
    start = max(float(warmup_iters), end_iters - decay_frac * end_iters)
    if it < start or end_iters <= start:
        return max_lr
    return max_lr - (max_lr - min_lr) * (it - start) / (end_iters - start)


@torch.no_grad()
def clip_grad_norm(params: Iterable[Tensor] | Tensor, max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale all gradients together so their global L2 norm is at most ``max_norm``.

    The global norm is ||(g_1, ..., g_n)||_2 over every parameter's gradient; when it
    exceeds max_norm every gradient is multiplied by max_norm / (norm + eps), otherwise
    they are left untouched (multiplied by exactly 1). Returns the norm before clipping
    as a 0-dim float32 tensor. The scale stays a device tensor and the per-tensor norms
    and the scaling are multi-tensor ops, so there is no host sync (``float()`` the
    norm only when logging it). Parameters without a gradient are skipped.
    """
    grads = coalesce_grads(params)
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    by_kind: dict[tuple, list[Tensor]] = {}  # multi-tensor ops want one device and dtype per list
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    norms = [n.float().to(device) for group in by_kind.values() for n in torch._foreach_norm(group)]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if hasattr(total, "full_tensor"):  # sharded gradients (FSDP2): a partial norm, reduced on the device
        total = total.full_tensor()
    scale = torch.clamp(max_norm / (total + eps), max=1.0)
    for (dev, dtype), group in by_kind.items():
        torch._foreach_mul_(group, scale.to(device=dev, dtype=dtype))
    return total


def coalesce_grads(params: Iterable[Tensor] | Tensor) -> list[Tensor]:
    """Coalesce each sparse gradient of ``params`` in place (``p.grad`` becomes its coalesced
    form: a row read twice holds one summed gradient, so its norm is the dense gradient's) and
    return the tensors to measure or scale in place: the dense gradients, and a sparse
    gradient's values. Parameters without a gradient are skipped."""
    if isinstance(params, Tensor):
        params = [params]
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
            grads.append(p.grad._values())
        else:
            grads.append(p.grad)
    return grads

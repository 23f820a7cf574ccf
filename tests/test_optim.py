"""ferrolm.lm.optim: AdamW against torch.optim.AdamW, Muon against its literal update, the
schedules' values, clipping."""

from __future__ import annotations

import io
import math

import pytest
import torch

from ferrolm.lm import optim
from ferrolm.lm.model import TransformerLM
from ferrolm.lm.optim import (
    AdamW,
    Muon,
    clip_grad_norm,
    cosine_lr,
    muon_momentum_at,
    muon_param_groups,
    muon_shape_scale,
    newton_schulz,
    newton_schulz_reference,
    param_groups_for_decay,
    parameter_roles,
    wsd_lr,
)

pytestmark = pytest.mark.usefixtures("_single_thread")


def _problem(seed: int = 0):
    """A small least-squares problem with a 2-D and a 1-D parameter."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 10, generator=g)
    y = torch.randn(64, 3, generator=g)
    w = torch.randn(3, 10, generator=g) * 0.1
    b = torch.zeros(3)
    return x, y, w, b


def _run(opt_cls, steps: int, **kw):
    x, y, w0, b0 = _problem()
    w = w0.clone().requires_grad_()
    b = b0.clone().requires_grad_()
    opt = opt_cls([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], **kw)
    for it in range(steps):
        for group in opt.param_groups:  # a changing lr, as the training loop sets it
            group["lr"] = cosine_lr(it, 1e-2, 1e-3, 50, steps)
        opt.zero_grad()
        loss = ((x @ w.T + b - y) ** 2).mean()
        loss.backward()
        opt.step()
    return w.detach(), b.detach(), opt


def test_adamw_matches_torch_adamw_over_1000_steps():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    w_ours, b_ours, _ = _run(AdamW, 1000, fused=False, **kw)  # the multi-tensor ops
    w_torch, b_torch, _ = _run(torch.optim.AdamW, 1000, **kw)
    x, y, w0, _ = _problem()
    assert (w_ours - w0).abs().max() > 0.1  # it did move
    torch.testing.assert_close(w_ours, w_torch, atol=1e-6, rtol=0)
    torch.testing.assert_close(b_ours, b_torch, atol=1e-6, rtol=0)
    w_loop, b_loop, _ = _run(AdamW, 1000, foreach=False, **kw)
    torch.testing.assert_close(w_loop, w_torch, atol=1e-6, rtol=0)
    torch.testing.assert_close(b_loop, b_torch, atol=1e-6, rtol=0)


def test_adamw_fused_kernel_equals_torch_fused_adamw_over_1000_steps():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    w_ours, b_ours, opt = _run(AdamW, 1000, **kw)  # fused is the default on a CPU
    w_torch, b_torch, _ = _run(torch.optim.AdamW, 1000, fused=True, **kw)
    torch.testing.assert_close(w_ours, w_torch, atol=1e-6, rtol=0)
    torch.testing.assert_close(b_ours, b_torch, atol=1e-6, rtol=0)


def test_adamw_fused_update_equals_the_reference_loop_at_each_of_1000_steps():
    # The fused kernel rounds differently (FMA); over 1,000 free-running steps the
    # trajectories of this problem drift apart by ~1e-4 in either implementation of torch
    # too, so the update itself is compared: each step starts both from the same state.
    g = torch.Generator().manual_seed(5)
    shapes = [(6, 5), (5,), (4, 6), (3,)]
    start = [torch.randn(s, generator=g) for s in shapes]
    params = {k: [torch.nn.Parameter(x.clone()) for x in start] for k in ("fused", "loop")}
    opts = {
        k: AdamW(
            [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}],
            lr=1e-2,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            **({"fused": True} if k == "fused" else {"foreach": False}),
        )
        for k, ps in params.items()
    }
    for it in range(1000):
        grads = [torch.randn(s, generator=g) * (0.1 + it % 7) for s in shapes]
        for k in params:
            for group in opts[k].param_groups:
                group["lr"] = cosine_lr(it, 1e-2, 1e-3, 50, 1000)
            for p, gr in zip(params[k], grads):
                p.grad = gr.clone()
            opts[k].step()
        for a, b in zip(params["fused"], params["loop"]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
            a.data.copy_(b.data)
        for a, b in zip(params["fused"], params["loop"]):
            sa, sb = opts["fused"].state[a], opts["loop"].state[b]
            sa["exp_avg"].copy_(sb["exp_avg"]), sa["exp_avg_sq"].copy_(sb["exp_avg_sq"])
    assert opts["fused"].state[params["fused"][0]]["step"] == 1000


def test_adamw_fused_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="fused"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True, foreach=False)
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    p.grad = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="fused"):
        AdamW([p], fused=True).step()
    AdamW([p]).step()  # fused=None: the multi-tensor ops instead


def _run_mixed(foreach: bool, steps: int = 1000, fused: bool | None = False):
    """Parameters of several shapes in two groups; one of them gets a gradient only on
    every third step, so its step count (and bias correction) lags the others'."""
    g = torch.Generator().manual_seed(3)
    shapes = [(6, 5), (5,), (4, 6), (3,), (2, 3, 4)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    targets = [torch.randn(s, generator=g) for s in shapes]
    opt = AdamW(
        [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        foreach=foreach,
        fused=fused if foreach else None,
    )
    for it in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(it, 1e-2, 1e-3, 50, steps)
        opt.zero_grad(set_to_none=True)
        active = params if it % 3 == 0 else params[:-1]
        sum(((p.sin() - t) ** 2).sum() for p, t in zip(active, targets)).backward()
        opt.step()
    return [p.detach() for p in params], opt


def test_adamw_multi_tensor_step_equals_the_reference_loop_over_1000_steps():
    fast, opt_fast = _run_mixed(foreach=True)
    slow, opt_slow = _run_mixed(foreach=False)
    assert opt_fast.state[opt_fast.param_groups[1]["params"][-1]]["step"] == 334  # the lagging one
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert all(opt_fast.param_groups[i]["foreach"] for i in range(2))
    assert not any(opt_slow.param_groups[i]["foreach"] for i in range(2))


def test_adamw_foreach_is_kept_across_load_state_dict():
    p = torch.nn.Parameter(torch.zeros(2))
    saved = AdamW([p], foreach=False).state_dict()
    opt = AdamW([p])
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["foreach"] is True
    old = {**saved, "param_groups": [{k: v for k, v in g.items() if k != "foreach"} for g in saved["param_groups"]]}
    opt.load_state_dict(old)  # a checkpoint from before the option existed
    assert opt.param_groups[0]["foreach"] is True


def _forbid_host_syncs(monkeypatch):
    """Make every way of reading a tensor's value on the host raise."""

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in the step")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.parametrize("foreach", [True, False])
def test_clip_and_step_read_no_tensor_on_the_host(monkeypatch, foreach):
    model = TransformerLM(50, 8, 16, 2, 2, 24)
    opt = AdamW(param_groups_for_decay(model, 0.1), lr=1e-3, foreach=foreach)
    model(torch.randint(0, 50, (2, 8))).sum().backward()
    _forbid_host_syncs(monkeypatch)
    norm = clip_grad_norm(model.parameters(), 0.5)
    opt.step()
    monkeypatch.undo()
    assert float(norm) > 0


def test_adamw_weight_decay_is_decoupled():
    # zero gradient: Adam's update is 0, so only θ ← θ(1 − lr λ) acts
    p = torch.nn.Parameter(torch.full((4,), 2.0))
    opt = AdamW([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(4)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((4,), 2.0 * (1 - 0.1 * 0.5)))


def test_adamw_first_step_is_lr_times_sign():
    # after bias correction, step 1 moves each coordinate by lr·g/(|g| + ε') ≈ lr·sign(g)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = AdamW([p], lr=0.01, weight_decay=0.0)
    p.grad = torch.tensor([3.0, -0.5, 1e-3])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([-0.01, 0.01, -0.01]), atol=1e-6, rtol=0)


def test_adamw_state_round_trips_through_state_dict():
    x, y, w0, b0 = _problem()

    def make(w, b):
        return AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)

    def steps(opt, w, b, n):
        for _ in range(n):
            opt.zero_grad()
            ((x @ w.T + b - y) ** 2).mean().backward()
            opt.step()

    # 30 uninterrupted steps
    w_ref, b_ref = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    steps(make(w_ref, b_ref), w_ref, b_ref, 30)

    # 20 steps, save through torch.save / weights_only load, restore into a fresh optimizer, 10 more
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = make(w, b)
    steps(opt, w, b, 20)
    sd = opt.state_dict()
    assert sd["state"][0]["step"] == 20 and set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    w2, b2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    opt2 = make(w2, b2)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    steps(opt2, w2, b2, 10)
    torch.testing.assert_close(w2.detach(), w_ref.detach(), atol=0, rtol=0)
    torch.testing.assert_close(b2.detach(), b_ref.detach(), atol=0, rtol=0)

    # without the restored state the trajectory differs (so the check above can fail)
    w3, b3 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    steps(make(w3, b3), w3, b3, 10)
    assert not torch.allclose(w3, w_ref, atol=1e-6)


def test_adamw_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError):
        AdamW(p, lr=-1)
    with pytest.raises(ValueError):
        AdamW(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError):
        AdamW(p, weight_decay=-0.1)


def test_param_groups_for_decay_skips_norms_and_embeddings():
    model = TransformerLM(50, 8, 16, 2, 2, 24)
    groups = param_groups_for_decay(model, 0.1)
    decay_ids = {id(p) for p in groups[0]["params"]}
    no_decay_ids = {id(p) for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    names = dict((id(p), n) for n, p in model.named_parameters())
    assert {names[i] for i in no_decay_ids} == {
        "token_embeddings.weight",
        "ln_final.weight",
        *(f"layers.{i}.{ln}.weight" for i in range(2) for ln in ("ln1", "ln2")),
    }
    assert "lm_head.weight" in {names[i] for i in decay_ids}
    assert len(decay_ids) + len(no_decay_ids) == len(list(model.parameters()))
    AdamW(groups, lr=1e-3)  # usable as is

    tied = TransformerLM(50, 8, 16, 1, 2, 24, tie_embeddings=True)
    groups = param_groups_for_decay(tied, 0.1)
    all_params = groups[0]["params"] + groups[1]["params"]
    assert len(all_params) == len({id(p) for p in all_params}) == len(list(tied.parameters()))
    assert any(p is tied.lm_head.weight for p in groups[1]["params"])


# ------------------------------------------------------------------- schedule ---------


def test_cosine_lr_values():
    max_lr, min_lr, warmup, cycle = 1.0, 0.1, 10, 110
    assert cosine_lr(0, max_lr, min_lr, warmup, cycle) == 0.0
    assert cosine_lr(5, max_lr, min_lr, warmup, cycle) == pytest.approx(0.5)  # warmup: 5/10
    assert cosine_lr(9, max_lr, min_lr, warmup, cycle) == pytest.approx(0.9)
    assert cosine_lr(10, max_lr, min_lr, warmup, cycle) == pytest.approx(1.0)  # peak
    # mid-cycle: cos(π/2) = 0 -> min + (max - min)/2 = 0.55
    assert cosine_lr(60, max_lr, min_lr, warmup, cycle) == pytest.approx(0.55)
    # a quarter in: min + ½(1 + cos(π/4))(max - min) = 0.1 + 0.5 (1 + 0.707107) 0.9 = 0.868198
    assert cosine_lr(35, max_lr, min_lr, warmup, cycle) == pytest.approx(0.868198, abs=1e-6)
    assert cosine_lr(110, max_lr, min_lr, warmup, cycle) == pytest.approx(0.1)  # end of cycle
    assert cosine_lr(111, max_lr, min_lr, warmup, cycle) == 0.1  # after the cycle
    assert cosine_lr(10_000, max_lr, min_lr, warmup, cycle) == 0.1


def test_cosine_lr_is_monotone_after_warmup_and_handles_no_warmup():
    lrs = [cosine_lr(it, 3e-4, 3e-5, 0, 100) for it in range(120)]
    assert lrs[0] == pytest.approx(3e-4)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert cosine_lr(5, 1.0, 0.0, 5, 5) == 1.0 and cosine_lr(6, 1.0, 0.0, 5, 5) == 0.0


# ------------------------------------------------------------------- clipping ---------


def _params_with_grads(grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_clip_leaves_small_gradients_unchanged():
    grads = [torch.tensor([0.3, -0.4]), torch.tensor([[0.0, 1.2]])]  # norm sqrt(.09+.16+1.44) = 1.3
    params = _params_with_grads(grads)
    norm = clip_grad_norm(params, max_norm=2.0)
    assert float(norm) == pytest.approx(1.3, abs=1e-6)
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)


def test_clip_scales_large_gradients_to_the_norm():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0]]), torch.tensor([12.0])]  # norm 13
    params = _params_with_grads(grads)
    params.append(torch.nn.Parameter(torch.ones(2)))  # no grad: skipped
    norm = clip_grad_norm(params, max_norm=1.0)
    assert float(norm) == pytest.approx(13.0)
    total = math.sqrt(sum(float((p.grad**2).sum()) for p in params if p.grad is not None))
    assert total == pytest.approx(1.0, abs=1e-6)
    # direction kept: every gradient scaled by the same 1/13
    torch.testing.assert_close(params[0].grad, torch.tensor([3 / 13, 0.0]))
    torch.testing.assert_close(params[2].grad, torch.tensor([12 / 13]))


def test_clip_matches_torch_clip_grad_norm():
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(5, 4, generator=g) * 10, torch.randn(7, generator=g), torch.randn(3, dtype=torch.float64)]
    ours, theirs = _params_with_grads(grads), _params_with_grads(grads)
    n1 = clip_grad_norm(ours, 0.5)
    n2 = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert n1.dtype == torch.float32  # the documented dtype, whatever the gradients are
    torch.testing.assert_close(n1.double(), n2)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


# ------------------------------------------------------------------- Muon --------------


def _quintic_of_singular_values(u: torch.Tensor, steps: int) -> torch.Tensor:
    """NS₅ the long way round: in float64, through the SVD. Each iteration maps X = P·diag(σ)·Qᵀ
    to P·diag(aσ + bσ³ + cσ⁵)·Qᵀ, so NS₅(U) = P·diag(f⁵(σ / ‖σ‖))·Qᵀ with f the scalar quintic."""
    a, b, c = 3.4445, -4.7750, 2.0315
    P, sigma, Qt = torch.linalg.svd(u.double(), full_matrices=False)
    x = sigma / (sigma.square().sum().sqrt() + 1e-7)  # ‖U‖_F = the 2-norm of the singular values
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return P @ torch.diag(x) @ Qt


@pytest.mark.parametrize("shape", [(24, 24), (12, 40), (40, 12)])
def test_newton_schulz_reference_is_the_quintic_on_the_singular_values(shape):
    g = torch.Generator().manual_seed(1)
    u = torch.randn(*shape, generator=g)
    out = newton_schulz_reference(u, 5)
    expected = _quintic_of_singular_values(u, 5)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)
    # the point of it: singular values near 1 (the quintic's band), where they were spread
    sv = torch.linalg.svdvals(out)
    assert sv.min() > 0.6 and sv.max() < 1.25
    assert torch.linalg.svdvals(u).max() / torch.linalg.svdvals(u).min() > 2


def test_newton_schulz_batched_equals_the_reference_for_each_matrix():
    g = torch.Generator().manual_seed(2)
    for shape in [(5, 32, 32), (3, 48, 20), (2, 20, 48), (1, 16, 64)]:
        u = torch.randn(*shape, generator=g) * 3.0
        batched = newton_schulz(u, 5)
        for i in range(shape[0]):
            torch.testing.assert_close(batched[i], newton_schulz_reference(u[i], 5), atol=2e-6, rtol=0)
    assert newton_schulz(torch.zeros(2, 16, 16), 5).abs().max() == 0  # no NaN from a zero update


def test_newton_schulz_in_bfloat16_stays_near_the_float32_reference():
    # what a GPU, or a CPU with native bf16, runs: the same orthogonalisation to bf16's precision
    g = torch.Generator().manual_seed(4)
    for shape in [(5, 32, 32), (3, 48, 20), (2, 20, 48), (2, 64, 256)]:
        u = torch.randn(*shape, generator=g) * 3.0
        low = newton_schulz(u, 5, torch.bfloat16)
        assert low.dtype == torch.bfloat16
        exact = torch.stack([newton_schulz_reference(m, 5) for m in u])
        assert float((low.float() - exact).norm() / exact.norm()) < 0.03
        assert float((low.float() - exact).norm() / exact.norm()) > 1e-4  # it did run in bf16


def test_muon_orthogonalises_in_bfloat16_where_the_cpu_multiplies_it_natively(monkeypatch):
    from ferrolm.lm import device

    cpu = torch.device("cpu")
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert optim.newton_schulz_dtype(cpu) == torch.bfloat16
    dtypes = []
    real = optim.newton_schulz

    def recording(u, steps, dtype=torch.float32, **kw):
        dtypes.append(dtype)
        return real(u, steps, dtype, **kw)

    monkeypatch.setattr(optim, "newton_schulz", recording)
    w = torch.nn.Parameter(torch.randn(32, 32))
    w.grad = torch.randn(32, 32)
    Muon([w]).step()
    Muon([w], ns_dtype=torch.float32).step()
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert optim.newton_schulz_dtype(cpu) == torch.float32
    Muon([w]).step()
    assert dtypes == [torch.bfloat16, torch.float32, torch.float32]


def test_muon_shape_scale():
    assert muon_shape_scale(64, 64) == 1.0
    assert muon_shape_scale(32, 64) == 1.0  # wide: as square
    assert muon_shape_scale(128, 32) == 2.0  # tall: sqrt(rows / cols)


def _literal_muon(w0, grads, *, lr, mu, wd, nesterov=True):
    """The Muon update of the module docstring, written out for one matrix."""
    w, m = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        m = mu * m + (1 - mu) * g
        u = (1 - mu) * g + mu * m if nesterov else m
        o = newton_schulz_reference(u, 5) * max(1.0, w.shape[0] / w.shape[1]) ** 0.5
        w = w - lr * wd * w - lr * o
    return w


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_steps_follow_the_literal_update(fast, nesterov):
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(40, 24, generator=gen) * 0.1
    grads = [torch.randn(40, 24, generator=gen) for _ in range(4)]
    w = torch.nn.Parameter(w0.clone())
    opt = Muon([w], lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1, fast=fast, ns_dtype=torch.float32)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    expected = _literal_muon(w0, grads, lr=0.05, mu=0.9, wd=0.1, nesterov=nesterov)
    torch.testing.assert_close(w.detach(), expected, atol=2e-6, rtol=0)
    assert (w.detach() - w0).abs().max() > 0.02  # it moved
    # Nesterov or not is a different trajectory (so the parametrisation tests something)
    other = _literal_muon(w0, grads, lr=0.05, mu=0.9, wd=0.1, nesterov=not nesterov)
    assert not torch.allclose(w.detach(), other, atol=1e-4)


def _train_tiny(opt_factory, steps: int, seed: int = 0):
    """A few steps of a tiny LM on fixed random batches; the final weights by name."""
    torch.manual_seed(seed)
    model = TransformerLM(64, 16, 32, 2, 4, 48)
    opt = opt_factory(model)
    ids = torch.randint(0, 64, (steps, 4, 17), generator=torch.Generator().manual_seed(seed + 1))
    for step in range(steps):
        for group in opt.param_groups:  # a schedule, as the loop sets one
            group["lr"] = cosine_lr(step + 1, 0.05, 0.005, 2, steps) * group.get("lr_scale", 1.0)
            if group.get("kind") == "muon":
                group["momentum"] = muon_momentum_at(step, 0.95, 0.85, 3)
        loss = model(ids[step, :, :-1], targets=ids[step, :, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt


def _muon_for(model, fast=True):
    groups = muon_param_groups(model, lr=0.05, embedding_lr=0.1, head_lr=0.01, scalar_lr=0.02, weight_decay=0.1)
    return Muon(groups, lr=0.05, momentum=0.95, weight_decay=0.0, fast=fast, ns_dtype=torch.float32)


def test_muon_batched_step_equals_the_reference_loop_on_a_small_model():
    fast, _ = _train_tiny(lambda m: _muon_for(m, fast=True), 8)
    loop, _ = _train_tiny(lambda m: _muon_for(m, fast=False), 8)
    start, _ = _train_tiny(lambda m: _muon_for(m), 0)
    for name in fast:
        torch.testing.assert_close(fast[name], loop[name], atol=1e-5, rtol=0, msg=name)
    moved = max(float((fast[n] - start[n]).abs().max()) for n in fast if ".attn." in n)
    assert moved > 0.05


def test_muon_orthogonalises_once_per_shape_not_per_parameter(monkeypatch):
    calls = []
    real = optim.newton_schulz

    def counting(u, *a, **k):
        calls.append(tuple(u.shape))
        return real(u, *a, **k)

    monkeypatch.setattr(optim, "newton_schulz", counting)
    _train_tiny(lambda m: _muon_for(m), 1)
    # 2 layers: q, k, v, out (32x32) x 2, w1, w3 (48x32) x 2, w2 (32x48) x 2: three stacks
    assert sorted(calls) == [(2, 32, 48), (4, 48, 32), (8, 32, 32)]


def test_parameter_roles_follow_modules_and_shapes():
    from torch import nn

    model = TransformerLM(64, 16, 32, 2, 4, 48)
    names = {id(p): n for n, p in model.named_parameters()}
    roles = {role: {names[id(p)] for p in ps} for role, ps in parameter_roles(model).items()}
    assert roles["head"] == {"lm_head.weight"}
    assert roles["embedding"] == {"token_embeddings.weight"}
    assert roles["scalar"] == {"ln_final.weight", *(f"layers.{i}.{n}.weight" for i in range(2) for n in ("ln1", "ln2"))}
    assert roles["matrix"] == {
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "ffn.w1", "ffn.w2", "ffn.w3")
    }
    # parameters a model may add land by what they are: a lookup table in a block (value
    # embeddings), a per-head gate matrix, a learned scalar
    block = model.layers[0]
    block.value_embeddings = nn.Embedding(64, 32)
    block.gate = nn.Parameter(torch.zeros(4, 32))
    block.lam = nn.Parameter(torch.ones(()))
    roles = parameter_roles(model)
    assert any(p is block.value_embeddings.weight for p in roles["embedding"])
    assert any(p is block.gate for p in roles["scalar"]) and any(p is block.lam for p in roles["scalar"])
    assert sum(len(v) for v in roles.values()) == len(list(model.parameters()))

    tied = TransformerLM(64, 16, 32, 1, 4, 48, tie_embeddings=True)
    roles = parameter_roles(tied)
    assert roles["embedding"] == [] and roles["head"] == [tied.lm_head.weight]
    groups = muon_param_groups(tied, lr=0.02, embedding_lr=0.2, head_lr=0.004, scalar_lr=0.01, head_weight_decay=0.1)
    assert [g["role"] for g in groups] == ["matrix", "head", "scalar"]
    assert groups[1]["weight_decay"] == 0.0  # tied: the embedding does not decay


def test_muon_param_groups_lrs_and_decay():
    model = TransformerLM(64, 16, 32, 2, 4, 48)
    groups = muon_param_groups(
        model, lr=0.02, embedding_lr=0.2, head_lr=0.004, scalar_lr=0.01, weight_decay=0.05, head_weight_decay=0.1
    )
    by_role = {g["role"]: g for g in groups}
    assert {r: (g["kind"], g["lr"], g["weight_decay"]) for r, g in by_role.items()} == {
        "matrix": ("muon", 0.02, 0.05),
        "embedding": ("adamw", 0.2, 0.0),
        "head": ("adamw", 0.004, 0.1),
        "scalar": ("adamw", 0.01, 0.0),
    }
    assert by_role["embedding"]["lr_scale"] == pytest.approx(10.0)
    opt = Muon(groups)
    assert opt.param_groups[0]["momentum"] == 0.95 and opt.param_groups[0]["ns_steps"] == 5
    with pytest.raises(ValueError, match="lr must be positive"):
        muon_param_groups(model, lr=0.0, embedding_lr=0.2, head_lr=0.004, scalar_lr=0.01)


def test_muon_adamw_groups_take_the_adamw_update():
    # the AdamW groups of Muon are AdamW: after a step (same weights, same gradients) they
    # hold what AdamW alone on those groups gives
    def adamw_part(model):
        return AdamW([g for g in _muon_for(model).param_groups if g["kind"] == "adamw"], lr=0.01)

    a, _ = _train_tiny(adamw_part, 1)
    b, _ = _train_tiny(_muon_for, 1)
    start, _ = _train_tiny(_muon_for, 0)
    assert not torch.equal(b["lm_head.weight"], start["lm_head.weight"])
    for name in ("token_embeddings.weight", "lm_head.weight", "ln_final.weight"):
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def test_muon_state_round_trips_through_state_dict():
    straight, _ = _train_tiny(lambda m: _muon_for(m), 6)

    torch.manual_seed(0)
    model = TransformerLM(64, 16, 32, 2, 4, 48)
    ids = torch.randint(0, 64, (6, 4, 17), generator=torch.Generator().manual_seed(1))

    def steps(opt, rng):
        for step in rng:
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step + 1, 0.05, 0.005, 2, 6) * group.get("lr_scale", 1.0)
                if group.get("kind") == "muon":
                    group["momentum"] = muon_momentum_at(step, 0.95, 0.85, 3)
            model(ids[step, :, :-1], targets=ids[step, :, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    opt = _muon_for(model)
    steps(opt, range(3))
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"momentum_buffer"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    again = _muon_for(model)
    again.load_state_dict(torch.load(buf, weights_only=True))
    steps(again, range(3, 6))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), straight[name], atol=0, rtol=0, msg=name)

    with pytest.raises(ValueError, match="kinds"):  # an AdamW state is not a Muon state
        _muon_for(model).load_state_dict(AdamW(param_groups_for_decay(model, 0.1)).state_dict())


def test_muon_rejects_bad_groups_and_hyperparameters():
    w = torch.nn.Parameter(torch.zeros(16, 16))
    v = torch.nn.Parameter(torch.zeros(16))
    with pytest.raises(ValueError, match="2-D"):
        Muon([v])
    with pytest.raises(ValueError, match="kind"):
        Muon([{"params": [w], "kind": "sgd"}])
    with pytest.raises(ValueError, match="ns_steps"):
        Muon([w], ns_steps=0)
    with pytest.raises(ValueError, match="momentum"):
        Muon([w], momentum=1.0)
    with pytest.raises(ValueError):
        Muon([w], lr=-1.0)
    Muon([{"params": [w]}, {"params": [v], "kind": "adamw"}])  # a 1-D parameter is fine with AdamW


def test_muon_momentum_warmup_values():
    assert muon_momentum_at(0, 0.95, 0.85, 300) == pytest.approx(0.85)
    assert muon_momentum_at(150, 0.95, 0.85, 300) == pytest.approx(0.90)
    assert muon_momentum_at(300, 0.95, 0.85, 300) == 0.95
    assert muon_momentum_at(10_000, 0.95, 0.85, 300) == 0.95
    assert muon_momentum_at(0, 0.95, 0.85, 0) == 0.95  # no warm-up


def test_wsd_lr_values():
    # warmup 10, end 100, warm-down over the last 20 % = steps 80..100, 1e-3 -> 1e-4
    def literal(it):
        if it < 10:
            return it / 10 * 1e-3
        if it < 80:
            return 1e-3
        if it <= 100:
            return 1e-3 - (1e-3 - 1e-4) * (it - 80) / 20
        return 1e-4

    for it in [0, 5, 10, 11, 50, 79, 80, 81, 90, 99, 100, 101, 500, 85.5]:
        assert wsd_lr(it, 1e-3, 1e-4, 10, 100, 0.2) == pytest.approx(literal(it), rel=1e-12, abs=1e-15), it
    assert wsd_lr(90, 1e-3, 1e-4, 10, 100, 0.2) == pytest.approx(5.5e-4)
    # a warm-down longer than the room after warmup starts where warmup ends
    assert wsd_lr(10, 1.0, 0.0, 10, 20, 0.9) == 1.0
    assert wsd_lr(15, 1.0, 0.0, 10, 20, 0.9) == pytest.approx(0.5)
    assert wsd_lr(0, 1.0, 0.0, 0, 10, 1.0) == 1.0 and wsd_lr(5, 1.0, 0.0, 0, 10, 1.0) == pytest.approx(0.5)

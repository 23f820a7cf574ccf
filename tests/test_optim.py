"""ferrolm.lm.optim: AdamW against torch.optim.AdamW, the schedule's values, clipping."""

from __future__ import annotations

import io
import math

import pytest
import torch

from ferrolm.lm.model import TransformerLM
from ferrolm.lm.optim import AdamW, clip_grad_norm, cosine_lr, param_groups_for_decay


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: one intra-op thread is faster, and immune to a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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

"""Muon's speedrun switches against literal references: Polar Express, NorMuon and cautious
weight decay; the fast path equal to the readable loop with each of them."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from ferrolm.lm import optim
from ferrolm.lm.config import ConfigError, load_config
from ferrolm.lm.optim import Muon, newton_schulz, newton_schulz_reference

PE = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def polar_express_by_hand(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() * 1.02 + 1e-7)
    for i in range(steps):
        a, b, c = PE[min(i, 4)]
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return (x.T if tall else x).float()


@pytest.mark.parametrize("shape", [(24, 24), (16, 48), (48, 16), (8, 40)])
def test_polar_express_is_the_papers_quintics(shape):
    torch.manual_seed(0)
    u = torch.randn(*shape)
    want = polar_express_by_hand(u)
    torch.testing.assert_close(newton_schulz_reference(u, 5, "polar-express"), want, rtol=1e-4, atol=1e-4)
    stack = torch.stack([u, 2 * u, -u])  # batched, through the Gram form when wide enough
    got = newton_schulz(stack, 5, torch.float32, method="polar-express")
    for g, k in zip(got, (1, 1, -1)):
        torch.testing.assert_close(g, k * want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(
        newton_schulz_reference(u, 7, "polar-express"), polar_express_by_hand(u, 7), atol=1e-4, rtol=1e-4
    )


def test_polar_express_orthogonalises_more_closely_than_newton_schulz():
    torch.manual_seed(1)
    u = torch.randn(64, 64) @ torch.diag(torch.logspace(-2, 0, 64))  # singular values over two decades
    pe = torch.linalg.svdvals(newton_schulz_reference(u, 5, "polar-express"))
    ns = torch.linalg.svdvals(newton_schulz_reference(u, 5))
    assert (pe - 1).abs().max() < (ns - 1).abs().max()
    with pytest.raises(ValueError, match="orthogonalizer must be one of"):
        newton_schulz_reference(u, 5, "svd")


def _muon_by_hand(w0, grads, lr, wd, mu, beta2, normuon, cautious, method):
    """Muon's update written out for one (rows, cols) matrix, Nesterov on."""
    w, m = w0.clone(), torch.zeros_like(w0)
    v = torch.zeros(w0.shape[0])
    scale = max(1.0, w0.shape[0] / w0.shape[1]) ** 0.5
    for g in grads:
        m = mu * m + (1 - mu) * g
        u = (1 - mu) * g + mu * m
        o = newton_schulz_reference(u, 5, method)
        if normuon:
            v = beta2 * v + (1 - beta2) * (o**2).mean(dim=1)
            evened = o / torch.sqrt(v + 1e-10)[:, None]
            o = evened * o.norm() / evened.norm()
        o = scale * o
        if cautious:
            w = w - lr * wd * w * ((o * w) >= 0).float()
        else:
            w = w - lr * wd * w
        w = w - lr * o
    return w


SWITCHES = list(itertools.product(["newton-schulz", "polar-express"], [False, True], [False, True]))


@pytest.mark.parametrize("method, normuon, cautious", SWITCHES)
@pytest.mark.parametrize("fast", [False, True])
def test_muon_switches_equal_the_update_by_hand(method, normuon, cautious, fast):
    torch.manual_seed(2)
    shapes = [(32, 16), (16, 48), (32, 16)]  # two of one shape: stacked together on the fast path
    ws = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    grads = [[torch.randn(*s) for _ in range(4)] for s in shapes]
    opt = Muon(
        ws,
        lr=0.05,
        momentum=0.9,
        weight_decay=0.3,
        fast=fast,
        ns_dtype=torch.float32,
        orthogonalizer=method,
        normuon=normuon,
        normuon_beta2=0.9,
        cautious_weight_decay=cautious,
    )
    start = [w.detach().clone() for w in ws]
    for step in range(4):
        for w, g in zip(ws, grads):
            w.grad = g[step]
        opt.step()
    for w, w0, g in zip(ws, start, grads):
        want = _muon_by_hand(w0, g, 0.05, 0.3, 0.9, 0.9, normuon, cautious, method)
        torch.testing.assert_close(w.detach(), want, rtol=2e-4, atol=2e-5)
    if normuon:
        assert opt.state[ws[0]]["neuron_second_moment"].shape == (32,)


def test_each_switch_changes_the_step():
    torch.manual_seed(3)
    w0, g = torch.randn(32, 16), torch.randn(32, 16)

    def step(**kw):
        w = torch.nn.Parameter(w0.clone())
        w.grad = g
        Muon([w], lr=0.05, weight_decay=0.5, **kw).step()
        return w.detach()

    plain = step()
    for kw in ({"orthogonalizer": "polar-express"}, {"normuon": True}, {"cautious_weight_decay": True}):
        assert not torch.allclose(step(**kw), plain), kw


def test_normuon_state_resumes():
    torch.manual_seed(4)
    w = torch.nn.Parameter(torch.randn(32, 16))
    opt = Muon([w], normuon=True)
    w.grad = torch.randn(32, 16)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())  # as a checkpoint holds it: not the live buffers
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = Muon([w2], normuon=True)
    opt2.load_state_dict(saved)
    g = torch.randn(32, 16)
    w.grad, w2.grad = g, g.clone()
    opt.step()
    opt2.step()
    torch.testing.assert_close(w2, w, rtol=0, atol=0)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("muon_orthogonalizer", "svd", "optimizer.muon_orthogonalizer must be"),
        ("normuon_beta2", 1.0, "optimizer.normuon_beta2 must be in"),
    ],
)
def test_bad_optimizer_settings_are_named(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config("cpu-small", overrides=[f"optimizer.{key}={value}"])


def test_the_training_config_reaches_the_optimizer():
    from ferrolm.lm.model import TransformerLM
    from ferrolm.lm.train import build_optimizer

    cfg = load_config(
        "cpu-small",
        overrides=[
            "optimizer.muon_orthogonalizer=polar-express",
            "optimizer.normuon=true",
            "optimizer.cautious_weight_decay=true",
        ],
    )
    model = TransformerLM(64, 16, 32, 2, 4, 48)
    opt = build_optimizer(model, cfg.optimizer)
    muon = [g for g in opt.param_groups if g["kind"] == "muon"]
    assert muon and all(
        g["orthogonalizer"] == "polar-express" and g["normuon"] and g["cautious_weight_decay"] for g in muon
    )
    assert optim.orthogonalizer_steps("polar-express", 7)[1][6] == PE[4]

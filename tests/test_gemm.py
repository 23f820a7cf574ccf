"""ferrolm.lm.gemm: oneDNN's float32 matrix multiply against torch's, forward and backward,
and the choice between them (run.cpu_matmul)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrolm.lm import functional, gemm
from ferrolm.lm.config import ConfigError, TrainConfig, apply_overrides
from ferrolm.lm.model import TransformerLM

# oneDNN and MKL sum in different orders: equal to float32 rounding, not bitwise.
TOL = dict(rtol=1e-5, atol=1e-5)

needs_onednn = pytest.mark.skipif(not gemm.onednn_available(), reason="this torch build has no oneDNN")


def assert_rounding_close(got, want, inner: int):
    """Equal up to float32 rounding of sums of `inner` products: an error that grows like
    sqrt(inner) times the result's scale (a wrong operand or transpose is off by the scale)."""
    bound = 2e-6 * inner**0.5 * max(float(want.abs().max()), 1.0)
    assert float((got - want).abs().max()) <= bound


@pytest.fixture
def kernel():
    """Run a test under a chosen kernel and put the process's choice back afterwards."""
    before = gemm.chosen()
    yield gemm.choose
    gemm.choose(before)


def _grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@needs_onednn
@pytest.mark.parametrize(
    "x_shape, out_features",
    [((7, 5), 3), ((2, 9, 16), 33), ((1, 1), 1), ((4, 3, 2, 64), 128), ((256, 512), 1344)],
)
def test_linear_and_its_gradients_equal_torchs(kernel, x_shape, out_features):
    gen = torch.Generator().manual_seed(sum(x_shape) + out_features)
    x = torch.randn(x_shape, generator=gen)
    w = torch.randn(out_features, x_shape[-1], generator=gen)
    kernel("blas")
    want, (want_dx, want_dw) = _grads(gemm.linear, x, w)
    assert not gemm.using_onednn()
    kernel("onednn")
    assert gemm.using_onednn()
    got, (got_dx, got_dw) = _grads(gemm.linear, x, w)
    rows = x.numel() // x_shape[-1]
    assert_rounding_close(got, want, x_shape[-1])
    assert_rounding_close(got, F.linear(x, w), x_shape[-1])
    assert_rounding_close(got_dx, want_dx, out_features)
    assert_rounding_close(got_dw, want_dw, rows)


@needs_onednn
def test_linear_reads_transposed_and_sliced_operands(kernel):
    kernel("onednn")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 24, generator=gen)[::2].t()  # (24, 20), neither row nor column contiguous
    w = torch.randn(30, 40, generator=gen)[:, ::2]  # (30, 20), strided rows
    torch.testing.assert_close(gemm.linear(x, w), x @ w.t(), **TOL)
    torch.testing.assert_close(gemm.matmul(x, w.t()), x @ w.t(), **TOL)
    out = torch.ones(24, 30)
    gemm.add_matmul_(out, x, w.t())
    torch.testing.assert_close(out, 1 + x @ w.t(), **TOL)


@needs_onednn
def test_only_one_operand_needing_a_gradient(kernel):
    kernel("onednn")
    x = torch.randn(6, 8)
    w = torch.randn(4, 8, requires_grad=True)
    gemm.linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(6, 4).t() @ x, **TOL)
    x.requires_grad_(True)
    w2 = torch.randn(4, 8)
    gemm.linear(x, w2).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(6, 4) @ w2, **TOL)


@needs_onednn
def test_other_dtypes_and_autocast_stay_with_torch(kernel, monkeypatch):
    kernel("onednn")

    def refuse(*args):
        raise AssertionError("oneDNN's float32 kernel was called")

    monkeypatch.setattr(gemm, "_onednn_linear", refuse)
    x64, w64 = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(gemm.linear(x64, w64), F.linear(x64, w64))
    xb, wb = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(5, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(gemm.linear(xb, wb), F.linear(xb, wb))
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gemm.linear(x, w).dtype == torch.bfloat16
    with pytest.raises(AssertionError, match="oneDNN"):
        gemm.linear(x, w)  # the test's own check: float32 outside autocast does go to oneDNN


@needs_onednn
def test_fused_head_loss_and_gradients_equal_torchs(kernel):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(300, 32, generator=gen)
    w = torch.randn(97, 32, generator=gen) * 0.3
    t = torch.randint(0, 97, (300,), generator=gen)

    def run():
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = functional.linear_cross_entropy(hh, ww, t, chunk_rows=128)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    kernel("blas")
    want = run()
    kernel("onednn")
    got = run()
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(functional.linear_cross_entropy(h, w, t), want[0], **TOL)


@needs_onednn
def test_a_training_step_of_the_model_matches_torchs(kernel):
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=61, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)
    ids = torch.randint(0, 61, (3, 16))
    targets = torch.roll(ids, -1, dims=1)

    def grads():
        model.zero_grad()
        loss = model(ids, targets=targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    kernel("blas")
    want_loss, want = grads()
    kernel("onednn")
    got_loss, got = grads()
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@needs_onednn
def test_compiles_as_one_graph_equal_to_eager(kernel):
    kernel("onednn")
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=50, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)
    ids = torch.randint(0, 50, (2, 8))
    compiled = torch.compile(lambda i: model(i, targets=i), fullgraph=True)  # a graph break is an error
    loss = compiled(ids)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager = model(ids, targets=ids)
    eager.backward()
    torch.testing.assert_close(loss, eager, **TOL)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **TOL, msg=n)


def test_choose_auto_and_bad_settings(kernel):
    assert kernel("AUTO") in ("blas", "onednn")
    assert kernel("auto") == ("onednn" if gemm.using_onednn() else "blas") == gemm.chosen()
    with pytest.raises(ValueError, match="cpu_matmul must be one of"):
        kernel("mkl-please")


def test_choose_onednn_without_onednn_says_so(kernel, monkeypatch):
    monkeypatch.setattr(gemm, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match="no oneDNN"):
        kernel("onednn")
    assert kernel("auto") == "blas"


def test_choose_keeps_a_recorded_kernel_without_measuring(kernel, monkeypatch):
    """ "auto" with the kernel a checkpoint records keeps it and times nothing; an explicit
    setting wins over the record; a recorded oneDNN this torch lacks falls back to a measurement."""
    probes = []
    monkeypatch.setattr(gemm, "_probe_speedup", lambda: probes.append(1) or 2.0)  # oneDNN "2x faster"
    monkeypatch.setattr(gemm, "onednn_available", lambda: True)
    assert kernel("auto", recorded="blas") == "blas" and not probes
    assert kernel("auto", recorded="onednn") == "onednn" and not probes
    assert kernel("blas", recorded="onednn") == "blas" and not probes
    assert kernel("auto", recorded=None) == "onednn" and len(probes) == 1
    monkeypatch.setattr(gemm, "onednn_available", lambda: False)
    assert kernel("auto", recorded="onednn") == "blas" and len(probes) == 1  # no oneDNN here: BLAS, untimed


def test_config_key_is_checked():
    cfg = apply_overrides(TrainConfig(), ["run.cpu_matmul=oneDNN"])
    assert cfg.run.cpu_matmul.lower() == "onednn"
    with pytest.raises(ConfigError, match="run.cpu_matmul must be one of"):
        apply_overrides(TrainConfig(), ["run.cpu_matmul=fast"]).validate()

"""The original Transformer's parts as switches, each held to a literal reference:
sinusoidal and learned positions, LayerNorm, the ReLU FFN and dropout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ferrolm.lm import functional
from ferrolm.lm.config import ModelConfig
from ferrolm.lm.model import TransformerLM, _sinusoidal_table

V, T, D, L, H, FF = 97, 16, 32, 2, 4, 48


def make(**switches) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(V, T, D, L, H, FF, attention="reference", **switches)


def test_sinusoidal_table_is_the_papers_formula():
    table = functional.sinusoidal_positions(7, 6)
    # row p, column 2i: sin(p / 10000^(2i/6)); column 2i+1: cos of the same angle
    assert table[0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert table[3, 2].item() == pytest.approx(math.sin(3 / 10000 ** (2 / 6)), abs=1e-7)
    assert table[3, 5].item() == pytest.approx(math.cos(3 / 10000 ** (4 / 6)), abs=1e-7)
    torch.testing.assert_close(_sinusoidal_table(40, 10), functional.sinusoidal_positions(40, 10), rtol=0, atol=1e-6)
    torch.testing.assert_close(_sinusoidal_table(9, 7), functional.sinusoidal_positions(9, 7), rtol=0, atol=1e-6)


def test_layer_norm_is_the_equation():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 8) * 4 + 2
    g, b = torch.randn(8), torch.randn(8)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    want = (x - mean) / torch.sqrt(var + 1e-5) * g + b
    torch.testing.assert_close(functional.layer_norm(x, g, b), want)
    torch.testing.assert_close(F.layer_norm(x, (8,), g, b, 1e-5), want)


def _reference_forward(model: TransformerLM, ids: torch.Tensor, *, training: bool = False) -> torch.Tensor:
    """The model's logits written out from the functional equations, post- or pre-norm,
    with absolute positions, LayerNorm or RMSNorm, ReLU or ReLU² FFN and dropout drawn in
    the model's order (embeddings, then per layer: attention weights, attention branch,
    FFN branch)."""
    cfg = model.config
    p = cfg.dropout if training else 0.0
    seq = ids.shape[1]

    def norm(mod, x):
        if cfg.norm == "layer":
            return functional.layer_norm(x, mod.weight, mod.bias, cfg.norm_eps)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * mod.weight

    x = model.token_embeddings.weight[ids]
    if cfg.positions == "sinusoidal":
        x = x + functional.sinusoidal_positions(cfg.context_length, cfg.d_model)[:seq]
    elif cfg.positions == "learned":
        x = x + model.position_embeddings.weight[:seq]
    x = functional.dropout(x, p)
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    for layer in model.layers:
        a = layer.attn

        def attn(h, a=a):
            b = h.shape[0]
            q = (h @ a.q_proj.weight.T).view(b, seq, H, -1).transpose(1, 2)
            k = (h @ a.k_proj.weight.T).view(b, seq, H, -1).transpose(1, 2)
            v = (h @ a.v_proj.weight.T).view(b, seq, H, -1).transpose(1, 2)
            out = functional.scaled_dot_product_attention(q, k, v, mask, p)
            return out.transpose(1, 2).reshape(b, seq, D) @ a.output_proj.weight.T

        def ffn(h, f=layer.ffn):
            u = h @ f.w1.weight.T
            u = torch.relu(u) if cfg.ffn == "relu" else functional.relu_squared(u)
            return u @ f.w2.weight.T

        if cfg.norm_position == "post":
            x = norm(layer.ln1, x + functional.dropout(attn(x), p))
            x = norm(layer.ln2, x + functional.dropout(ffn(x), p))
        else:
            x = x + functional.dropout(attn(norm(layer.ln1, x)), p)
            x = x + functional.dropout(ffn(norm(layer.ln2, x)), p)
    return norm(model.ln_final, x) @ model.lm_head.weight.T


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("norm_position", ["post", "pre"])
@pytest.mark.parametrize("ffn", ["relu", "relu2"])
def test_switches_equal_the_reference(positions, norm, norm_position, ffn):
    model = make(positions=positions, norm=norm, norm_position=norm_position, ffn=ffn)
    with torch.no_grad():  # LayerNorm's bias and gains away from their init, so they count
        for m in model.modules():
            if hasattr(m, "bias") and isinstance(m.bias, torch.nn.Parameter):
                m.bias.normal_()
                m.weight.normal_()
    ids = torch.randint(0, V, (2, 11))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), _reference_forward(model, ids), rtol=1e-5, atol=1e-5)


def test_dropout_in_training_equals_the_reference_draw_for_draw():
    model = make(positions="sinusoidal", norm="layer", norm_position="post", ffn="relu", dropout=0.3)
    ids = torch.randint(0, V, (2, 11))
    model.train()
    torch.manual_seed(5)
    got = model(ids)
    torch.manual_seed(5)
    want = _reference_forward(model, ids, training=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # in evaluation dropout is gone: the output is that of the same weights without it
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), _reference_forward(model, ids), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model(ids), got.detach())


def test_fast_attention_applies_dropout_only_in_training():
    torch.manual_seed(0)
    model = TransformerLM(V, T, D, L, H, FF, dropout=0.5)
    ids = torch.randint(0, V, (1, 9))
    model.train()
    a, b = model(ids), model(ids)
    assert not torch.allclose(a, b)  # fresh masks each call
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_absolute_positions_with_a_kv_cache_equal_the_full_forward(positions):
    model = make(positions=positions, norm="layer").eval()
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.make_kv_cache(2)
        first = model(ids[:, :7], kv_cache=cache)
        rest = [model(ids[:, i : i + 1], kv_cache=cache) for i in range(7, 12)]
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, T + 1, dtype=torch.long))


def test_state_dict_keys_of_the_new_switches():
    keys = set(make(positions="learned", norm="layer", ffn="relu").state_dict())
    assert "position_embeddings.weight" in keys
    assert {"layers.0.ln1.bias", "layers.0.ln2.bias", "ln_final.bias"} <= keys
    assert not any(k.endswith("w3.weight") for k in keys)
    assert "position_table" not in set(make(positions="sinusoidal").state_dict())


def test_the_default_model_is_unchanged_by_the_new_switches():
    """Turning the new switches on adds weights after the others: every shared weight of
    the default model starts as it did."""
    base, learned = make().state_dict(), make(positions="learned").state_dict()
    for k, v in base.items():
        torch.testing.assert_close(learned[k], v, rtol=0, atol=0)


@pytest.mark.parametrize(
    "field, value, message",
    [("dropout", 1.0, "model.dropout must be in"), ("dropout", -0.1, "model.dropout"), ("norm", "batch", "model.norm")],
)
def test_bad_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{field: value})


@pytest.mark.parametrize("cap", [0.0, 15.0])
@pytest.mark.parametrize("eps", [0.1, 0.4])
def test_label_smoothing_equals_torchs(cap, eps):
    torch.manual_seed(3)
    h = torch.randn(37, 16, requires_grad=True)
    w = (torch.randn(50, 16) * 0.5).requires_grad_()
    t = torch.randint(0, 50, (37,))
    got = functional.linear_cross_entropy(h, w, t, softcap_at=cap, label_smoothing=eps, chunk_rows=8)
    got.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logits = h @ w.T
    if cap:
        logits = cap * torch.tanh(logits / cap)
    want = F.cross_entropy(logits, t, label_smoothing=eps)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # the path without a gradient computes the same loss
        torch.testing.assert_close(
            functional.linear_cross_entropy(h, w, t, softcap_at=cap, label_smoothing=eps), want, rtol=1e-5, atol=1e-6
        )


def test_label_smoothing_only_in_training():
    model = make(label_smoothing=0.2)
    ids, targets = torch.randint(0, V, (2, 9)), torch.randint(0, V, (2, 9))
    model.train()
    smoothed = model(ids, targets=targets)
    with torch.no_grad():
        logits = model(ids)
    torch.testing.assert_close(smoothed, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.2))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, targets=targets), F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        )
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        ModelConfig(label_smoothing=1.0)

"""The modded-nanogpt speedrun's model switches: U-net skips, the sparse attention gate and
long/short sliding-window attention. Each is held to its equation written out by hand
(plain loops and torch ops), forward and backward; off, the model is the one without it;
the KV cache (prefill, decode, chunked prefill, one position per row) gives the full
forward's logits; each new parameter lands in its optimizer group; bad settings are refused
by name; exports that cannot compute a switch refuse it by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ferrolm.lm import functional
from ferrolm.lm import model as model_module
from ferrolm.lm.config import ModelConfig, load_config
from ferrolm.lm.gguf_export import gguf_architecture
from ferrolm.lm.hf import hf_architecture
from ferrolm.lm.model import TransformerLM, count_parameters
from ferrolm.lm.optim import muon_param_groups, parameter_roles

pytestmark = pytest.mark.usefixtures("_single_thread")


SMALL = dict(vocab_size=61, context_length=24, d_model=32, num_layers=5, num_heads=4, d_ff=40)
ALL_ON = dict(unet_skips=True, attn_gate=True, short_window=4, window_pattern="SL")


def small_model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(**{**SMALL, **kw}).eval()


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def _move_off_start(model: TransformerLM, seed: int = 5) -> None:
    """Learned scalars and gates away from their start values, so every term of the equations matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if model.config.unet_skips:
            model.skip_scales.copy_(torch.rand(model.skip_scales.shape, generator=g, dtype=torch.float64) + 0.5)
        if model.config.x0_mix:
            model.residual_scales.copy_(torch.rand(model.config.num_layers, generator=g, dtype=torch.float64) + 0.5)
            model.x0_scales.copy_(torch.rand(model.config.num_layers, generator=g, dtype=torch.float64) - 0.5)
        for layer in model.layers:
            if layer.attn.gate is not None:
                layer.attn.gate.weight.copy_(torch.randn(layer.attn.gate.weight.shape, generator=g))


# ------------------------------------------------------------- the equations by hand ----


def _is_short(cfg: ModelConfig, i: int) -> bool:
    """Layer i attends over the short window: its pattern letter (cycled) is 'S' and it is not the last layer."""
    return cfg.short_window > 0 and cfg.window_pattern[i % len(cfg.window_pattern)] == "S" and i != cfg.num_layers - 1


def _attention_by_hand(attn, h: torch.Tensor, window: int, docs) -> torch.Tensor:
    """Per row, head, query p and key j: j may be attended iff j <= p, p - j < window (when
    window > 0) and (with docs) j and p lie in one document; the head's output times
    sigmoid(h[p, :k] . W_g[head]) when the gate is on; then W_O."""
    batch, seq, _ = h.shape
    dh, pos = attn.d_head, torch.arange(seq)
    rows = []
    for b in range(batch):
        heads = []
        for hd in range(attn.num_heads):
            q = attn.rope(h[b] @ attn.q_proj.weight[hd * dh : (hd + 1) * dh].T, pos)
            k = attn.rope(h[b] @ attn.k_proj.weight[hd * dh : (hd + 1) * dh].T, pos)
            v = h[b] @ attn.v_proj.weight[hd * dh : (hd + 1) * dh].T
            allowed = torch.zeros(seq, seq, dtype=torch.bool)
            for p in range(seq):
                for j in range(seq):
                    in_window = window == 0 or p - j < window
                    same_doc = docs is None or bool(docs[b, p] == docs[b, j])
                    allowed[p, j] = j <= p and in_window and same_doc
            scores = (q @ k.T / math.sqrt(dh)).masked_fill(~allowed, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v
            if attn.gate is not None:
                width = min(12, attn.d_model)
                out = out * torch.sigmoid(h[b, :, :width] @ attn.gate.weight[hd])[:, None]
            heads.append(out)
        rows.append(torch.cat(heads, dim=-1) @ attn.output_proj.weight.T)
    return torch.stack(rows)


def _model_by_hand(model: TransformerLM, ids: torch.Tensor, docs=None) -> torch.Tensor:
    """The LM with its switches written out: with L layers and n = floor(L/2) under unet_skips,
    block L-1-i (i < n) reads x + s_i skip_i (skip_i: block i's output), then x0_mix's a x + b x0."""
    cfg = model.config
    L = cfg.num_layers
    n = L // 2 if cfg.unet_skips else 0
    x = x0 = model.token_embeddings.weight[ids]
    skips = []
    for i, layer in enumerate(model.layers):
        if i >= L - n:
            x = x + model.skip_scales[L - 1 - i] * skips[L - 1 - i]
        if cfg.x0_mix:
            x = model.residual_scales[i] * x + model.x0_scales[i] * x0
        window = cfg.short_window if _is_short(cfg, i) else 0
        x = x + _attention_by_hand(layer.attn, layer.ln1(x), window, docs)
        x = x + layer.ffn(layer.ln2(x))
        if i < n:
            skips.append(x)
    return model.ln_final(x) @ model.lm_head.weight.T


SWITCHES = {
    "unet-odd": dict(unet_skips=True),
    "unet-even-x0": dict(unet_skips=True, x0_mix=True, num_layers=4),
    "gate": dict(attn_gate=True),
    "gate-reference": dict(attn_gate=True, attention="reference"),
    "window": dict(short_window=3),
    "window-pattern-reference": dict(short_window=2, window_pattern="LSS", attention="reference"),
    "all": dict(ALL_ON, x0_mix=True),
}


@pytest.mark.parametrize("with_docs", [False, True], ids=["causal", "doc-mask"])
@pytest.mark.parametrize("name", list(SWITCHES))
def test_switches_against_their_equations_outputs_and_gradients(name, with_docs):
    model = small_model(3, **SWITCHES[name]).double()
    _move_off_start(model)
    ids = random_ids(2, 13)
    docs = None
    if with_docs:
        ids[0, 5], ids[1, 9] = 0, 0  # end-of-text (id 0) opens a document
        docs = functional.document_ids(ids, 0)
    weight = torch.randn(2, 13, SMALL["vocab_size"], generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = model(ids, document_ids=docs)
    (got * weight).sum().backward()
    mine = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    want = _model_by_hand(model, ids, docs)
    (want * weight).sum().backward()
    torch.testing.assert_close(got, want)
    for k, p in model.named_parameters():
        torch.testing.assert_close(mine[k], p.grad, msg=k)
    if model.config.unet_skips:
        assert mine["skip_scales"].abs().min() > 0  # every skip learns
    if model.config.attn_gate:
        assert all(mine[f"layers.{i}.attn.gate.weight"].abs().sum() > 0 for i in range(model.config.num_layers))


def test_a_short_layer_sees_exactly_its_window():
    """Changing a token moves a short-window layer's output only at the window's positions."""
    model = small_model(4, num_layers=1, short_window=3, window_pattern="S")
    model_short = small_model(4, num_layers=2, short_window=3, window_pattern="S")
    assert model.config.short_window_layers == [] and model_short.config.short_window_layers == [0]
    ids = random_ids(1, 12)
    other = ids.clone()
    other[0, 4] = (ids[0, 4] + 1) % SMALL["vocab_size"]
    attn = model_short.layers[0].attn
    with torch.no_grad():
        # one short layer alone, through the model's mask: positions 4, 5, 6 see position 4
        x, y = (model_short.token_embeddings(t) for t in (ids, other))
        mask = functional.sliding_window_mask(torch.arange(12), 12, 3)
        diff = (attn(x, mask=mask) - attn(y, mask=mask)).abs().amax(-1)[0]
    assert [int(p) for p in torch.nonzero(diff > 0)] == [4, 5, 6]
    assert functional.sliding_window_mask(torch.tensor([5]), 8, 3).tolist() == [[0, 0, 0, 1, 1, 1, 0, 0]]


# ------------------------------------------------------------- off: as before -----------


def test_switches_off_leave_the_preset_model_as_it_was(monkeypatch):
    """Off, no switch runs any code: every layer on SDPA's plain causal path, no window mask,
    no gate; turning a switch on draws no random numbers, so every existing weight is the
    same; a window that hides nothing and skips scaled to 0 give the plain model bit for bit."""
    cfg = {k: v for k, v in vars(load_config("cpu-small").model).items()}
    cfg.update(vocab_size=61, context_length=24, d_model=32, num_heads=4, d_ff=40)
    plain = small_model(6, **cfg)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    def forbidden(*args, **kw):
        raise AssertionError("a switch that is off ran")

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(model_module.functional, "sliding_window_mask", forbidden)
    monkeypatch.setattr(model_module.AttentionGate, "forward", forbidden)
    ids = random_ids(2, 20)
    with torch.no_grad():
        logits = plain(ids)
        loss = plain(ids, targets=random_ids(2, 20, seed=2))
    assert calls == [(True, True)] * (2 * plain.config.num_layers)
    monkeypatch.undo()

    on = small_model(6, **{**cfg, **ALL_ON})
    plain_sd, on_sd = plain.state_dict(), on.state_dict()
    assert set(on_sd) - set(plain_sd) == {"skip_scales"} | {f"layers.{i}.attn.gate.weight" for i in range(4)}
    assert all(torch.equal(plain_sd[k], on_sd[k]) for k in plain_sd)

    wide = small_model(6, **{**cfg, "short_window": 24})  # every key within the window
    zero_skips = small_model(6, **{**cfg, "unet_skips": True})
    with torch.no_grad():
        zero_skips.skip_scales.zero_()
        for other in (wide, zero_skips):
            assert torch.equal(other(ids), logits)
            assert torch.equal(other(ids, targets=random_ids(2, 20, seed=2)), loss)


def test_the_switches_start_where_documented():
    model = small_model(2, **ALL_ON)
    assert model.skip_scales.tolist() == [1.0, 1.0] and model.skip_scales.shape == (SMALL["num_layers"] // 2,)
    gate = model.layers[0].attn.gate
    assert gate.weight.shape == (4, 12) and not gate.weight.any()  # every gate at sigmoid(0) = 1/2
    narrow = small_model(2, d_model=8, num_heads=2, attn_gate=True)
    assert narrow.layers[0].attn.gate.weight.shape == (2, 8)  # k = min(12, d_model)
    for kw in (ALL_ON, dict(attn_gate=True, unet_skips=True, num_layers=2)):
        cfg = ModelConfig(**{**SMALL, **kw})
        assert count_parameters(cfg) == sum(p.numel() for p in small_model(**kw).parameters())


@pytest.mark.parametrize(
    "num_layers,pattern,short",
    [(5, "SSSL", [0, 1, 2]), (6, "SSSL", [0, 1, 2, 4]), (3, "S", [0, 1]), (4, "L", []), (4, "LS", [1])],
)
def test_window_pattern_cycles_over_the_layers_and_the_last_is_long(num_layers, pattern, short):
    cfg = ModelConfig(**{**SMALL, "num_layers": num_layers}, short_window=4, window_pattern=pattern)
    assert cfg.short_window_layers == short
    assert ModelConfig(**{**SMALL, "num_layers": num_layers}, window_pattern=pattern).short_window_layers == []


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"short_window": -1}, r"model.short_window must be an int >= 0, got -1"),
        ({"short_window": 2.5}, r"model.short_window must be an int >= 0, got 2.5"),
        ({"short_window": True}, r"model.short_window must be an int >= 0, got True"),
        ({"window_pattern": "SLX"}, r"model.window_pattern must be a non-empty string of 'L' and 'S', got 'SLX'"),
        ({"window_pattern": "sl"}, r"model.window_pattern must be a non-empty string of 'L' and 'S', got 'sl'"),
        ({"window_pattern": ""}, r"model.window_pattern must be a non-empty string of 'L' and 'S', got ''"),
        ({"window_pattern": 3}, r"model.window_pattern must be a non-empty string of 'L' and 'S', got 3"),
        ({"unet_skips": True, "num_layers": 1}, r"model.unet_skips needs model.num_layers >= 2"),
    ],
)
def test_bad_settings_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**SMALL, **bad})


# ------------------------------------------------------------- the KV cache -------------


CACHED = {
    "all": ALL_ON,
    "all-reference": dict(ALL_ON, attention="reference"),
    "window-gqa-x0": dict(short_window=3, num_kv_heads=2, x0_mix=True, value_embeds=True),
    "window-no-positions": dict(short_window=2, window_pattern="S", positions="none"),
}


@pytest.mark.parametrize("name", list(CACHED))
def test_kv_cache_prefill_decode_and_chunks_equal_the_full_forward(name):
    model = small_model(7, **CACHED[name])
    _move_off_start(model)
    ids = random_ids(3, 20, seed=8)
    with torch.no_grad():
        full = model(ids)
        cache = model.make_kv_cache(batch_size=3)
        pieces = [model(ids[:, :2], kv_cache=cache)]  # a prefill inside the window
        for t in range(2, 12):  # one token at a time, past the window
            pieces.append(model(ids[:, t : t + 1], kv_cache=cache))
        pieces.append(model(ids[:, 12:17], kv_cache=cache))  # chunked prefill at start_pos 12
        pieces.append(model(ids[:, 17:20], kv_cache=cache, start_pos=17))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CACHED))
def test_kv_cache_rows_at_their_own_positions_get_their_own_logits(name):
    model = small_model(11, **CACHED[name])
    _move_off_start(model)
    lengths = [3, 9, 1, 14]
    seqs = [random_ids(1, n + 1, seed=20 + n)[0] for n in lengths]
    with torch.no_grad():
        cache = model.make_kv_cache(len(seqs))
        for b, s in enumerate(seqs):
            model(s[:-1].view(1, -1), kv_cache=cache.rows(b, b + 1), start_pos=0)
        for keys in cache.keys:
            keys[0, :, lengths[0] :] = 1e4  # a stale slot past a row's length must never be seen
        last = torch.stack([s[-1:] for s in seqs])
        out = model(last, kv_cache=cache, start_pos=torch.tensor(lengths))
        for b, s in enumerate(seqs):
            torch.testing.assert_close(out[b, -1], model(s.view(1, -1))[0, -1], atol=1e-5, rtol=0)


# ------------------------------------------------------------- optimizer groups ---------


def test_skip_scales_and_gates_take_adamws_scalar_group():
    """The gate is a (num_heads, 12) matrix: a dozen numbers per head whose rows are separate
    per-head decisions, not a hidden map to orthogonalize, so it goes with the scalars."""
    model = small_model(1, **{**ALL_ON, "num_heads": 16, "d_model": 64})
    roles = parameter_roles(model)
    ids = {id(p) for p in roles["scalar"]}
    named = dict(model.named_parameters())
    new = ["skip_scales"] + [f"layers.{i}.attn.gate.weight" for i in range(SMALL["num_layers"])]
    assert all(id(named[k]) in ids for k in new)
    assert not any(id(named[k]) in {id(p) for p in roles["matrix"]} for k in new)
    groups = muon_param_groups(
        model, lr=0.02, embedding_lr=0.2, head_lr=0.004, scalar_lr=0.03, weight_decay=0.0, head_weight_decay=0.0
    )
    (scalar,) = [g for g in groups if g.get("lr") == 0.03]
    assert {id(p) for p in scalar["params"]} >= {id(named[k]) for k in new}


# ------------------------------------------------------------- exports that refuse ------


@pytest.mark.parametrize(
    "switch,name",
    [({"unet_skips": True}, "unet_skips"), ({"attn_gate": True}, "attn_gate"), ({"short_window": 8}, "short_window")],
)
def test_native_hf_and_gguf_exports_refuse_each_switch_by_name(switch, name):
    for base in ({}, dict(ffn="relu2", qk_norm=True, embed_norm=True)):  # Llama's shape and nanochat's
        cfg = ModelConfig(**{**SMALL, **base, **switch})
        with pytest.raises(ValueError, match=f"model.{name} = "):
            hf_architecture(cfg)
        with pytest.raises(ValueError, match=f"model.{name} = "):
            gguf_architecture(cfg)


# ------------------------------------------------------------- a training run -----------


def test_a_muon_run_with_document_masks_trains_every_new_parameter(tmp_path):
    """The training loop end to end: document batches with doc_mask (the short layers' mask
    ANDs the documents'), Muon with its AdamW groups, evaluation; the checkpoint holds the new
    weights, moved from their start, and loads back."""
    from shard_util import synthetic_corpus, write_shard

    from ferrolm.lm.checkpoint import load_model
    from ferrolm.lm.config import TrainConfig
    from ferrolm.lm.train import train

    corpus = synthetic_corpus(12_000, vocab_size=64, seed=0)
    write_shard(tmp_path / "train", corpus[:10_000], vocab_size=64)
    write_shard(tmp_path / "val", corpus[10_000:], vocab_size=64)
    cfg = TrainConfig()
    cfg.update(
        {
            "model": dict(SMALL, vocab_size=64, context_length=16, doc_mask=True, **ALL_ON),
            "data": {"train": str(tmp_path / "train"), "val": str(tmp_path / "val"), "batching": "documents"},
            "optimizer": {"name": "muon", "lr": 0.02, "min_lr": 0.002},
            "schedule": {"max_steps": 6, "warmup_steps": 1, "batch_size": 4},
            "run": {
                "out_dir": str(tmp_path / "run"),
                "device": "cpu",
                "autocast_bf16": False,
                "compile": False,
                "eval_every": 3,
                "eval_batches": 2,
                "progress": False,
                "num_threads": 1,
            },
        }
    )
    result = train(cfg.validate())
    assert result.status == "done" and result.step == 6
    model = load_model(tmp_path / "run").model
    assert model.config.short_window == 4 and model.config.unet_skips and model.config.attn_gate
    assert not torch.equal(model.skip_scales, torch.ones(2))
    assert all(layer.attn.gate.weight.abs().sum() > 0 for layer in model.layers)

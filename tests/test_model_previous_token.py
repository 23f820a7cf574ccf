"""The switches that read the previous token, token smearing (``smear``) and the bigram hash
embedding (``bigram_buckets``): against their equations written out by position, off and at
initialization the model without them, and equal through every cached path.
"""

from __future__ import annotations

import pytest
import torch
from shard_util import synthetic_corpus, write_shard

from ferrolm.lm.checkpoint import read_checkpoint
from ferrolm.lm.config import ConfigError, TrainConfig, load_config
from ferrolm.lm.engine import Engine, Piece, SamplingParams
from ferrolm.lm.generate import generate
from ferrolm.lm.model import ModelConfig, TransformerLM, bigram_hash, count_parameters
from ferrolm.lm.optim import muon_param_groups, param_groups_for_decay, parameter_roles
from ferrolm.lm.train import train

pytestmark = pytest.mark.usefixtures("_single_thread")


SMALL = dict(vocab_size=97, context_length=24, d_model=32, num_layers=2, num_heads=4, d_ff=48, rope_theta=10000.0)
NEW_KEYS = {"smear_gate", "smear_lambda", "bigram_embeddings.weight"}
EOS = 0


def small_model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(**{**SMALL, **kw}).eval()


def awake(model: TransformerLM, seed: int = 5) -> TransformerLM:
    """The new weights start at zero (a no-op); give them values that move the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[0] in ("smear_gate", "smear_lambda", "bigram_embeddings"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------- the equations ----------


def literal_hash(prev: int, cur: int, buckets: int) -> int:
    return buckets - 1 if prev < 0 else ((1000003 * prev) ^ (69069 * cur)) % (buckets - 1)


def reference_block_input(model: TransformerLM, ids: torch.Tensor, documents=None) -> torch.Tensor:
    """The first block's input by the equations, one position at a time."""
    cfg = model.config
    E = model.token_embeddings.weight

    def embed(i):
        e = E[i]
        return e / torch.sqrt((e * e).mean() + cfg.norm_eps) if cfg.embed_norm else e

    rows = []
    for b in range(ids.shape[0]):
        row = []
        for t in range(ids.shape[1]):
            e = embed(ids[b, t])
            first = t == 0 or (documents is not None and documents[b, t] != documents[b, t - 1])
            x = e
            if cfg.smear and not first:
                k = min(12, cfg.d_model)
                gate = torch.sigmoid(torch.dot(e[:k], model.smear_gate))
                x = x + model.smear_lambda[0] * gate * embed(ids[b, t - 1])
            if cfg.bigram_buckets:
                prev = -1 if first else int(ids[b, t - 1])
                x = x + model.bigram_embeddings.weight[literal_hash(prev, int(ids[b, t]), cfg.bigram_buckets)]
            if cfg.positions == "learned":
                x = x + model.position_embeddings.weight[t]
            row.append(x)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def _logits_and_grads(model, ids, documents, replace_input):
    model.zero_grad()
    handle = None
    if replace_input:
        ref = reference_block_input(model, ids, documents)

        def hook(module, args, kwargs):
            return (ref, *args[1:]), kwargs

        handle = model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        logits = model(ids, document_ids=documents)
    finally:
        if handle is not None:
            handle.remove()
    weights = torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view(logits.shape)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "switches, with_documents",
    [
        (dict(smear=True), False),
        (dict(bigram_buckets=7), False),
        (dict(smear=True, bigram_buckets=5, embed_norm=True, positions="learned"), False),
        (dict(smear=True, bigram_buckets=6, doc_mask=True), True),
        (dict(smear=True, d_model=8, num_heads=2), False),  # d_model < 12: the gate reads all of it
    ],
)
def test_switches_equal_their_equations_written_out_in_outputs_and_gradients(switches, with_documents):
    model = awake(small_model(3, **switches).double())
    ids = random_ids(2, 13, seed=4)
    documents = None
    if with_documents:
        ids[0, 0], ids[0, 5], ids[1, 7], ids[1, 8] = EOS, EOS, EOS, EOS  # documents start at their end-of-text
        documents = (ids == EOS).cumsum(-1)
    got, got_grads = _logits_and_grads(model, ids, documents, replace_input=False)
    want, want_grads = _logits_and_grads(model, ids, documents, replace_input=True)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert set(got_grads) == set(want_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-10, rtol=1e-10, msg=name)
    for name in ("smear_gate", "smear_lambda", "bigram_embeddings.weight"):
        if name in want_grads:
            assert want_grads[name].abs().sum() > 0, name
    if switches.get("smear"):
        assert model.smear_gate.shape == (min(12, model.config.d_model),)


def test_a_document_boundary_is_not_crossed():
    # The first token of a document is what it would be at a sequence's start, and its
    # successor's smear and bigram read it, not the previous document's last token.
    model = awake(small_model(2, smear=True, bigram_buckets=9, doc_mask=True))
    ids = random_ids(1, 10, seed=6)
    ids[0, 4] = EOS
    documents = (ids == EOS).cumsum(-1)
    captured = []
    handle = model.layers[0].register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    with torch.no_grad():
        model(ids, document_ids=documents)
        model(ids[:, 4:])  # the second document alone
        model(ids)  # no documents: smeared across
    handle.remove()
    joined, alone, across = captured
    torch.testing.assert_close(joined[:, 4:], alone, atol=0, rtol=0)
    assert not torch.equal(across[:, 4:], alone)


def test_bigram_hash_is_the_documented_function_in_range_and_deterministic():
    vocab, buckets = 50, 11
    prev = torch.arange(-1, vocab).repeat_interleave(vocab)
    cur = torch.arange(vocab).repeat(vocab + 1)
    h = bigram_hash(prev, cur, buckets)
    assert h.dtype == torch.long and torch.equal(h, bigram_hash(prev.clone(), cur.clone(), buckets))
    assert h.tolist() == [literal_hash(int(p), int(c), buckets) for p, c in zip(prev, cur)]
    assert bool(((h[prev >= 0] >= 0) & (h[prev >= 0] < buckets - 1)).all())
    assert bool((h[prev < 0] == buckets - 1).all())
    assert len(set(h[prev >= 0].tolist())) == buckets - 1  # every pair bucket is used
    # pinned: exported models compute the same buckets
    assert bigram_hash(torch.tensor([3, 96, 0]), torch.tensor([5, 1, 0]), 1000).tolist() == [833, 909, 0]
    big = torch.tensor([2**31 - 1])  # the largest ids stay in range (no int64 overflow)
    assert 0 <= int(bigram_hash(big, big, 2**20)) < 2**20 - 1


# ------------------------------------------------------------- off and at init ----------


PRESET_SWITCHES = dict(ffn="relu2", qk_norm=True, value_embeds=True, x0_mix=True, logit_softcap=15.0, num_kv_heads=2)


@pytest.mark.parametrize("base", [{}, PRESET_SWITCHES, dict(embed_norm=True, positions="learned", doc_mask=True)])
def test_off_by_default_and_on_at_initialization_the_model_without_them(base):
    assert ModelConfig(**SMALL).smear is False and ModelConfig(**SMALL).bigram_buckets == 0
    off, on = small_model(8, **base), small_model(8, **base, smear=True, bigram_buckets=13)
    assert set(on.state_dict()) - set(off.state_dict()) == NEW_KEYS
    assert not NEW_KEYS & set(off.state_dict())
    for name, value in off.state_dict().items():  # made last: the other weights' random streams are unchanged
        assert torch.equal(on.state_dict()[name], value), name
    assert not any(on.state_dict()[k].any() for k in NEW_KEYS)  # all zero: smearing and the table start off
    ids, y = random_ids(3, 20), random_ids(3, 20, seed=2)
    documents = (ids == EOS).cumsum(-1) if base.get("doc_mask") else None
    with torch.no_grad():
        assert torch.equal(on(ids, document_ids=documents), off(ids, document_ids=documents))
        assert torch.equal(on(ids, targets=y), off(ids, targets=y))


def test_count_parameters_counts_the_new_weights():
    for switches in (dict(smear=True), dict(bigram_buckets=10), dict(smear=True, bigram_buckets=3, d_model=8)):
        cfg = ModelConfig(**{**SMALL, **switches})
        model = TransformerLM.from_config(cfg)
        assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    plain = count_parameters(ModelConfig(**SMALL))
    assert count_parameters(ModelConfig(**SMALL, smear=True, bigram_buckets=10)) == plain + 12 + 1 + 10 * 32


@pytest.mark.parametrize("bad", [1, -1, True, 2.5, "8"])
def test_bigram_buckets_is_checked(bad):
    with pytest.raises(ValueError, match=r"model.bigram_buckets must be 0 \(off\) or an int >= 2"):
        ModelConfig(**SMALL, bigram_buckets=bad)


def test_config_overrides_are_checked():
    cfg = load_config("cs336", ["model.smear=true", "model.bigram_buckets=4096"])
    assert cfg.model.smear is True and cfg.model.bigram_buckets == 4096
    with pytest.raises(
        ConfigError, match="model.bigram_buckets must be 0 \\(off\\) or an int >= 2 .one bucket is reserved., got 1"
    ):
        load_config("cs336", ["model.bigram_buckets=1"])
    with pytest.raises(ConfigError, match="model.smear must be true or false"):
        load_config("cs336", ["model.smear=often"])
    assert ModelConfig.from_dict(ModelConfig(**SMALL).to_dict() | {"smear": True}).smear is True


# ------------------------------------------------------------- the optimizer ----------


def test_the_table_is_an_embedding_and_smears_weights_are_scalars_for_the_optimizer():
    model = small_model(smear=True, bigram_buckets=16)
    roles = parameter_roles(model)
    assert any(p is model.bigram_embeddings.weight for p in roles["embedding"])
    assert any(p is model.smear_gate for p in roles["scalar"])
    assert any(p is model.smear_lambda for p in roles["scalar"])
    assert not any(p is model.bigram_embeddings.weight for p in roles["matrix"])
    groups = {g["role"]: g for g in muon_param_groups(model, lr=0.02, embedding_lr=0.3, head_lr=0.004, scalar_lr=0.05)}
    assert groups["embedding"]["kind"] == "adamw" and groups["embedding"]["weight_decay"] == 0.0
    assert any(p is model.bigram_embeddings.weight for p in groups["embedding"]["params"])
    assert all(any(p is q for q in groups["scalar"]["params"]) for p in (model.smear_gate, model.smear_lambda))
    no_decay = next(g for g in param_groups_for_decay(model, 0.1) if g["weight_decay"] == 0.0)
    for p in (model.bigram_embeddings.weight, model.smear_gate, model.smear_lambda):
        assert any(q is p for q in no_decay["params"])


# ------------------------------------------------------------- cached paths -----------


CACHED = [
    dict(smear=True),
    dict(bigram_buckets=11),
    dict(smear=True, bigram_buckets=5, embed_norm=True, value_embeds=True, x0_mix=True, positions="learned"),
]


@pytest.mark.parametrize("switches", CACHED)
def test_prefill_decode_and_chunks_give_the_full_forward_logits(switches):
    model = awake(small_model(7, **switches))
    ids = random_ids(3, 20, seed=8)
    with torch.no_grad():
        full = model(ids)
        cache = model.make_kv_cache(batch_size=3)
        pieces = [model(ids[:, :5], kv_cache=cache)]
        for t in range(5, 12):
            pieces.append(model(ids[:, t : t + 1], kv_cache=cache))
        pieces.append(model(ids[:, 12:20], kv_cache=cache))
        assert torch.equal(cache.tokens[:, :20], ids)
        restart = model(ids[:, :4], kv_cache=cache, start_pos=0)  # position 0 again: no previous token
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(restart, full[:, :4], atol=1e-5, rtol=0)


@pytest.mark.parametrize("switches", CACHED)
def test_rows_at_their_own_positions_read_their_own_previous_token(switches):
    model = awake(small_model(11, **switches))
    lengths = [3, 9, 0, 14]
    seqs = [random_ids(1, n + 1, seed=20 + n)[0] for n in lengths]
    with torch.no_grad():
        cache = model.make_kv_cache(len(seqs))
        cache.tokens.fill_(5)  # stale ids past a row's length must never be read
        for b, s in enumerate(seqs):
            if lengths[b]:
                model(s[:-1].view(1, -1), kv_cache=cache.rows(b, b + 1), start_pos=0)
        last = torch.stack([s[-1:] for s in seqs])
        out = model(last, kv_cache=cache, start_pos=torch.tensor(lengths))
        for b, s in enumerate(seqs):
            torch.testing.assert_close(out[b, -1], model(s.view(1, -1))[0, -1], atol=1e-5, rtol=0)
            assert torch.equal(cache.tokens[b, : lengths[b] + 1], s)


CTX = 24


def _greedy_without_cache(model, prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            t = int(model(torch.tensor([seq[-CTX:]]))[0, -1].argmax())
        out.append(t)
        seq.append(t)
    return out


@pytest.mark.parametrize("switches", CACHED[:2])
def test_generation_through_the_engine_equals_a_greedy_loop_without_cache(switches):
    model = awake(small_model(12, **switches), seed=9)
    prompts = [[7, 3, 9, 1], [2], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    batched = list(generate(model, prompts, 12, temperature=0))
    for i, prompt in enumerate(prompts):
        want = _greedy_without_cache(model, prompt, 12)
        assert [step[i] for step in batched] == want
        assert list(generate(model, prompt, 12, temperature=0)) == want
        assert list(generate(model, prompt, 12, temperature=0, use_cache=False)) == want
    # past the context: a window recomputed into its row starts with no previous token, as without a cache
    slid = list(generate(model, prompts[2], 2 * CTX, temperature=0, window_keep=CTX))
    assert slid == list(generate(model, prompts[2], 2 * CTX, temperature=0, use_cache=False))


def _sampled(events: list) -> list[int]:
    return [lp.token for e in events if isinstance(e, Piece) for lp in e.logprobs]


@pytest.mark.parametrize("chunk", [None, 5])
def test_rows_copied_for_the_choices_of_a_request_carry_their_tokens(chunk):
    model = awake(small_model(13, smear=True, bigram_buckets=7), seed=3)
    prompt = [(7 * i) % 90 + 1 for i in range(11)]
    engine = Engine(model, None, None, max_batch=6, prefill_chunk=chunk)
    choices = []
    for seed in range(4):
        events: list = []
        engine.submit(
            prompt, SamplingParams(max_tokens=8, seed=seed, temperature=0.8, logprobs=0), events.append, group="r"
        )
        choices.append(events)
    other: list = []
    engine.submit(prompt[:6], SamplingParams(max_tokens=8, seed=9, temperature=0.8, logprobs=0), other.append)
    engine.run_until_done()
    for seed, events in enumerate(choices):
        alone = generate(model, prompt, 8, temperature=0.8, generator=torch.Generator().manual_seed(seed))
        assert _sampled(events) == list(alone)
    alone = generate(model, prompt[:6], 8, temperature=0.8, generator=torch.Generator().manual_seed(9))
    assert _sampled(other) == list(alone)


# ------------------------------------------------------------- export refusals --------


@pytest.mark.parametrize(
    "switch, shown", [(dict(smear=True), "model.smear = True"), (dict(bigram_buckets=8), "model.bigram_buckets = 8")]
)
def test_native_exports_and_gguf_refuse_them_by_name(switch, shown):
    from ferrolm.lm.gguf_export import gguf_architecture
    from ferrolm.lm.hf import hf_architecture, to_hf_state_dict

    for base in ({}, dict(qk_norm=True), dict(ffn="relu2", qk_norm=True, embed_norm=True)):  # Llama, Qwen3, nanochat
        cfg = ModelConfig(**SMALL, **base)
        hf_architecture(cfg)  # exportable without the switch
        with pytest.raises(ValueError, match=f"{shown}.*cannot be exported"):
            hf_architecture(ModelConfig(**SMALL, **base, **switch))
        with pytest.raises(ValueError, match=f"{shown}.*cannot be exported as GGUF"):
            gguf_architecture(ModelConfig(**SMALL, **base, **switch))
    with pytest.raises(ValueError, match=shown):
        to_hf_state_dict(small_model(**switch))


# ------------------------------------------------------------- training ---------------


def test_training_learns_them_with_muon_and_passes_the_documents(tmp_path, monkeypatch):
    corpus = synthetic_corpus(8_000, vocab_size=64, seed=0)
    write_shard(tmp_path / "train", corpus[:7_000], vocab_size=64)
    write_shard(tmp_path / "val", corpus[7_000:], vocab_size=64)
    seen = []
    original = TransformerLM._previous_ids

    def spy(self, ids, kv_cache, start_pos, document_ids):
        seen.append(document_ids is not None)
        return original(self, ids, kv_cache, start_pos, document_ids)

    monkeypatch.setattr(TransformerLM, "_previous_ids", spy)
    cfg = TrainConfig()
    model = dict(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    cfg.update(
        {
            "model": {**model, "smear": True, "bigram_buckets": 32, "doc_mask": True},
            "data": {"train": str(tmp_path / "train"), "val": str(tmp_path / "val")},
            "optimizer": {"name": "muon", "lr": 0.02, "min_lr": 0.002},
            "schedule": {"max_steps": 4, "warmup_steps": 1, "batch_size": 4},
            "run": {"out_dir": str(tmp_path / "run"), "device": "cpu", "compile": False, "autocast_bf16": False},
        }
    )
    cfg.run.eval_every = cfg.run.checkpoint_every = 4
    cfg.run.progress = False
    result = train(cfg.validate())
    assert result.status == "done" and result.step == 4
    assert seen and all(seen)  # every training and validation forward had the documents
    weights = read_checkpoint(result.last_checkpoint)["model"]
    assert weights["smear_lambda"].abs().sum() > 0 and weights["bigram_embeddings.weight"].abs().sum() > 0

"""Multi-token prediction as an auxiliary training loss (model.mtp_weight, model.mtp_depth),
held to a literal reference: plain cross-entropy of the model's own logits against targets
shifted by explicit loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrolm.lm import functional
from ferrolm.lm.config import ModelConfig, load_config
from ferrolm.lm.gguf_export import gguf_architecture
from ferrolm.lm.hf import hf_architecture
from ferrolm.lm.model import TransformerLM

V, T, D, L, H, FF = 61, 12, 32, 2, 4, 48
EOS = 0


def make(**switches) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(V, T, D, L, H, FF, attention="reference", **switches)


def reference_targets(ids: torch.Tensor, targets: torch.Tensor, j: int, doc_mask: bool) -> torch.Tensor:
    """Position i's target j tokens beyond its next one, written out: targets[b, i + j], or
    -100 past the row, or (doc_mask) when an end-of-text token lies among x_{i+1} .. x_{i+j}
    (the inputs at i+1 .. i+j)."""
    out = torch.full_like(targets, -100)
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1]):
            if i + j >= ids.shape[1]:
                continue
            if doc_mask and any(int(ids[b, k]) == EOS for k in range(i + 1, i + j + 1)):
                continue
            out[b, i] = targets[b, i + j]
    return out


def reference_loss(model, ids, targets, doc_mask: bool) -> torch.Tensor:
    """CE(logits, next) + sum_j w^j CE(logits, shifted by j), each the mean over its counted positions."""
    cfg = model.config
    docs = functional.document_ids(ids, EOS) if doc_mask else None
    logits = model(ids, document_ids=docs).flatten(0, 1)
    e = cfg.label_smoothing
    loss = F.cross_entropy(logits, targets.flatten(), ignore_index=-100, label_smoothing=e)
    for j in range(1, cfg.mtp_depth + 1):
        ahead = reference_targets(ids, targets, j, doc_mask).flatten()
        term = F.cross_entropy(logits, ahead, ignore_index=-100, label_smoothing=e)
        loss = loss + cfg.mtp_weight**j * term
    return loss


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, V, (3, T + 1), generator=g)
    seq[0, 4] = seq[0, 9] = seq[1, 1] = seq[2, 11] = EOS  # documents inside rows
    ids, targets = seq[:, :-1], seq[:, 1:].clone()
    targets[1, 5] = targets[2, 0] = -100  # masked targets (a conversation's prompt tokens)
    return ids, targets


@pytest.mark.parametrize(
    "switches",
    [
        {"mtp_weight": 0.5},
        {"mtp_weight": 0.3, "mtp_depth": 3, "logit_softcap": 15.0},
        {"mtp_weight": 1.0, "mtp_depth": 2, "doc_mask": True, "label_smoothing": 0.1},
    ],
)
def test_loss_and_gradients_equal_the_literal_reference(switches):
    ids, targets = batch()
    doc_mask = switches.get("doc_mask", False)
    model = make(**switches).train()
    docs = functional.document_ids(ids, EOS) if doc_mask else None
    got = model(ids, targets=targets, document_ids=docs)
    got.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = reference_loss(model, ids, targets, doc_mask)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    # the auxiliary terms add something: the loss is not the next-token loss alone
    with torch.no_grad():
        plain = F.cross_entropy(model(ids, document_ids=docs).flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert float(got.detach()) > float(plain) + 0.1


@pytest.mark.parametrize("cap, smoothing", [(0.0, 0.0), (15.0, 0.0), (0.0, 0.2), (30.0, 0.1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_head_pass_for_several_targets_equals_the_sum_of_their_losses(cap, smoothing, dtype):
    torch.manual_seed(5)
    h = torch.randn(2, 19, 16, dtype=dtype, requires_grad=True)
    w = (torch.randn(40, 16, dtype=dtype) * 0.5).requires_grad_()
    t = torch.randint(0, 40, (3, 2, 19))
    t[1, :, -1] = t[2, :, -2:] = t[0, 1, 3] = -100
    t[2, 0] = -100  # a term with few counted positions, averaged over its own
    coefs = [1.0, 0.5, 0.25]
    got = functional.multi_target_cross_entropy(h, w, t, coefs, softcap_at=cap, label_smoothing=smoothing, chunk_rows=8)
    got.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logits = (h @ w.T).flatten(0, 1)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    want = sum(
        c * F.cross_entropy(logits, tj.flatten(), ignore_index=-100, label_smoothing=smoothing)
        for c, tj in zip(coefs, t)
    )
    want.backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.double(), want.double(), **tol)
    torch.testing.assert_close(gh, h.grad, **tol)
    torch.testing.assert_close(gw, w.grad, **tol)
    with torch.no_grad():  # the path without a gradient computes the same loss
        again = functional.multi_target_cross_entropy(h, w, t, coefs, softcap_at=cap, label_smoothing=smoothing)
    torch.testing.assert_close(again.double(), want.double(), **tol)
    # a term with no counted position adds nothing (not NaN)
    t[2] = -100
    loss = functional.multi_target_cross_entropy(h.detach(), w.detach(), t, coefs, softcap_at=cap)
    with torch.no_grad():
        base = functional.multi_target_cross_entropy(h, w, t[:2], coefs[:2], softcap_at=cap)
    torch.testing.assert_close(loss, base)
    with pytest.raises(ValueError, match="multi_target_cross_entropy: targets"):
        functional.multi_target_cross_entropy(h, w, t, coefs[:2])


def test_future_targets_literal():
    targets = torch.tensor([[5, 6, 7, -100, 9, 10]])
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])  # an end-of-text token at input position 3
    assert functional.future_targets(targets, 1).tolist() == [[6, 7, -100, 9, 10, -100]]
    assert functional.future_targets(targets, 2).tolist() == [[7, -100, 9, 10, -100, -100]]
    # from position i, target i + 2 counts only when inputs i+1 .. i+2 hold no end-of-text
    assert functional.future_targets(targets, 2, docs).tolist() == [[7, -100, -100, 10, -100, -100]]
    assert functional.future_targets(targets, 6).tolist() == [[-100] * 6]
    assert functional.future_targets(targets, 0, docs).tolist() == targets.tolist()


def test_evaluation_stays_the_next_token_loss_and_the_weights_are_unchanged():
    ids, targets = batch(2)
    plain, mtp = make(), make(mtp_weight=0.5, mtp_depth=2)
    # no weights of its own: the same state dict, drawn from the same random stream
    assert plain.state_dict().keys() == mtp.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, mtp.state_dict()[k]), k
    mtp.eval()
    with torch.no_grad():
        logits = mtp(ids)
        assert torch.equal(logits, plain(ids))
        torch.testing.assert_close(
            mtp(ids, targets=targets), F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        )


def test_off_the_presets_training_loss_is_bit_identical():
    cfg = load_config("cpu-small").model
    cfg.vocab_size, cfg.context_length, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.d_ff = V, T, D, L, H, FF
    torch.manual_seed(0)
    model = TransformerLM.from_config(cfg).train()
    assert cfg.mtp_weight == 0.0 and ModelConfig.from_dict({"vocab_size": V}).mtp_weight == 0.0
    ids, targets = batch(3)
    train_loss = model(ids, targets=targets)
    model.eval()
    # training adds nothing to the next-token loss (no dropout or smoothing in the preset)
    assert torch.equal(train_loss, model(ids, targets=targets))
    want = functional.linear_cross_entropy(
        model.ln_final(model(ids, head=False)), model.lm_head.weight, targets, softcap_at=cfg.logit_softcap
    )
    assert torch.equal(train_loss, want)


def test_cached_generation_equals_the_full_forward():
    model = make(mtp_weight=0.5, mtp_depth=2).eval()
    ids, _ = batch(4)
    with torch.no_grad():
        full = model(ids)
        cache = model.make_kv_cache(ids.shape[0])
        steps = [model(ids[:, :5], kv_cache=cache)]
        steps += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(5, T)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
        # per-row start positions (continuous batching): row b's next token at its own length
        cache = model.make_kv_cache(2)
        model(ids[:2, :6], kv_cache=cache)
        lengths = torch.tensor([6, 4])
        step = model(torch.stack([ids[0, 6:7], ids[1, 4:5]]), kv_cache=cache, start_pos=lengths)
        torch.testing.assert_close(step[0, 0], full[0, 6], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step[1, 0], full[1, 4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("mtp_weight", -0.1, r"model.mtp_weight must be in \[0, 1\]"),
        ("mtp_weight", 1.5, r"model.mtp_weight must be in \[0, 1\]"),
        ("mtp_weight", float("nan"), r"model.mtp_weight must be in \[0, 1\]"),
        ("mtp_weight", True, r"model.mtp_weight must be in \[0, 1\]"),
        ("mtp_depth", 0, r"model.mtp_depth must be an int in \[1, context_length - 1\]"),
        ("mtp_depth", 256, r"model.mtp_depth must be an int in \[1, context_length - 1\]"),
        ("mtp_depth", 1.5, r"model.mtp_depth must be an int"),
    ],
)
def test_bad_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{field: value})


def test_exports_accept_it():
    # a training loss only: the inference graph is the plain model's, so every export takes it
    cfg = ModelConfig(vocab_size=V, mtp_weight=0.5, mtp_depth=2)
    assert gguf_architecture(cfg) == "llama" and hf_architecture(cfg) == "llama"
    cfg = ModelConfig(vocab_size=V, qk_norm=True, mtp_weight=0.5)
    assert gguf_architecture(cfg) == "qwen3" and hf_architecture(cfg) == "qwen3"


def test_a_run_from_weights_keeps_the_configs_mtp():
    from ferrolm.lm.config import TrainConfig, adopt_model

    cfg = TrainConfig()
    cfg.set("model.mtp_weight", 0.5)
    cfg.set("model.mtp_depth", 2)
    adopt_model(cfg, ModelConfig(vocab_size=V, d_model=64, num_heads=4), "source")
    # a training loss, not a weight: the config's value stays, the source's shape is taken
    assert (cfg.model.mtp_weight, cfg.model.mtp_depth, cfg.model.d_model) == (0.5, 2, 64)

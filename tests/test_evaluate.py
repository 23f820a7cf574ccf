"""ferrolm.lm.evaluate and `ferrolm eval`: loss, perplexity and bits per byte equal a hand
computation on a small shard; training logs bits per byte too."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from shard_util import trained_run

from ferrolm.lm.checkpoint import load_model
from ferrolm.lm.evaluate import evaluate
from ferrolm.lm.metrics import read_metrics

torch.set_num_threads(1)
TINY = dict(context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("eval"), TINY, steps=2)


def _by_hand(model, tok, tokens: list[int]) -> tuple[float, float, int]:
    """(nats, bytes, predicted tokens): windows of 16 inputs, each token predicted once."""
    nats, nbytes = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(tokens) - 1, 16):
            x = tokens[s : s + 16]
            y = tokens[s + 1 : s + 17]
            x = x[: len(y)]
            logp = torch.log_softmax(model(torch.tensor([x])).double(), dim=-1)[0]
            nats -= sum(logp[i, t].item() for i, t in enumerate(y))
            nbytes += sum(0 if t == tok.eos_id else len(tok.token_bytes(t)) for t in y)
    return nats, nbytes, len(tokens) - 1


def test_eval_matches_a_hand_computation(run):
    run_dir, tok, val = run
    ckpt = run_dir / "best.pt"
    tokens = np.fromfile(f"{val}.bin", dtype="<u2")[:203].tolist()  # 12 full windows and a short one
    r = evaluate(ckpt, val, max_tokens=203, batch_size=5)
    model, _, _ = load_model(ckpt, tokenizer=False)
    nats, nbytes, n = _by_hand(model, tok, tokens)
    assert r["tokens"] == n == 202 and r["bytes"] == nbytes
    assert r["loss"] == pytest.approx(nats / n, rel=1e-6)
    assert r["perplexity"] == pytest.approx(math.exp(nats / n), rel=1e-6)
    assert r["bits_per_byte"] == pytest.approx(nats / math.log(2) / nbytes, rel=1e-6)
    assert r["tokens_per_s"] > 0
    assert evaluate(ckpt, val, max_tokens=203, batch_size=1)["loss"] == pytest.approx(r["loss"], rel=1e-6)


def test_eval_cli_json(run, capsys):
    from ferrolm.app.cli import main

    run_dir, _, val = run
    capsys.readouterr()
    assert (
        main(["eval", "--checkpoint", str(run_dir / "best.pt"), "--data", str(val), "--json", "--device", "cpu"]) == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert {"loss", "perplexity", "bits_per_byte", "tokens_per_s"} <= set(r) and r["bits_per_byte"] > 0
    assert main(["eval", "--checkpoint", str(run_dir / "best.pt"), "--data", str(val), "--device", "cpu"]) == 0
    assert "bits/byte" in capsys.readouterr().out


def test_training_logs_bits_per_byte(run):
    run_dir, _, _ = run
    last = [r for r in read_metrics(run_dir) if r.get("val_loss") is not None][-1]
    assert last["val_bpb"] > 0
    # the same ratio as the eval windows': val_loss / ln 2 / bytes per token
    assert last["val_bpb"] < last["val_loss"] / math.log(2)  # more than one byte per token on average

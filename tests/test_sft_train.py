"""Fine-tuning on conversations: a run on JSON Lines data (chat tokens added, counts logged),
resume bit-exact, the loss averaged over all assistant tokens of a step, the sft preset's
refusal without an init source, and `ferrolm eval`'s masked loss.

Tiny models (d_model 32, context 96) on the CPU in fp32: a few seconds a run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from test_train import final_weights, run_cli
from tiny_lm import stdlib_text, tiny_run

from ferrolm import Tokenizer
from ferrolm.lm.chat import CHAT_TOKENS, render
from ferrolm.lm.checkpoint import load_model, read_checkpoint
from ferrolm.lm.config import ConfigError, load_config
from ferrolm.lm.conversations import ConversationDataError
from ferrolm.lm.data import masked_targets, packed_rows
from ferrolm.lm.evaluate import evaluate
from ferrolm.lm.metrics import read_metrics
from ferrolm.lm.train import TrainConfig, train

torch.set_num_threads(1)


def arithmetic(rng: random.Random) -> dict:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    answer = str(a + b) if rng.random() < 0.5 else f"The sum of {a} and {b} is {a + b}."  # answers of two lengths
    return {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    d = tmp_path_factory.mktemp("chats")
    Tokenizer.train(iter([stdlib_text()]), 300, ["<|endoftext|>"], progress=False).save(d / "tok")
    rng = random.Random(0)
    for name, n in (("train", 300), ("val", 24)):
        with open(d / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(arithmetic(rng)) + "\n" for _ in range(n))
    with open(d / "train.jsonl", "a", encoding="utf-8") as f:
        f.write('{"messages": [{"role": "assistant", "content": "out of order"}]}\n')  # row 301
    return d


def sft_config(chats, out_dir, **sections) -> TrainConfig:
    cfg = TrainConfig()
    cfg.update(
        {
            "model": dict(context_length=96, d_model=32, num_layers=2, num_heads=2, d_ff=64),
            "data": {
                "train": str(chats / "train.jsonl"),
                "val": str(chats / "val.jsonl"),
                "tokenizer": str(chats / "tok"),
            },
            "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
            "schedule": {"max_steps": 12, "warmup_steps": 2, "batch_size": 4},
            "run": {
                "out_dir": str(out_dir),
                "device": "cpu",
                "autocast_bf16": False,
                "compile": False,
                "eval_every": 3,
                "eval_batches": 2,
                "log_every": 3,
                "checkpoint_every": 3,
                "progress": False,
                "seed": 7,
                "num_threads": 1,
            },
        }
    )
    cfg.update(sections)
    return cfg.validate()


def test_a_run_on_conversations_adds_the_chat_tokens_and_logs_the_counts(chats, tmp_path, capsys):
    summary = train(sft_config(chats, tmp_path / "run"))
    assert summary.status == "done" and summary.final_val_loss < read_metrics(tmp_path / "run")[0]["val_loss"]
    err = capsys.readouterr().err
    assert "data.train: 300 conversations" in err and "1 malformed row(s) skipped" in err
    assert f"{chats / 'train.jsonl'}:301: roles out of order at message 0 (assistant)" in err
    first = read_metrics(tmp_path / "run")[0]
    assert (first["train_conversations"], first["train_bad_rows"], first["val_conversations"]) == (300, 1, 24)
    tok = Tokenizer.load(tmp_path / "run" / "tokenizer")  # the run's tokenizer: the base one and the chat tokens
    base = Tokenizer.load(chats / "tok")
    assert tok.vocab_size == base.vocab_size + len(CHAT_TOKENS) and all(t in tok.special_token_ids for t in CHAT_TOKENS)
    model, found, _ = load_model(tmp_path / "run")
    assert model.config.vocab_size == tok.vocab_size and found.fingerprint == tok.fingerprint


def test_conversation_batches_resume_bit_exact(chats, tmp_path):
    def config(out):
        return sft_config(chats, out, model={"doc_mask": True}, data={"doc_buffer": 16})

    straight = train(config(tmp_path / "straight"))
    assert straight.status == "done" and straight.step == 12

    def stop_at_6(step, record):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    first = train(config(tmp_path / "resumed"), on_step=stop_at_6)
    assert first.status == "interrupted" and first.step == 6
    assert read_checkpoint(first.last_checkpoint)["batching"] == "conversations"
    resumed = load_config(tmp_path / "resumed" / "config.toml")  # as `--resume` reads it: the run's tokenizer
    second = train(resumed, resume=tmp_path / "resumed")
    assert second.step == 12

    def losses(run):
        return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run)]

    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    a, b = final_weights(tmp_path / "straight", 12), final_weights(tmp_path / "resumed", 12)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_step_loss_is_the_mean_over_all_assistant_tokens_of_its_micro_batches(chats, tmp_path):
    """4 rows in one micro-batch, or the same 4 rows as 2 micro-batches of 2: one gradient.
    (A mean of the two micro-batches' means would weigh their assistant tokens unequally.)"""
    one = sft_config(chats, tmp_path / "one", schedule={"max_steps": 1, "warmup_steps": 0})
    two = sft_config(chats, tmp_path / "two", schedule={"max_steps": 1, "warmup_steps": 0, "batch_size": 2})
    two.schedule.tokens_per_step = 4 * 96
    for cfg in (one, two):
        cfg.run.eval_at_start = False
        train(cfg)
    la, lb = (read_metrics(tmp_path / name)[0]["train_loss"] for name in ("one", "two"))
    assert la == pytest.approx(lb, rel=1e-5)
    a, b = final_weights(tmp_path / "one", 1), final_weights(tmp_path / "two", 1)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_the_sft_preset_refuses_without_an_init_source(chats, tmp_path):
    cfg = load_config("sft", [f"data.train={chats / 'train.jsonl'}", f"data.val={chats / 'val.jsonl'}"])
    assert cfg.data.format == "conversations" and cfg.optimizer.lr < load_config("cs336").optimizer.lr  # AdamW both
    cfg.run.out_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="pass --init-from"):
        train(cfg)
    out = run_cli("train", "--config", "sft", "--set", f"data.train={chats / 'train.jsonl'}", cwd=tmp_path)
    assert out.returncode == 2 and "sft preset" in out.stderr and "--init-from" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "runs").exists()


def test_too_many_malformed_rows_refuse_the_run_from_the_cli(chats, tmp_path):
    out = run_cli(
        "train",
        "--config",
        "cs336",
        "--set",
        f"data.train={chats / 'train.jsonl'}",
        "--set",
        f"data.val={chats / 'val.jsonl'}",
        "--set",
        f"data.tokenizer={chats / 'tok'}",
        "--set",
        "data.max_bad_share=0",
        "--set",
        f"run.out_dir={tmp_path / 'run'}",
        "--set",
        "run.device=cpu",
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (
        "1 of 301 rows are not usable conversations" in out.stderr
        and "train.jsonl:301: roles out of order" in out.stderr
    )
    with pytest.raises(ConfigError, match="set data.tokenizer=DIR"):
        cfg = sft_config(chats, tmp_path / "r2")
        cfg.data.tokenizer = ""
        train(cfg)


def test_eval_scores_the_assistant_tokens_as_training_validates(chats, tmp_path):
    summary = train(sft_config(chats, tmp_path / "run", run={"eval_batches": 100, "keep_best": False}))
    ckpt = summary.last_checkpoint
    r = evaluate(ckpt, chats / "val.jsonl", batch_size=3)
    assert r["conversations"] == 24 and r["bad_rows"] == 0 and r["cropped"] == 0
    assert r["loss"] == pytest.approx(summary.final_val_loss, rel=1e-5)  # the same rows, the same mask
    # by hand: -log p of each assistant token (and its end) over the packed validation rows
    model, tok, _ = load_model(ckpt)
    from ferrolm.lm.conversations import read_conversations

    ids, mask = packed_rows(read_conversations(chats / "val.jsonl", tok, row_len=97), 96)
    nats, count = 0.0, 0
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.from_numpy(ids[:, :-1])).double(), -1)
    for row in range(len(ids)):
        for i in range(96):
            if mask[row, i + 1]:
                nats -= float(logp[row, i, ids[row, i + 1]])
                count += 1
    assert r["tokens"] == count and r["loss"] == pytest.approx(nats / count, rel=1e-5)
    assert count == sum(sum(render(tok, json.loads(line)["messages"])[1]) for line in open(chats / "val.jsonl"))
    out = run_cli("eval", "--checkpoint", str(ckpt), "--data", str(chats / "val.jsonl"), "--json", "--no-progress")
    assert out.returncode == 0 and json.loads(out.stdout)["loss"] == pytest.approx(r["loss"], rel=1e-6)
    masked_x, masked_y = masked_targets(torch.from_numpy(ids), torch.from_numpy(mask))
    assert int((masked_y >= 0).sum()) == count
    with pytest.raises(ValueError, match="--max-tokens"):
        evaluate(ckpt, chats / "val.jsonl", max_tokens=100)
    base, _, _ = tiny_run(tmp_path / "base", steps=1)  # a base model: its tokenizer has no chat tokens
    with pytest.raises(ValueError, match="lacks the chat tokens"):
        evaluate(base, chats / "val.jsonl")


def test_a_bad_conversation_file_is_named(chats, tmp_path):
    (tmp_path / "bad.jsonl").write_text("{}\n[]\n")
    with pytest.raises(ConversationDataError, match=r"bad\.jsonl:1: the row has no 'messages' list"):
        train(sft_config(chats, tmp_path / "run", data={"val": str(tmp_path / "bad.jsonl")}))


def test_a_run_from_weights_on_conversations_grows_them_by_the_chat_tokens(chats, tmp_path):
    """run.init_from with conversation data: the source's shape and weights, its tokenizer
    with the chat tokens, and the model's token tables grown by their rows."""
    from ferrolm.lm.chat import add_chat_tokens, grow_vocab

    source, base_tok, _ = tiny_run(tmp_path / "base", steps=1)  # context 64, d_model 32: not the config's
    cfg = sft_config(
        chats, tmp_path / "run", schedule={"max_steps": 1, "warmup_steps": 0}, run={"init_from": str(source)}
    )
    cfg.data.tokenizer = ""
    cfg.model.context_length, cfg.model.num_heads = 64, 4
    cfg.optimizer.lr, cfg.optimizer.min_lr = 1e-9, 1e-9
    train(cfg)
    saved = load_config(tmp_path / "run" / "config.toml")
    assert saved.model.vocab_size == base_tok.vocab_size + len(CHAT_TOKENS)
    assert Tokenizer.load(saved.data.tokenizer).fingerprint == add_chat_tokens(base_tok).fingerprint
    after = final_weights(tmp_path / "run", 1)
    start = grow_vocab(read_checkpoint(source)["model"], base_tok.vocab_size, saved.model.vocab_size)
    for k, v in start.items():
        torch.testing.assert_close(after[k], v, atol=1e-6, rtol=0)


def test_two_processes_train_on_conversations(chats, tmp_path):
    """Under torchrun each process packs its own rows, and the step's assistant tokens are
    counted over both (one all-reduce), each weighing its share of them."""
    from ferrolm.lm.config import to_toml

    cfg = sft_config(chats, tmp_path / "ddp", schedule={"max_steps": 4, "batch_size": 2}, run={"checkpoint_every": 0})
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out = subprocess.run(
        [*cmd, "-m", "ferrolm", "train", "--config", str(tmp_path / "c.toml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = read_metrics(tmp_path / "ddp")
    assert [r["step"] for r in records] == [0, 3, 4] and records[0]["train_conversations"] == 300
    assert all(r["val_loss"] is None or r["val_loss"] < 10 for r in records) and records[-1]["train_loss"] > 0
    ckpt = read_checkpoint(tmp_path / "ddp" / "checkpoints" / "step_00000004.pt")
    assert ckpt["world_size"] == 2 and ckpt["batching"] == "conversations"
    assert not torch.equal(ckpt["sampler_states"][0], ckpt["sampler_states"][1]), "each rank packs its own rows"

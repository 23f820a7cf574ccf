"""The batch-size schedule (schedule.batch_ramp_steps, schedule.batch_ramp_start): the rows of
each step, the tokens the log counts, the loss over however many rows a step has, resume
mid-ramp, and that with the ramp off a run is bit-identical."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from test_train import final_weights, shards, tiny_config  # noqa: F401  (shards: a fixture)

from ferrolm.lm import train as train_module
from ferrolm.lm.config import ScheduleSection
from ferrolm.lm.data import DocumentRows
from ferrolm.lm.metrics import read_metrics
from ferrolm.lm.train import ConfigError, batch_rows, train

torch.set_num_threads(1)
T = 16  # test_train's TINY_MODEL context


def rows_seen(monkeypatch) -> list[int]:
    """The rows of every micro-batch the training loss is computed on, in order."""
    seen: list[int] = []
    real = train_module.model_loss

    def counting(model, x, y, bf16, document_ids=None):
        if model.training:  # not the evaluations
            seen.append(x.shape[0])
        return real(model, x, y, bf16, document_ids)

    monkeypatch.setattr(train_module, "model_loss", counting)
    return seen


def test_rows_of_each_step_are_the_linear_ramp():
    s = ScheduleSection(batch_size=8, batch_ramp_steps=4, batch_ramp_start=0.25)
    # 8 x (0.25 + 0.75 step / 4) = 2, 3.5, 5, 6.5, then the full 8 (halves round up)
    assert [batch_rows(s, step) for step in range(7)] == [2, 4, 5, 7, 8, 8, 8]
    s = ScheduleSection(batch_size=3, batch_ramp_steps=10, batch_ramp_start=0.01)
    assert batch_rows(s, 0) == 1  # never an empty micro-batch
    assert [batch_rows(ScheduleSection(batch_size=5), step) for step in (0, 1, 100)] == [5, 5, 5]


@pytest.mark.parametrize("accum", [1, 2])
def test_each_step_trains_its_rows_and_the_log_counts_them(shards, tmp_path, monkeypatch, accum):  # noqa: F811
    seen = rows_seen(monkeypatch)
    sched = {"max_steps": 6, "batch_size": 8, "batch_ramp_steps": 4, "tokens_per_step": accum * 8 * T}
    cfg = tiny_config(shards, tmp_path / "run", schedule=sched, run={"log_every": 1, "eval_every": 0})
    assert train(cfg).status == "done"
    per_step = [2, 4, 5, 7, 8, 8]
    assert seen == [r for r in per_step for _ in range(accum)]
    records = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    tokens = [0] + [r["tokens"] for r in records]
    assert [b - a for a, b in zip(tokens, tokens[1:])] == [r * T * accum for r in per_step]


def test_under_compile_only_the_full_batch_runs_compiled(shards, tmp_path, monkeypatch):  # noqa: F811
    # each ramp size would compile anew, and past torch.compile's limit of graphs the function
    # (the full batch after the ramp included) would stay eager: the ramp's steps run eager
    seen = rows_seen(monkeypatch)
    compiled_rows: list[int] = []

    def recording_compile(fn, *args, **kwargs):
        def run(model, x, *rest):
            compiled_rows.append(x.shape[0])
            return fn(model, x, *rest)

        return run

    monkeypatch.setattr(train_module.torch, "compile", recording_compile)
    sched = {"max_steps": 6, "batch_size": 8, "batch_ramp_steps": 4, "tokens_per_step": 8 * T}
    cfg = tiny_config(shards, tmp_path / "run", schedule=sched, run={"eval_every": 0, "compile": "true"})
    assert train(cfg).status == "done"
    assert seen == [2, 4, 5, 7, 8, 8]
    assert compiled_rows == [8, 8]


def test_a_step_of_two_micro_batches_is_one_batch_of_their_rows(shards, tmp_path):  # noqa: F811
    """The loss and gradient of a step are the mean over its rows however they are split: 2 x 2
    then 2 x 3 rows (accumulated) learn what 4 then 6 rows in one micro-batch do (random
    windows drawn in one stream give the same rows either way)."""
    common = {"max_steps": 3, "batch_ramp_steps": 2, "batch_ramp_start": 0.5}
    run = {"log_every": 1, "eval_every": 0}
    split = tiny_config(
        shards, tmp_path / "split", schedule={**common, "batch_size": 4, "tokens_per_step": 8 * T}, run=run
    )
    whole = tiny_config(shards, tmp_path / "whole", schedule={**common, "batch_size": 8}, run=run)
    train(split), train(whole)
    a, b = read_metrics(tmp_path / "split"), read_metrics(tmp_path / "whole")
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b] == [0, 4 * T, 10 * T, 18 * T]
    np.testing.assert_allclose([r["train_loss"] for r in a[1:]], [r["train_loss"] for r in b[1:]], rtol=1e-5)
    wa, wb = final_weights(tmp_path / "split", 3), final_weights(tmp_path / "whole", 3)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5, msg=k)


def test_off_a_run_is_bit_identical(shards, tmp_path):  # noqa: F811
    run = {"log_every": 2, "eval_every": 4}
    plain = tiny_config(shards, tmp_path / "plain", schedule={"max_steps": 8}, run=run)
    # batch_ramp_start without batch_ramp_steps does nothing; a ramp that starts at the full
    # batch draws every batch at its full size through the schedule's own path
    unused = tiny_config(shards, tmp_path / "unused", schedule={"max_steps": 8, "batch_ramp_start": 0.5}, run=run)
    full = tiny_config(
        shards, tmp_path / "full", schedule={"max_steps": 8, "batch_ramp_steps": 6, "batch_ramp_start": 1.0}, run=run
    )
    for cfg in (plain, unused, full):
        train(cfg)

    def log(name):  # the records but their clocks and speeds
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in read_metrics(tmp_path / name)]

    want, weights = log("plain"), final_weights(tmp_path / "plain", 8)
    for name in ("unused", "full"):
        assert log(name) == want, name
        got = final_weights(tmp_path / name, 8)
        assert all(torch.equal(weights[k], got[k]) for k in weights), name


@pytest.mark.parametrize("data", ["random", "documents"])
def test_resume_mid_ramp_is_bit_exact(shards, tmp_path, data):  # noqa: F811
    sections = {
        "schedule": {"max_steps": 12, "batch_size": 6, "batch_ramp_steps": 9, "batch_ramp_start": 0.3},
        "run": {"eval_every": 3, "log_every": 3, "checkpoint_every": 3},
    }
    if data == "documents":  # the document packer's state, and multi-token prediction in the loop
        sections["data"] = {"batching": "documents", "doc_buffer": 16}
        sections["model"] = {"doc_mask": True, "mtp_weight": 0.5, "mtp_depth": 2}

    straight = train(tiny_config(shards, tmp_path / "straight", **sections))
    assert straight.status == "done" and straight.step == 12

    def stop_at_5(step, record):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    first = train(tiny_config(shards, tmp_path / "resumed", **sections), on_step=stop_at_5)
    assert first.status == "interrupted" and first.step == 5  # mid-ramp
    second = train(tiny_config(shards, tmp_path / "resumed", **sections), resume=tmp_path / "resumed")
    assert second.status == "done" and second.step == 12

    def log(run):
        return [(r["step"], r["tokens"], r["train_loss"], r["val_loss"]) for r in read_metrics(run)]

    assert log(tmp_path / "resumed") == log(tmp_path / "straight")
    rows = [batch_rows(tiny_config(shards, tmp_path / "x", **sections).schedule, s) for s in range(12)]
    assert log(tmp_path / "straight")[-1][1] == sum(rows) * T
    a, b = final_weights(tmp_path / "straight", 12), final_weights(tmp_path / "resumed", 12)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_time_schedule_ramps_by_steps(shards, tmp_path, monkeypatch):  # noqa: F811
    seen = rows_seen(monkeypatch)
    sched = {"max_steps": 4, "batch_size": 4, "batch_ramp_steps": 2, "schedule_by": "time", "max_time_s": 3600.0}
    cfg = tiny_config(shards, tmp_path / "run", schedule=sched, run={"log_every": 1, "eval_every": 0})
    assert train(cfg).step == 4
    assert seen == [1, 3, 4, 4]  # 4 x 0.25, 4 x 0.625 = 2.5 up to 3, then the full batch
    assert [r["tokens"] for r in read_metrics(tmp_path / "run")][-1] == 12 * T


def test_a_document_packer_draws_the_rows_asked_for():
    stream = np.array([0, 1, 2, 3, 0, 4, 5, 0, 6, 7, 8, 9, 0, 1] * 20, dtype=np.int64)

    def packer():
        g = torch.Generator().manual_seed(0)
        return DocumentRows(stream, 0, 4, 7, g, 4)

    a, b = packer(), packer()
    # rows are packed one after another: 2 rows then 3 are the 5 rows of one draw
    assert np.array_equal(np.concatenate([a.next_rows(2), a.next_rows(3)]), b.next_rows(5))
    assert a.next_rows().shape == (4, 8)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"batch_ramp_steps": -1}, r"schedule.batch_ramp_steps must be >= 0"),
        ({"batch_ramp_start": 0.0}, r"schedule.batch_ramp_start must be in \(0, 1\]"),
        ({"batch_ramp_start": 1.5}, r"schedule.batch_ramp_start must be in \(0, 1\]"),
        ({"batch_ramp_start": float("nan")}, r"schedule.batch_ramp_start must be in \(0, 1\]"),
    ],
)
def test_bad_values_are_named(shards, tmp_path, override, message):  # noqa: F811
    with pytest.raises(ConfigError, match=message):
        tiny_config(shards, tmp_path / "run", schedule=override)


def test_a_planned_prefetcher_hands_out_the_rows_planned_for_each_batch():
    from test_sft_data import literal_data

    from ferrolm.lm.data import BatchPrefetcher, ConversationRows

    data = literal_data(np.random.default_rng(2).integers(3, 14, size=40).tolist())

    def source():
        return ConversationRows(data, 4, 15, torch.Generator().manual_seed(7), buffer_size=8)

    plan = [1, 3, 2, 4, 4]  # batch index 2 onwards: first=2 starts the prefetcher mid-plan
    straight_ids, straight_mask = source().next_rows(sum(plan[2:]))
    pre = BatchPrefetcher(None, 4, 15, "cpu", rows=source(), plan=plan.__getitem__, first=2)
    try:
        got = [pre.next_counted() for _ in range(3)]
    finally:
        pre.close()
    assert [x.shape[0] for x, _, _ in got] == [2, 4, 4]
    assert torch.equal(torch.cat([x for x, _, _ in got]), torch.from_numpy(straight_ids[:, :-1]))
    assert sum(n for *_, n in got) == int(straight_mask[:, 1:].sum())

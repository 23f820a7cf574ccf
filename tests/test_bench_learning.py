"""benches/bench_learning.py's report: how a loss difference is worded."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benches" / "bench_learning.py"


@pytest.fixture(scope="module")
def bench_learning():
    spec = importlib.util.spec_from_file_location("bench_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "loss, ref, words",
    [
        (5.333, 5.444, "2.0 % lower"),
        (5.965, 5.444, "9.6 % higher"),  # a higher loss is never "-9.6 % lower"
        (4.703, 5.374, "12.5 % lower"),
        (5.4441, 5.444, "level"),
    ],
)
def test_a_loss_is_worded_by_its_sign(bench_learning, loss, ref, words):
    assert bench_learning.relative_loss(loss, ref) == words


def test_the_report_lines_word_each_contender_against_the_reference(bench_learning):
    finals = {"cs336": {"val_loss": 5.965}, "cpu-small": {"val_loss": 5.333}, "nanochat": {"val_loss": 5.444}}
    assert bench_learning.lower_than(finals, "nanochat") == [
        "- cs336: validation loss 9.6 % higher than nanochat's",
        "- cpu-small: validation loss 2.0 % lower than nanochat's",
    ]


def test_the_portable_preset_races_by_default_and_its_cost_against_cpu_small_is_worded(bench_learning):
    args = bench_learning.arg_parser().parse_args([])
    assert args.contenders.split(",") == ["cs336", "cpu-small", "portable"]
    # the wall-clock race scales each contender's warmup from its preset: each one loads
    assert bench_learning.timed_spec("portable", 1000) == "portable=portable+schedule.warmup_steps=20"
    finals = {"cs336": {"val_loss": 5.9}, "cpu-small": {"val_loss": 5.0}, "portable": {"val_loss": 5.1}}
    assert bench_learning.portable_cost(finals) == ["- portable: validation loss 2.0 % higher than cpu-small's"]
    assert bench_learning.portable_cost({"cs336": {"val_loss": 5.9}, "cpu-small": {"val_loss": 5.0}}) == []


def test_the_summary_rows_word_portables_loss_against_cpu_small(bench_learning, tmp_path):
    runs = {}
    for name, loss in (("cs336", 5.9), ("cpu-small", 5.0), ("portable", 5.1)):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        row = {"step": 250, "tokens": 1_024_000, "time_s": 60.0, "val_loss": loss}
        (runs[name] / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    args = bench_learning.arg_parser().parse_args(["--steps", "250"])
    rows = bench_learning.latest_result({"steps": runs}, args)
    assert (
        "| portable (exports to GGUF and HF): val loss, equal steps (250) | cpu-small | **2.0 % higher** (5.100 vs 5.000) |"
        in rows
    )

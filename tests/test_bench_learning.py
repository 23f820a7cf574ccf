"""benches/bench_learning.py's report: how a loss difference is worded."""

from __future__ import annotations

import importlib.util
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

"""benches/bench_sft.py: the generated task's held-out split, the report, and the whole
script at a tiny size (--quick)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benches" / "bench_sft.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_sft", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_training_row_asks_a_held_out_question(bench, tmp_path):
    train, val, heldout = bench.make_task(tmp_path, 2000, 100)
    asked = {json.loads(line)["messages"][0]["content"] for f in (train, val) for line in f.read_text().splitlines()}
    assert len(heldout) == 100 and {h["task"] for h in heldout} == {"add", "repeat"}
    assert not asked & {h["question"] for h in heldout}
    assert len(train.read_text().splitlines()) + len(val.read_text().splitlines()) == 2000
    add = next(h for h in heldout if h["task"] == "add")
    a, b = (int(x) for x in add["question"].removeprefix("What is ").removesuffix("?").split(" + "))
    assert add["answer"] == str(a + b)


def test_the_report_shows_paths_from_the_repository_and_each_target(bench):
    class Args:
        argv, heldout = ["--quick", "--work", str(REPO / "benches/out/x")], 10

    cmd = [
        sys.executable,
        "-m",
        "ferrolm",
        "train",
        "--config",
        "sft",
        "--init-from",
        str(REPO / "benches/out/sft/base"),
    ]
    figures = {
        "base_accuracy": {"add": 0.0, "repeat": 0.1, "all": 0.05},
        "sft_accuracy": {"add": 0.4, "repeat": 0.9, "all": 0.65},
        "base_tokens_per_s": 1500.0,
        "pretrain_adamw_tokens_per_s": 2000.0,
        "sft_tokens_per_s": 1900.0,
        "real_share": 0.981,
    }
    text = bench.report(Args, figures, [cmd])
    assert "    ferrolm train --config sft --init-from benches/out/sft/base" in text
    assert "    python benches/bench_sft.py --quick --work benches/out/x\n" in text
    assert "| all | 5.0 % | 65.0 % |" in text and "| fine-tuning / pretraining | 0.95x | >= 0.9x |" in text
    assert "| real (non-padding) tokens in packed rows | 98.1 % | >= 90 % |" in text
    assert "| fine-tuning tokens/s | pretraining, same shape and optimizer | **0.95x** |" in text
    assert "| fine-tuned cpu-small: held-out exact match | the base model | **65.0 %** vs 5.0 % |" in text
    assert "Machine: " in text and str(REPO) not in text


def _init_from_supported() -> bool:
    out = subprocess.run([sys.executable, "-m", "ferrolm", "train", "--help"], capture_output=True, text=True)
    return "--init-from" in out.stdout


def test_the_quick_bench_runs_end_to_end(tmp_path):
    shared = Path(os.environ.get("FERROLM_SHARED", REPO.parent / "shared"))
    if not (shared / "corpora" / "webtext" / "enwiki_2016_wikiextractor.txt").is_file():
        pytest.skip(f"the Wikipedia text is not under {shared}/corpora/webtext (set FERROLM_SHARED)")
    if not _init_from_supported():
        pytest.skip("ferrolm train has no --init-from here: the fine-tuning step cannot start from the base model")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--work", str(tmp_path), "--out", str(tmp_path / "sft.md")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = (tmp_path / "sft.md").read_text()
    assert "| fine-tuning / pretraining |" in text and "| all |" in text

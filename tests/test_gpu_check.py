"""benches/gpu_check.py's checks, run on the CPU (CI also runs the whole script as a dry run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHES = Path(__file__).resolve().parents[1] / "benches"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(BENCHES))
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHES / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCHES))


@pytest.mark.slow
def test_checks_pass_on_the_cpu(gpu_check, tmp_path):
    cpu = torch.device("cpu")
    assert "difference" in gpu_check.check_logits(cpu, gpu_check.TINY)
    assert "cache = no cache" in gpu_check.check_generate(cpu, gpu_check.TINY)
    shards = gpu_check.prepare_shards(tmp_path / "data", tiny=True)
    assert shards["train_tokens"] > 10_000
    assert "0.00e+00" in gpu_check.check_resume(cpu, shards, tmp_path / "resume")  # exact on the CPU


def test_a_failing_check_is_reported_not_raised(gpu_check):
    def broken():
        raise AssertionError("logits differ")

    name, ok, detail = gpu_check.run_check("a check", broken)
    assert (name, ok) == ("a check", False) and "logits differ" in detail


def _stories(n: int) -> str:
    return "".join(f"Story {i} is short.\n<|endoftext|>\n" for i in range(n))


def test_tinystories_text_cuts_at_stories_and_holds_out_a_tail(gpu_check, tmp_path):
    src = tmp_path / "ts-train.txt"
    src.write_text(_stories(200))
    train, val, source = gpu_check.tinystories_text(src, tmp_path / "out", max_bytes=3000)
    train_text, val_text = train.read_text(), val.read_text()
    assert len(train_text) + len(val_text) <= 3000 and "held out" in source
    for text in (train_text, val_text):  # whole stories only
        assert text.startswith("Story ") and text.endswith("<|endoftext|>\n")
    assert not set(train_text.split("<|endoftext|>")) & set(val_text.split("<|endoftext|>")) - {"\n"}


def test_tinystories_folder_prefers_the_v2_files(gpu_check, tmp_path):
    for name in ("TinyStories-train.txt", "TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt"):
        (tmp_path / name).write_text(_stories(20))
    _, _, source = gpu_check.tinystories_text(tmp_path, tmp_path / "out", max_bytes=10_000)
    assert source == "TinyStoriesV2-GPT4-train.txt, validation TinyStoriesV2-GPT4-valid.txt"


def test_the_race_keeps_each_presets_warmup_share(gpu_check):
    # tinystories: 200 of 10,000 steps; cs336: 50 of 1,000 (and an override is honoured).
    assert gpu_check.bench_learning.timed_spec("tinystories", 1_000_000).endswith("schedule.warmup_steps=20000")
    spec = gpu_check.bench_learning.timed_spec("w=cs336+schedule.warmup_steps=100+optimizer.lr=0.01", 1_000_000)
    assert spec == "w=cs336+schedule.warmup_steps=100000+optimizer.lr=0.01"


def test_a_partly_failed_stage_keeps_its_report(gpu_check):
    def half():
        raise gpu_check.PartlyFailed(["| a | 1 |"], "b failed")

    lines, ok = gpu_check.stage("a stage", half)
    assert not ok and "| a | 1 |" in lines and "**FAILED**: b failed" in lines

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

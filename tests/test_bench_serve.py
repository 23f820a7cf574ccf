"""benches/bench_serve.py: its options, and its --quick --prefill path end to end (a smoke test
of the script on a tiny load, not a measurement)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benches" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options(bench, capsys):
    args = bench.parse_args([])
    assert (args.prefill, args.prefill_chunk, args.quick, args.streams, args.ttft) == (False, None, False, 16, 10)
    args = bench.parse_args(["--prefill", "--prefill-chunk", "128"])
    assert args.prefill and args.prefill_chunk == 128
    quick = bench.parse_args(["--quick", "--prefill"])
    assert (quick.requests, quick.streams, quick.ttft) == (1, 2, 1)
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--streams", "0"])
    assert e.value.code == 2 and "--streams must be >= 1" in capsys.readouterr().err
    assert len(bench.LONG_PROMPT) == 512 and bench.LONG_CONTEXT >= 640


@pytest.mark.slow
def test_quick_prefill_run_prints_its_rows():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--prefill", "--prefill-chunk", "16"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "server --prefill-chunk 16" in out.stdout
    for row in ("| n=8 / n=1 (TTFT) |", "| under 2 streams / idle (TTFT) |", "| drop while it prefills |"):
        assert row in out.stdout

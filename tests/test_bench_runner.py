"""benches/run.py: running scripts, reading their tables, charts, RESULTS.md (on fake benchmark scripts)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import time
from pathlib import Path

import pytest

RUN_PY = Path(__file__).resolve().parent.parent / "benches" / "run.py"


@pytest.fixture()
def run(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_run", RUN_PY)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_run", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    benches = tmp_path / "benches"
    (benches / "results").mkdir(parents=True)
    monkeypatch.setattr(mod, "BENCHES_DIR", benches)
    monkeypatch.setattr(mod, "OUT_DIR", benches / "out")
    monkeypatch.setattr(mod, "DOCS_DIR", tmp_path / "docs")
    monkeypatch.setattr(mod, "RESULTS", benches / "RESULTS.md")
    monkeypatch.setattr(mod, "RESULTS_DIR", benches / "results")
    return mod


TABLE = """\
# comment line
  progress line
## vocab 1,000

| library | time (s) | vs ferrolm | note |
|---|---:|---:|---|
| ferrolm | 0.50 | 1.0× | |
| peer | 1.00 | 2.0× the time | slower |
| **ferrolm / HF** | | **1.25x** | |
"""


def test_tables_and_ratios(run):
    tables = run.markdown_tables(TABLE)
    assert len(tables) == 1 and tables[0]["heading"] == "vocab 1,000"
    assert tables[0]["header"][2] == "vs ferrolm" and len(tables[0]["rows"]) == 3
    series = run.ratio_series(tables)
    assert series == [("vocab 1,000: vs ferrolm", [("ferrolm", 1.0), ("peer", 2.0), ("ferrolm / HF", 1.25)])]
    assert run.ratio_series(run.markdown_tables("| a | b |\n|---|---|\n| x | 12 |\n")) == []
    # one column per library, a ratio inside each cell: one series per row
    per_lib = "## wiki.txt\n| mode | ferrolm | tiktoken | ids |\n|---|---|---|---|\n| encode | 13.4 (61), 6.4× | 2.1 (8), 1.0× | yes |\n"
    assert run.ratio_series(run.markdown_tables(per_lib)) == [
        ("wiki.txt: encode", [("ferrolm", 6.4), ("tiktoken", 1.0)])
    ]
    body = run.render_output(TABLE + '{"json": "for the parent"}\n')
    assert "```\n# comment line\n  progress line\n```" in body
    assert "#### vocab 1,000" in body and "| peer | 1.00 | 2.0× the time | slower |" in body
    assert "for the parent" not in body


def test_build_command_passes_only_options_the_script_has(run):
    b = run.Bench("x", "bench_x.py", "X", quick=[("--runs", "1"), ("--max-mb", "2"), ("--files", None)])
    cmd = run.build_command(b, True, "usage: bench_x.py [-h] [--runs RUNS] [--json JSON]")
    assert cmd[2:] == ["--runs", "1", "--json", str(run.OUT_DIR / "x.json")]
    assert run.build_command(b, False, "usage: [--runs RUNS]")[2:] == []


OK_NOTES = """\
# The OK bench

## Method

How it is measured.

## Latest result

Machine: Test VM (AVX2). Otherwise idle.

| job | compared with | result |
|---|---|---|
| the ok job | a peer | 2.0x |

| details | kept in the write-up |
|---|---|
| a | b |

## Reading

history of an older run
"""
SUMMARY_ROW = "| the ok job | a peer | 2.0x | Test VM (AVX2) | [ok](results/ok.md) |"


def test_summary_is_built_from_the_latest_result_sections(run, capsys):
    (run.RESULTS_DIR / "ok.md").write_text(OK_NOTES)
    (run.RESULTS_DIR / "train.md").write_text(OK_NOTES.replace("the ok job", "training"))
    (run.RESULTS_DIR / "notes.md").write_text("# no latest result here\n")
    assert run.main(["--summary"]) == 0
    text = run.RESULTS.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| job |")]
    # train comes first (RESULTS_ORDER), then the other write-ups by name; only the first table counts
    assert rows == ["| training | a peer | 2.0x | Test VM (AVX2) | [train](results/train.md) |", SUMMARY_ROW]
    assert "## This run" not in text and "kept in the write-up" not in text and "older run" not in text


def test_summary_refuses_long_cells_before_running_anything(run, capsys):
    long_cell = "8.6x at 12:33, 7.6x at 11:50, " * 4
    (run.RESULTS_DIR / "ok.md").write_text(OK_NOTES.replace("| 2.0x |", f"| {long_cell} |"))
    run.BENCHES = [run.Bench("ok", "bench_ok.py", "never run")]
    assert run.main(["--summary"]) == 2 and run.main(["--quick"]) == 2
    assert "benches/results/ok.md: a cell of" in capsys.readouterr().err
    assert not run.RESULTS.exists() and not run.OUT_DIR.exists()
    (run.RESULTS_DIR / "ok.md").write_text(OK_NOTES.replace("Machine: Test VM (AVX2). Otherwise idle.\n", ""))
    assert run.main(["--summary"]) == 2
    assert "needs a 'Machine:' line" in capsys.readouterr().err


def _script(run, name: str, body: str) -> None:
    (run.BENCHES_DIR / name).write_text(textwrap.dedent(body))


def test_main_runs_scripts_and_writes_results(run, capsys):
    _script(
        run,
        "bench_ok.py",
        f"""
        import argparse, json, sys
        ap = argparse.ArgumentParser(); ap.add_argument("--runs"); ap.add_argument("--json")
        a = ap.parse_args()
        assert a.runs == "1", a.runs
        print({TABLE!r})
        print("input " + {str(run.SHARED / "corpora" / "x.txt")!r})
        print("progress", file=sys.stderr)
        json.dump({{"ok": 1}}, open(a.json, "w"))
    """,
    )
    _script(run, "bench_bad.py", 'import sys\nprint("| a | b |")\nsys.exit("boom: it broke")\n')
    pidfile = run.BENCHES_DIR / "grandchild.pid"
    _script(
        run,
        "bench_slow.py",
        f"""
        import argparse, subprocess, sys, time
        argparse.ArgumentParser().parse_args()
        subprocess.Popen([sys.executable, "-c", "import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"])
        time.sleep(60)
    """,
    )
    (run.BENCHES_DIR / "results" / "ok.md").write_text(OK_NOTES)
    run.BENCHES = [
        run.Bench("ok", "bench_ok.py", "The OK bench", quick=[("--runs", "1")], reading="above 1: ferrolm faster"),
        run.Bench("bad", "bench_bad.py", "A failing bench"),
        run.Bench("slow", "bench_slow.py", "A bench that hangs", quick_timeout=6),
        run.Bench("absent", "bench_absent.py", "Not written yet"),
    ]
    rc = run.main(["--quick"])
    assert rc == 1  # one failed, one timed out
    text = run.RESULTS.read_text()
    assert "python benches/run.py --quick" in text
    assert text.index(SUMMARY_ROW) < text.index("## This run") < text.index("| [ok](#ok) | ok |")
    assert "history of an older run" not in text
    assert "**Machine**" in text and "cores" in text and "GiB RAM" in text
    for name in ("ferrolm", "torch", "tiktoken", "tokenizers", "gigatoken", "rustbpe", "transformers"):
        assert f"{name} " in text.split("**Versions**", 1)[1].split("\n", 1)[0]
    assert "| [ok](#ok) | ok |" in text and "**failed** (exit 1)" in text and "**timeout**" in text
    assert "not in this checkout (benches/bench_absent.py)" in text
    assert "| peer | 1.00 | 2.0× the time | slower |" in text
    assert "boom: it broke" in text
    assert "![ok ratios](../docs/bench_ok.png)" in text and "[results/ok.md](results/ok.md)" in text
    assert "input ../shared/corpora/x.txt" in text and str(run.SHARED) not in text
    # the timed-out script's own children were stopped with it
    pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
        except (FileNotFoundError, IndexError):
            state = "gone"
        if state in ("gone", "Z", "X"):
            break
        time.sleep(0.1)
    assert state in ("gone", "Z", "X")
    png = run.DOCS_DIR / "bench_ok.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert (run.OUT_DIR / "ok.json").read_text() == '{"ok": 1}'
    assert "progress" in (run.OUT_DIR / "ok.log").read_text()

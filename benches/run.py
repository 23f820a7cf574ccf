"""Run every side-by-side benchmark in one go and rewrite benches/RESULTS.md and docs/bench_*.png.

    python benches/run.py            # the full benchmarks (long: tens of minutes on 2 cores)
    python benches/run.py --quick    # smaller inputs, one timed run each: under 10 minutes on 2 cores
    python benches/run.py --only train encode --quick
    python benches/run.py --summary  # rewrite RESULTS.md from benches/results/*.md, run nothing

Each benchmark script (benches/bench_*.py) already runs every library in its own process and
checks that they compute the same thing before timing; this runner calls the scripts one
after the other, each as its own process, with the options below (in --quick mode only the
options a script's --help lists are passed, so a script that changes its options still
runs). Their output goes to benches/out/<area>.log (and <area>.json where the script writes
JSON).

RESULTS.md is generated, never edited by hand. It opens with the current figures: one row
per line of the table under "## Latest result" in each benches/results/<area>.md (that file
holds the method and the latest result of its area; history lives in git), with the
machine named on that section's "Machine:" line. A run then adds the machine (CPU model,
cores, RAM, load average), the versions of ferrolm and its peers, the date, the command,
and each script's own tables; every column of ratios in those tables ("1.8x", "vs ferrolm",
"A / B") becomes a bar chart in docs/bench_<area>.png. Ratios, not absolute timings, are
what carry over to other machines; run on a quiet machine (the load average is recorded)
and read differences under ~15 % as noise.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

BENCHES_DIR = Path(__file__).resolve().parent
REPO = BENCHES_DIR.parent
SHARED = Path(os.environ.get("FERROLM_SHARED", REPO.parent / "shared"))
OUT_DIR = BENCHES_DIR / "out"
DOCS_DIR = REPO / "docs"
RESULTS = BENCHES_DIR / "RESULTS.md"
RESULTS_DIR = BENCHES_DIR / "results"
LATEST = "## Latest result"
# The order of the jobs in RESULTS.md: the pipeline's, then any other write-up by name.
RESULTS_ORDER = [
    "train",
    "encode",
    "shards",
    "pretokenize",
    "model",
    "lm_train",
    "generate",
    "sft",
    "reference",
    "demo",
]
MAX_CELL = 80  # characters: a summary cell says one figure; the details stay in results/<area>.md
PEERS = ["ferrolm", "torch", "tiktoken", "tokenizers", "gigatoken", "rustbpe", "transformers", "numpy", "regex"]


@dataclass
class Bench:
    area: str  # benches/results/<area>.md, docs/bench_<area>.png
    script: str  # under benches/
    title: str
    full: list = field(default_factory=list)  # extra arguments of the full run
    quick: list = field(default_factory=list)  # (flag, value, ...) groups for --quick
    json_flag: bool = True  # pass --json benches/out/<area>.json when the script has it
    quick_timeout: float = 600.0  # a guard only: on a quiet 2-core machine each takes a minute or two
    # How to read its ratios, shown under the chart.
    reading: str = ""
    notes: str = ""  # its write-up under benches/results/ (default: <area>.md)
    in_quick: bool = True  # False: only in the full run
    # Extra ratio series from output that has no markdown table: stdout -> [(title, [(label, ratio)])]
    parse: Optional[Callable[[str], list]] = None


def _shared(rel: str) -> Optional[str]:
    p = SHARED / rel
    return str(p) if p.exists() else None


def _train_step_ratios(stdout: str) -> list:
    """benches/train_step_speed.py prints "ARCH threads N  PRECISION  median R tokens/s": ferrolm / nanogpt per setting."""
    rates: dict = {}
    for m in re.finditer(r"^(\S+)\s+threads (\d+)\s+(bf16 autocast|fp32)\s+median\s+([\d.]+) tokens/s", stdout, re.M):
        rates[(m.group(2), m.group(3), m.group(1))] = float(m.group(4))
    points = [
        (
            f"{threads} thread{'s' if threads != '1' else ''}, {prec}",
            rates[(threads, prec, "ferrolm")] / rates[(threads, prec, "nanogpt")],
        )
        for (threads, prec, arch) in rates
        if arch == "ferrolm" and rates.get((threads, prec, "nanogpt"))
    ]
    return [("ferrolm / nanoGPT-style tokens/s", points)] if points else []


BENCHES = [
    Bench(
        "train",
        "bench_train.py",
        "BPE training: ferrolm vs gigatoken, rustbpe, HF tokenizers and the pure-Python reference",
        quick=[
            ("--files", _shared("corpora/webtext/enwiki_2016_wikiextractor.txt")),
            ("--vocab", "10000"),
            ("--runs", "1"),
        ],
        reading="time of each library / time of ferrolm: above 1 means ferrolm is faster",
    ),
    Bench(
        "encode",
        "bench_encode.py",
        "Encoding with the GPT-2 vocabulary: ferrolm vs tiktoken, HF tokenizers, gigatoken",
        quick=[("--quick",)],  # its own quick mode: TinyStories only, fewer runs, no 200 MB stream
        reading="MB/s of each library / tiktoken's MB/s, per mode: above 1 means faster than tiktoken",
    ),
    Bench(
        "encode_paired",
        "bench_encode_paired.py",
        "Encoding, ferrolm vs gigatoken in paired rounds in one process (drift-robust ratios)",
        full=["--rounds", "21"],
        quick=[("--rounds", "5"), ("--files", "tinystories")],
        json_flag=False,
        notes="encode.md",
        reading="ferrolm MB/s / gigatoken MB/s, median of per-round ratios: above 1 means ferrolm is faster",
    ),
    Bench(
        "shards",
        "bench_shards.py",
        "Corpus to uint16 .bin shards: ferrolm encode vs gigatoken files vs tiktoken nanoGPT-style",
        quick=[("--runs", "1")],
        reading="time of each contender / ferrolm's time: above 1 means ferrolm is faster",
    ),
    Bench(
        "pretokenize",
        "bench_pretokenize.py",
        "Pre-tokenization: ferrolm's scanners vs fancy-regex vs Python regex",
        quick=[("--max-mb", "1"), ("--runs", "1")],
        json_flag=False,
        quick_timeout=900,
        reading="scanner speed / the other's speed (by CPU time): above 1 means the scanner is faster; "
        "its first run includes a `cargo build --release` of the Rust example",
    ),
    Bench(
        "model",
        "bench_model.py",
        "Training step: ferrolm TransformerLM vs HF transformers LlamaForCausalLM",
        # fp32 only in quick mode: bf16 autocast is ~12x slower than fp32 on CPUs without AVX-512-BF16/AMX
        quick=[("--shapes", "small"), ("--dtypes", "fp32"), ("--runs", "1"), ("--steps", "1")],
        reading="ferrolm tokens/s / HF tokens/s: above 1 means ferrolm is faster",
    ),
    Bench(
        "train_step",
        "train_step_speed.py",
        "Full optimizer step of the cpu-small model: ferrolm vs a nanoGPT-style GPT of the same shape",
        full=["--preset", "cpu-small", "--threads", "1", "2", "--steps", "5", "--repeats", "3", "--nanogpt"],
        quick=[
            ("--preset", "cpu-small"),
            ("--threads", "2"),
            ("--steps", "2"),
            ("--repeats", "1"),
            ("--fp32-only",),
            ("--nanogpt",),
        ],
        json_flag=False,
        notes="lm_train.md",
        parse=_train_step_ratios,
        reading="ferrolm tokens/s / nanoGPT-style tokens/s: above 1 means ferrolm is faster",
    ),
    Bench(
        "model_ops",
        "bench_model_ops.py",
        "Micro-benchmarks behind ferrolm.lm.model's choices (RoPE, cross-entropy, QKV) vs HF's and torch's",
        json_flag=False,
        notes="model.md",
        in_quick=False,
    ),
    Bench(
        "generate",
        "bench_generate.py",
        "Generation: ferrolm sampler (KV cache, no cache) vs HF generate",
        quick=[("--shapes", "cpu-small"), ("--runs", "1")],
        reading="tokens/s of the row / tokens/s of the column's baseline",
    ),
    Bench(
        "serve",
        "bench_serve.py",
        "Serving: ferrolm serve with 1 and 16 streams, time to first token, one stream vs generate",
        quick=[("--requests", "2"), ("--ttft", "5")],
        json_flag=False,
        reading="16 streams' tokens/s / one stream's; one stream's decode / generate's",
    ),
    Bench(
        "sft",
        "bench_sft.py",
        "Supervised fine-tuning: a cpu-small base model fine-tuned on a generated task, at pretraining's speed",
        json_flag=False,
        in_quick=False,  # its --quick checks the script only (tests/test_bench_sft.py)
        reading="fine-tuning tokens/s / pretraining tokens/s at the same shape",
    ),
    Bench(
        "reference",
        "bench_reference_train.py",
        "The pure-Python reference BPE trainer",
        quick=[("--only", "tinystories"), ("--repeat", "1")],
        json_flag=False,
    ),
]


# ---------------------------------------------------------------------------------------
# Machine and versions
# ---------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "ram_gb": round(ram / 2**30, 1) if ram else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def versions() -> dict:
    from importlib import metadata

    out = {}
    for name in PEERS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ---------------------------------------------------------------------------------------
# Running one script
# ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    bench: Bench
    status: str  # ok, failed, timeout, missing, skipped
    command: list = field(default_factory=list)
    seconds: float = 0.0
    stdout: str = ""
    stderr_tail: str = ""
    returncode: Optional[int] = None
    json_path: Optional[Path] = None
    chart: Optional[Path] = None


def script_help(path: Path) -> str:
    try:
        r = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60)
        return r.stdout + r.stderr
    except (OSError, subprocess.SubprocessError):
        return ""


def build_command(bench: Bench, quick: bool, help_text: str) -> list:
    cmd = [sys.executable, str(BENCHES_DIR / bench.script)]
    if quick:
        for group in bench.quick:  # (flag, value...) or (flag,) for a switch
            flag, *values = group
            if any(v is None for v in values):
                continue  # input not available here: the script's default applies
            if re.search(rf"(^|[\s\[,]){re.escape(flag)}\b", help_text):
                cmd += [flag, *values]
    else:
        cmd += list(bench.full)
    if bench.json_flag and re.search(r"(^|[\s\[,])--json\b", help_text):
        cmd += ["--json", str(OUT_DIR / f"{bench.area}.json")]
    return cmd


def _relative(arg: str) -> str:
    """A path argument as it would be typed from the repository root (no machine paths in RESULTS.md)."""
    if os.path.isabs(arg) and os.path.exists(arg) or arg.startswith((str(REPO), str(SHARED))):
        rel = os.path.relpath(arg, REPO)
        return rel if not rel.startswith("../../") else arg
    return arg


def _sanitize(text: str) -> str:
    """Machine paths in a script's output, written relative to the repository root."""
    return text.replace(str(SHARED), "../shared").replace(str(REPO) + os.sep, "").replace(str(REPO), ".")


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def _pump(stream, sink: list, echo, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        echo.write(prefix + line)
        echo.flush()
    stream.close()


def run_bench(bench: Bench, quick: bool, timeout: Optional[float]) -> Outcome:
    path = BENCHES_DIR / bench.script
    if not path.is_file():
        return Outcome(bench, "missing")
    help_text = script_help(path)
    cmd = build_command(bench, quick, help_text)
    shown = ["python"] + [_relative(c) for c in cmd[1:]]
    print(f"\n=== {bench.area}: {' '.join(shlex.quote(c) for c in shown)}", flush=True)
    json_path = OUT_DIR / f"{bench.area}.json"
    if json_path.exists():
        json_path.unlink()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    # Its own session, so that a timeout stops the script's children too (cargo, worker processes).
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        bufsize=1,
        start_new_session=True,
    )
    out_lines: list = []
    err_lines: list = []
    threads = [
        threading.Thread(target=_pump, args=(proc.stdout, out_lines, sys.stdout, "  "), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, err_lines, sys.stderr, "  "), daemon=True),
    ]
    for t in threads:
        t.start()
    status = "ok"
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        status = "timeout"
    for t in threads:
        t.join(timeout=10)
    seconds = time.perf_counter() - t0
    if status == "ok" and proc.returncode != 0:
        status = "failed"
    stdout, stderr = _sanitize("".join(out_lines)), _sanitize("".join(err_lines))
    (OUT_DIR / f"{bench.area}.log").write_text(
        f"$ {' '.join(shown)}\n# exit {proc.returncode}, {seconds:.1f} s\n\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        encoding="utf-8",
    )
    return Outcome(
        bench,
        status,
        shown,
        seconds,
        stdout,
        "".join(stderr.splitlines(True)[-15:]),
        proc.returncode,
        json_path if json_path.exists() else None,
    )


# ---------------------------------------------------------------------------------------
# Tables, ratios, charts
# ---------------------------------------------------------------------------------------

# A ratio: a number followed by x or × ("1.8x", "**1.23x**", "18.18× the time", "13.4 (61), 6.4×").
_RATIO_ANY = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*[x×](?![A-Za-z0-9])")
# A cell that starts with one.
_RATIO = re.compile(r"^\**\s*([0-9]+(?:\.[0-9]+)?)\s*[x×](?![A-Za-z0-9])")


def markdown_tables(text: str) -> list[dict]:
    """Every markdown table in `text`: {"heading": last heading/comment line before it, "header": [...], "rows": [[...]]}."""
    tables, heading, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*:?-{3,}", lines[i + 1].strip()):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            tables.append({"heading": heading, "header": header, "rows": rows})
            continue
        i += 1
    return tables


def _ratio_in(cell: str) -> Optional[float]:
    found = _RATIO_ANY.findall(cell.replace("*", ""))
    return float(found[-1]) if found else None


def _is_ratio_column(name: str) -> bool:
    """A column whose header says it holds ratios ("vs ferrolm", "scanner / regex", "speed-up")."""
    n = name.lower().replace("*", "").strip()
    return (
        n.startswith("vs")
        or " vs " in n
        or "/" in n
        and "tokens/s" not in n
        and "mb/s" not in n
        or "ratio" in n
        or "speed" in n
    )


def ratio_series(tables: list[dict]) -> list[tuple[str, list[tuple[str, float]]]]:
    """(title, [(label, ratio)]) series for charts, from the ratio cells ("1.8x") of markdown tables.

    A column whose header names a ratio ("vs ferrolm", "A / B") gives one series over the
    rows. Ratios inside other columns (tables with one column per library, a ratio in each
    cell) give one series per row, over those columns.
    """
    series = []
    for t in tables:
        header, rows = t["header"], t["rows"]
        prefix = f"{t['heading'][:60]}: " if t["heading"] else ""

        def label(row, upto):
            cells = [c.replace("*", "") for c in row[:upto] if c and _ratio_in(c) is None and not _is_number(c)]
            return " ".join(cells)[:48]

        by_row: dict = {}
        for j, name in enumerate(header):
            ratio_col = _is_ratio_column(name)
            points = []
            for i, row in enumerate(rows):
                if j >= len(row) or j == 0:
                    continue
                v = _ratio_in(row[j]) if not ratio_col else (float(m.group(1)) if (m := _RATIO.match(row[j])) else None)
                if v is None:
                    continue
                if ratio_col:
                    points.append((label(row, j) or f"row {i + 1}", v))
                else:
                    by_row.setdefault(i, []).append((name.replace("*", ""), v))
            if points:
                series.append((prefix + name.replace("*", ""), points))
        for i, points in by_row.items():
            first = next(j for j, c in enumerate(rows[i]) if j > 0 and _ratio_in(c) is not None)
            series.append((prefix + (label(rows[i], first) or f"row {i + 1}"), points))
    return series


def _is_number(cell: str) -> bool:
    """A measurement, not a label: starts with a number ("1,234", "8.33 M", "300 (310)")."""
    return bool(re.match(r"^[\d.,]+(\s|$|[A-Za-z%(])", cell.replace("*", "").strip()))


def draw_chart(area: str, title: str, series, reading: str) -> Optional[Path]:
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = series[:6]
    heights = [max(1.2, 0.32 * len(points) + 0.9) for _, points in series]
    fig, axes = plt.subplots(
        len(series),
        1,
        figsize=(8.5, sum(heights) + 0.8),
        dpi=110,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (name, points) in zip(axes[:, 0], series):
        labels = [p[0] for p in points]
        values = [p[1] for p in points]
        colors = ["#c0392b" if "ferrolm" in lab.lower() else "#5d6d7e" for lab in labels]
        y = range(len(points))
        ax.barh(list(y), values, color=colors, height=0.6)
        ax.set_yticks(list(y))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(name, fontsize=9, loc="left")
        top = max(values + [1.0])
        for yi, v in zip(y, values):
            ax.text(v + top * 0.01, yi, f"{v:.2f}x" if v < 10 else f"{v:.0f}x", va="center", fontsize=8)
        ax.set_xlim(0, top * 1.15)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title + (f"\n({reading})" if reading else ""), fontsize=10)
    fig.tight_layout()
    DOCS_DIR.mkdir(parents=True, exist_ok=True)
    path = DOCS_DIR / f"bench_{area}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------
# RESULTS.md
# ---------------------------------------------------------------------------------------


def latest_results() -> list[dict]:
    """The "## Latest result" table of every benches/results/*.md, in RESULTS_ORDER.

    Each: {"area", "machine", "header", "rows"}. A cell longer than MAX_CELL, or a section
    without a "Machine:" line or a table, is a ValueError naming the file.
    """
    found = []
    order = {name: i for i, name in enumerate(RESULTS_ORDER)}
    for path in sorted(RESULTS_DIR.glob("*.md"), key=lambda p: (order.get(p.stem, len(order)), p.stem)):
        text = path.read_text(encoding="utf-8")
        if LATEST not in text:
            continue
        section = text.split(LATEST, 1)[1].split("\n## ", 1)[0]
        where = f"benches/results/{path.name}"
        # The machine's name is the first sentence of the "Machine:" line.
        machine = next((ln.split(":", 1)[1] for ln in section.splitlines() if ln.startswith("Machine:")), "")
        machine = machine.strip().split(". ", 1)[0].rstrip(".")
        tables = markdown_tables(section)
        if not machine or not tables:
            raise ValueError(f"{where}: its {LATEST!r} section needs a 'Machine:' line and a table")
        header, rows = tables[0]["header"], tables[0]["rows"]
        for cell in header + [c for row in rows for c in row]:
            if len(cell) > MAX_CELL:
                raise ValueError(f"{where}: a cell of {len(cell)} characters (at most {MAX_CELL}): {cell[:40]}...")
        found.append({"area": path.stem, "machine": machine, "header": header, "rows": rows})
    return found


def summary_lines(latest: list[dict]) -> list[str]:
    """The current figures: one table, a row per job, each with its machine and its write-up."""
    lines = [
        "| job | compared with | result | machine | details |",
        "|---|---|---|---|---|",
    ]
    for entry in latest:
        for row in entry["rows"]:
            cells = (row + ["", "", ""])[:3]
            link = f"[{entry['area']}](results/{entry['area']}.md)"
            lines.append(f"| {' | '.join(cells)} | {entry['machine']} | {link} |")
    return lines


def results_header() -> list[str]:
    return [
        "# Benchmark results",
        "",
        'Generated by `python benches/run.py` from the "Latest result" section of each '
        "[benches/results/](results/) file, which also gives the method and the command. Each "
        "benchmark runs every library in its own process on the same input and checks that they "
        "compute the same thing before timing; ratios, not absolute times, are what carry over to "
        "other machines. Above 1x, ferrolm is faster.",
        "",
    ]


def write_summary(latest: list[dict]) -> Path:
    """RESULTS.md with the current figures only (`--summary`: no benchmark is run)."""
    lines = results_header() + summary_lines(latest)
    RESULTS.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return RESULTS


def render_output(stdout: str) -> str:
    """A script's stdout for RESULTS.md: tables and headings as markdown, other lines verbatim in code blocks."""
    out, block = [], []

    def flush_block():
        if any(b.strip() for b in block):
            out.append("```")
            out.extend(b.rstrip() for b in block)
            out.append("```")
        block.clear()

    for line in stdout.splitlines():
        s = line.strip()
        if s.startswith("{") and s.endswith("}"):
            continue  # a JSON record meant for a parent process
        if s.startswith("|"):
            flush_block()
            out.append(s)
        elif s.startswith("## ") or s.startswith("### "):
            flush_block()
            out += ["", "#### " + s.lstrip("#").strip(), ""]
        elif not s and not block:
            if out and out[-1] != "":
                out.append("")
        else:
            if out and out[-1].startswith("|"):
                out.append("")
            block.append(line)
    flush_block()
    return "\n".join(out).strip()


def write_results(
    outcomes: list[Outcome], args, machine: dict, vers: dict, started: str, total_s: float, latest: list[dict]
) -> Path:
    cmd = (
        "python benches/run.py"
        + (" --quick" if args.quick else "")
        + (f" --only {' '.join(args.only)}" if args.only else "")
    )
    lines = results_header() + summary_lines(latest)
    lines += [
        "",
        "## This run",
        "",
        f"`{cmd}` on {started} ({total_s / 60:.1f} minutes in all)."
        + (
            " **Quick mode**: smaller inputs and one timed run each; the full run is `python benches/run.py`."
            if args.quick
            else ""
        ),
        "",
        "**Machine**: " + f"{machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable), "
        f"{machine['ram_gb']} GiB RAM, {machine['os']}, Python {machine['python']}; "
        f"load average before the run {machine['load_average']} (a busy machine inflates timings).",
        "",
        "**Versions**: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
        "",
    ]
    lines += [
        "| benchmark | status | time | command |",
        "|---|---|---:|---|",
    ]
    for o in outcomes:
        skipped = "not run (--only)" if args.only else "full run only"
        status = {"missing": f"not in this checkout (benches/{o.bench.script})", "skipped": skipped}.get(
            o.status, o.status
        )
        if o.status in ("failed", "timeout"):
            status = f"**{o.status}**" + (f" (exit {o.returncode})" if o.status == "failed" else "")
        cmd_s = f"`{' '.join(shlex.quote(c) for c in o.command)}`" if o.command else ""
        lines.append(
            f"| [{o.bench.area}](#{o.bench.area}) | {status} | {o.seconds:.0f} s | {cmd_s} |"
            if o.command
            else f"| {o.bench.area} | {status} | | |"
        )
    for o in outcomes:
        if o.status in ("missing", "skipped"):
            continue
        lines += ["", f"### {o.bench.area}", "", f"**{o.bench.title}**", ""]
        lines += [f"Command: `{' '.join(shlex.quote(c) for c in o.command)}` ({o.seconds:.0f} s, {o.status})", ""]
        if o.chart is not None:
            rel = os.path.relpath(o.chart, RESULTS.parent)
            lines += [f"![{o.bench.area} ratios]({rel})", ""]
            if o.bench.reading:
                lines += [f"Chart: {o.bench.reading}.", ""]
        body = render_output(o.stdout)
        if body:
            lines += [body, ""]
        if o.status != "ok":
            lines += ["Last lines of its stderr:", "", "```", o.stderr_tail.rstrip(), "```", ""]
        notes = o.bench.notes or f"{o.bench.area}.md"
        if (BENCHES_DIR / "results" / notes).exists():
            lines += [
                f"Method and discussion: [results/{notes}](results/{notes}). Full log: benches/out/{o.bench.area}.log.",
                "",
            ]
    RESULTS.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return RESULTS


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="small inputs, one timed run each (under 10 minutes on 2 cores)"
    )
    ap.add_argument(
        "--only", nargs="+", metavar="AREA", choices=[b.area for b in BENCHES], help="run only these benchmarks"
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds per benchmark before it is stopped (default: per-benchmark limits with --quick, none otherwise)",
    )
    ap.add_argument(
        "--list", action="store_true", help="list the benchmarks and the commands they would run, then exit"
    )
    ap.add_argument(
        "--summary", action="store_true", help="rewrite RESULTS.md from benches/results/*.md only, run nothing"
    )
    args = ap.parse_args(argv)
    if args.list:
        for b in BENCHES:
            path = BENCHES_DIR / b.script
            if args.quick and not b.in_quick:
                print(f"{b.area:12s} (full run only)")
            elif path.is_file():
                print(
                    f"{b.area:12s} python {' '.join(_relative(c) for c in build_command(b, args.quick, script_help(path))[1:])}"
                )
            else:
                print(f"{b.area:12s} (missing: benches/{b.script})")
        return 0
    try:
        latest = latest_results()  # checked first: a bad write-up fails before any benchmark runs
    except ValueError as e:
        print(f"run.py: {e}", file=sys.stderr)
        return 2
    if args.summary:
        print(f"wrote {write_summary(latest)}")
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    vers = versions()
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    print(f"machine: {machine}\nversions: {vers}", flush=True)
    t0 = time.perf_counter()
    outcomes = []
    for b in BENCHES:
        if (args.only and b.area not in args.only) or (args.quick and not b.in_quick and not args.only):
            outcomes.append(Outcome(b, "skipped"))
            continue
        timeout = args.timeout if args.timeout is not None else (b.quick_timeout if args.quick else None)
        o = run_bench(b, args.quick, timeout)
        if o.status == "ok":
            try:
                series = ratio_series(markdown_tables(o.stdout)) + (b.parse(o.stdout) if b.parse else [])
                o.chart = draw_chart(b.area, b.title, series, b.reading)
            except Exception as e:  # a chart must never lose the numbers
                print(f"  (no chart for {b.area}: {e})", file=sys.stderr)
        print(f"=== {b.area}: {o.status} in {o.seconds:.0f} s" + (f", chart {o.chart}" if o.chart else ""), flush=True)
        outcomes.append(o)
    path = write_results(outcomes, args, machine, vers, started, time.perf_counter() - t0, latest)
    print(f"\nwrote {path} in {(time.perf_counter() - t0) / 60:.1f} minutes")
    for o in outcomes:
        print(f"  {o.bench.area:12s} {o.status}")
    return 0 if all(o.status in ("ok", "missing", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())

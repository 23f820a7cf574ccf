"""Pre-tokenizer throughput: ferrolm's scanners vs fancy-regex vs Python's `regex`.

    python benches/bench_pretokenize.py [--max-mb 4] [--runs 3] [FILE ...]

Default files: the web text, TinyStories, zh, ru and code corpora under ../shared/corpora. Each file
is cut to its first N MiB (just after a newline). The Rust side (scanners and
fancy-regex, one thread, each piece counted) runs as the example binary
benches/rust/bench_pretokenize.rs, built here with `cargo build --release`; Python's
`regex.findall` runs in its own subprocess per file and pattern. Before timing, the
scanner's pieces are checked equal to fancy-regex's (in Rust) and their number equal to
`regex.findall`'s. Reports medians of the runs, as wall-clock and as CPU time of the
measuring thread (on a busy machine the CPU figures are the steadier ones), and the
ratios by CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("FERROLM_SHARED", REPO.parent / "shared"))
DEFAULT_FILES = [
    "corpora/webtext/enwiki_2021_wikiextractor_part01.txt",
    "corpora/tinystories/TinyStories-v1-train_head_2MiB.txt",
    "corpora/multilingual/zh_classic_novels_hongloumeng_xiyouji.txt",
    "corpora/multilingual/ru_TinyStories-ru.txt",
    "corpora/multilingual/code_python311_stdlib.txt",
]
PATTERNS = ["gpt2", "cl100k", "o200k"]

# Runs in a child process: time regex.findall on the cut text.
PY_CHILD = r"""
import importlib.util, json, sys, time, regex
spec = importlib.util.spec_from_file_location("patterns", sys.argv[1])
patterns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patterns)  # ferrolm/patterns.py alone: no compiled core needed
path, max_mb, name, runs = sys.argv[2], float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
data = open(path, "rb").read()
if max_mb > 0:
    n = min(int(max_mb * 1048576), len(data))
    nl = data.find(b"\n", n)
    data = data if nl < 0 else data[: nl + 1]
text = data.decode("utf-8", errors="replace")
pat = regex.compile(patterns.NAMED[name])
pieces = len(pat.findall(text))
wall, cpu = [], []
for _ in range(runs):
    t, c = time.perf_counter(), time.thread_time()
    pat.findall(text)
    wall.append(len(data) / (time.perf_counter() - t) / 1e6)
    cpu.append(len(data) / (time.thread_time() - c) / 1e6)
rss = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"pieces": pieces, "wall": sorted(wall)[len(wall) // 2], "cpu": sorted(cpu)[len(cpu) // 2], "vmhwm_kb": int(rss)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--max-mb", type=float, default=4.0, help="cut each file to its first N MiB (0: whole file)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-build", action="store_true", help="use the already built example binary")
    args = ap.parse_args()
    files = args.files or [SHARED / f for f in DEFAULT_FILES]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        sys.exit(f"missing input files: {missing} (set FERROLM_SHARED to the shared/ folder)")

    if not args.no_build:
        subprocess.run(
            ["cargo", "build", "--release", "--quiet", "--example", "bench_pretokenize"], cwd=REPO, check=True
        )
    binary = REPO / "target" / "release" / "examples" / "bench_pretokenize"
    # The scanner passes take milliseconds: many runs for it (fancy-regex takes 3).
    cmd = [str(binary), "--json", "--runs", str(max(args.runs, 15))]
    if args.max_mb > 0:
        cmd += ["--max-mb", str(args.max_mb)]
    rust = json.loads(subprocess.run(cmd + [str(f) for f in files], check=True, capture_output=True, text=True).stdout)

    rows = []
    for f in files:
        for name in PATTERNS:
            r = next(x for x in rust if x["file"] == f.name and x["pattern"] == name)
            out = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    PY_CHILD,
                    str(REPO / "python" / "ferrolm" / "patterns.py"),
                    str(f),
                    str(args.max_mb),
                    name,
                    str(args.runs),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            py = json.loads(out)
            if py["pieces"] != r["pieces"] or not r["same_as_fancy_regex"]:
                sys.exit(
                    f"piece counts differ on {f.name}/{name}: scanner {r['pieces']}, regex {py['pieces']}, "
                    f"same as fancy-regex: {r['same_as_fancy_regex']}"
                )
            rows.append((f.name, r["bytes"], name, r, py))

    print(f"# pre-tokenizer throughput, {time.strftime('%Y-%m-%d')}, MB = 10^6 bytes, one thread")
    print(f"# {' '.join(sys.argv)}; Python regex {__import__('regex').__version__}")
    print("MB/s: median wall-clock (median thread CPU time), scanner also [best run wall-clock]; ratios by CPU time\n")
    print(
        "| file | MB | pattern | pieces | ferrolm scanner | fancy-regex | Python regex | scanner / fancy-regex | scanner / regex |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for fname, nbytes, name, r, py in rows:
        print(
            f"| {fname} | {nbytes / 1e6:.1f} | {name} | {r['pieces']} "
            f"| {r['scanner_mbs']:.0f} ({r['scanner_cpu_mbs']:.0f}) [{r['scanner_best_mbs']:.0f}] "
            f"| {r['fancy_regex_mbs']:.1f} ({r['fancy_regex_cpu_mbs']:.1f}) "
            f"| {py['wall']:.1f} ({py['cpu']:.1f}) "
            f"| {r['scanner_cpu_mbs'] / r['fancy_regex_cpu_mbs']:.0f}x | {r['scanner_cpu_mbs'] / py['cpu']:.0f}x |"
        )


if __name__ == "__main__":
    main()

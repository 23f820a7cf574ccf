"""Training time of the pure-Python reference BPE (ferrolm.bpe.reference.train_bpe).

Each run is its own child process; the child reports its wall time (split into counting
pre-tokens and the merge loop) and its own peak RSS (VmHWM). Median of --repeat runs.

    python benches/bench_reference_train.py                 # all three configurations
    python benches/bench_reference_train.py --only webtext --repeat 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"

CONFIGS = {
    "corpus.en": (["fixtures/corpus.en"], 500),
    "tinystories": (["corpora/tinystories/TinyStories-v1-train_head_2MiB.txt"], 10_000),
    "webtext": (
        [
            "corpora/webtext/enwiki_2016_wikiextractor.txt",
            "corpora/webtext/enwiki_2021_wikiextractor_part01.txt",
            "corpora/webtext/enwiki_2021_wikiextractor_part02.txt",
            "corpora/webtext/enwikinews_wikiextractor.txt",
        ],
        32_000,
    ),
}

CHILD = r"""
import json, sys, time, gc
from ferrolm.bpe import reference
paths, vocab_size = json.loads(sys.argv[1])
specials = ["<|endoftext|>"]
gc.disable()
# train_bpe(paths, vocab_size, specials) is these two phases plus building the vocab dict.
t0, c0 = time.perf_counter(), time.process_time()
counts = reference.count_pretokens(paths, specials)
t1 = time.perf_counter()
merges = reference._merge_loop(counts, vocab_size - 256 - len(specials))
t2, c2 = time.perf_counter(), time.process_time()
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"count_s": t1 - t0, "merge_s": t2 - t1, "total_s": t2 - t0, "cpu_s": c2 - c0, "merges": len(merges), "unique_pretokens": len(counts), "peak_rss_mb": hwm / 1024}))
"""


def run_child(paths: list[str], vocab_size: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([paths, vocab_size])], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {open('/proc/loadavg').read().split()[:3]}")
    for name in args.only or list(CONFIGS):
        rel, vocab_size = CONFIGS[name]
        paths = [str(SHARED / r) for r in rel]
        missing = [p for p in paths if not Path(p).exists()]
        if missing:
            print(f"{name}: skipped, missing {missing}")
            continue
        size_mb = sum(Path(p).stat().st_size for p in paths) / 1e6
        runs = [run_child(paths, vocab_size) for _ in range(args.repeat)]
        med = {
            k: statistics.median(r[k] for r in runs) for k in ("count_s", "merge_s", "total_s", "cpu_s", "peak_rss_mb")
        }
        print(
            f"{name:12s} {size_mb:6.1f} MB vocab {vocab_size:6d}: total {med['total_s']:7.2f} s wall, {med['cpu_s']:.2f} s CPU "
            f"(count {med['count_s']:.2f} s, merges {med['merge_s']:.2f} s; {runs[0]['merges']} merges, "
            f"{runs[0]['unique_pretokens']} unique pre-tokens), peak RSS {med['peak_rss_mb']:.0f} MB, "
            f"median of {len(runs)}: {[round(r['total_s'], 2) for r in runs]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

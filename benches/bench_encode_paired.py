"""ferrolm vs gigatoken encode speed as paired rounds in one process.

    python benches/bench_encode_paired.py                  # both files, 15 rounds
    python benches/bench_encode_paired.py --rounds 31 --files wiki

bench_encode.py runs each library in its own process, one after the other; on a VM whose
speed drifts by tens of percent within minutes, two such measurements taken a minute apart
can disagree by more than the difference being measured. Here both libraries are loaded in
one process and each round times one call of each, back to back, in alternating order; the
ratio is taken per round (ferrolm MB/s / gigatoken MB/s), so drift slower than a round
cancels. Reported per mode: the median MB/s of each, the median per-round ratio, its range,
and the share of rounds ferrolm was at least as fast. Ids are checked equal first.

Modes as in bench_encode.py, with ferrolm's numpy-returning calls (gigatoken's also return
arrays): encode (one call per document, one thread), batch-1 / batch-2, file (whole file,
all cores; ferrolm's encode_file, gigatoken's encode_files).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_encode import TINY, WIKI, ids_hash, load, runner, split_docs  # noqa: E402

MODES = ["encode", "batch-1", "batch-2", "file"]
FILES = {"wiki": WIKI, "tinystories": TINY}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--files", nargs="+", default=list(FILES), choices=list(FILES))
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    args = ap.parse_args()
    for name in args.files:
        if not FILES[name].exists():
            raise SystemExit(f"missing corpus file {FILES[name]} (see ../shared/corpora/SOURCES.md)")

    try:
        import gigatoken  # noqa: F401
    except ImportError:
        raise SystemExit("gigatoken is not installed: pip install gigatoken (a bench extra)") from None
    ferro, giga = load("ferrolm-np", 2), load("gigatoken", 2)
    print(f"# ferrolm vs gigatoken, paired rounds in one process ({args.rounds} rounds per mode)\n")
    print(
        "| file | mode | ferrolm MB/s | gigatoken MB/s | ratio, median of rounds | range | rounds ferrolm >= gigatoken |"
    )
    print("|---|---|---:|---:|---:|---|---:|")
    for name in args.files:
        path = FILES[name]
        text = path.read_text(encoding="utf-8")
        docs = split_docs(text)
        mb = len(text.encode("utf-8")) / 1e6
        for mode in args.modes:
            # encode_file has one form (it returns an array); the others use the numpy calls.
            f = runner("ferrolm" if mode == "file" else "ferrolm-np", mode, ferro, path, text, docs)
            g = runner("gigatoken", mode, giga, path, text, docs)
            if ids_hash(f()) != ids_hash(g()):  # also the warm-up of both
                raise SystemExit(f"ids differ: {name} {mode}")
            fs, gs = [], []
            gc.disable()
            for r in range(args.rounds):
                if r % 2 == 0:
                    fs.append(timed(f))
                    gs.append(timed(g))
                else:
                    gs.append(timed(g))
                    fs.append(timed(f))
            gc.enable()
            ratios = [gt / ft for ft, gt in zip(fs, gs)]
            wins = sum(x >= 1 for x in ratios)
            print(
                f"| {name} | {mode} | {mb / statistics.median(fs):.0f} | {mb / statistics.median(gs):.0f} "
                f"| **{statistics.median(ratios):.2f}x** | {min(ratios):.2f}-{max(ratios):.2f} | {wins}/{len(ratios)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

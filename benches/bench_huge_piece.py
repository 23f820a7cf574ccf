"""Encode time of one huge pre-token (GPT-2 vocab, one thread): a cost that grows faster
than the text shows here as a ratio above 4 between sizes.

    python benches/bench_huge_piece.py                 # 1, 4 and 16 MB
    python benches/bench_huge_piece.py --sizes 1 4     # MB

Texts: "a" * n (one letter piece), "1" * n (digits: the gpt2 pattern keeps them as one
piece), and pseudo-random lower-case letters (one piece, many distinct pairs). Times are
the best of --reps runs of `Tokenizer.encode_to_numpy(text, num_threads=1)`, each with a
fresh tokenizer so that no run finds the piece already cached, in CPU seconds of the
process (steadier than wall time on a shared machine; the encode runs on one thread).
Build the core with `maturin build --release` before timing.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
SHARED = Path(os.environ.get("FERROLM_SHARED", REPO.parent / "shared"))
FIXTURES = SHARED / "fixtures"


def texts(n: int) -> dict[str, str]:
    rng = random.Random(0)
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
    return {"a": "a" * n, "1": "1" * n, "letters": letters}


def seconds(make, text: str, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        tok = make()
        t0 = time.process_time()
        tok.encode_to_numpy(text, num_threads=1)
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16], help="sizes in MB")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    from ferrolm.bpe.tokenizer import Tokenizer

    def make():
        return Tokenizer.from_files(FIXTURES / "gpt2_vocab.json", FIXTURES / "gpt2_merges.txt", ["<|endoftext|>"])

    rows: dict[str, list[float]] = {}
    for mb in args.sizes:
        for name, text in texts(mb * 1_000_000).items():
            rows.setdefault(name, []).append(seconds(make, text, args.reps))
    print("| text | " + " | ".join(f"{mb} MB" for mb in args.sizes) + " | last / first per MB |")
    print("|---|" + "---|" * (len(args.sizes) + 1))
    for name, secs in rows.items():
        growth = (secs[-1] / args.sizes[-1]) / (secs[0] / args.sizes[0])
        print(f"| {name} | " + " | ".join(f"{s:.3f} s" for s in secs) + f" | {growth:.2f} |")


if __name__ == "__main__":
    main()

"""Exactness on the large shared corpora: the checks too slow, or too hungry for data, for
the test suite (which runs on text every machine has: tests/texts.py).

For every ``.txt`` file under ``$FERROLM_SHARED/corpora`` (default ``../shared/corpora``):

- encode: ferrolm's GPT-2 ids = tiktoken's, on the whole file, streamed line by line
  (``encode_iterable``) and read by the core in parallel (``encode_file``);
- pretokenize: the Rust scanners' pieces = the reference regex's (``regex.findall`` with the
  core's classes) for gpt2, cl100k and o200k, over the whole file in 1 MiB slices cut after
  newlines;
- train: the Rust trainer's merges and vocab = the pure-Python reference trainer's on the
  first ``--train-mb`` MB of the file at ``--vocab-size`` (0 MB skips it: minutes per file).

    python benches/check_corpora.py                       # every file, every check
    python benches/check_corpora.py --only enwiki --checks encode
    python benches/check_corpora.py --train-mb 3 --vocab-size 10000

Exit status 1 at the first difference, naming the file, the check and the first position
that differs; 2 when there are no corpora. GPT-2's files come from tests/fixtures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("FERROLM_SHARED", REPO.parent / "shared"))
FIXTURES = REPO / "tests" / "fixtures"
EOT = "<|endoftext|>"
CHECKS = ("encode", "pretokenize", "train")


def first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def fail(path: Path, check: str, what: str, got, want) -> None:
    i = first_difference(got, want)
    print(f"DIFFERS {path.name} {check} ({what}): at {i}: {got[i : i + 5]!r} != {want[i : i + 5]!r}")
    sys.exit(1)


def slices(text: str, size: int):
    start = 0
    while start < len(text):
        end = text.find("\n", min(start + size, len(text)))
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def check_encode(path: Path, text: str, tok, peer) -> None:
    import numpy as np

    want = peer.encode(text, allowed_special="all")
    got = tok.encode(text)
    if got != want:
        fail(path, "encode", "whole text", got, want)
    with open(path, encoding="utf-8", newline="") as f:
        got = list(tok.encode_iterable(f))
    if got != want:
        fail(path, "encode", "encode_iterable over lines", got, want)
    got = tok.encode_file(path, dtype=np.uint32).tolist()
    if got != want:
        fail(path, "encode", "encode_file", got, want)


def check_pretokenize(path: Path, text: str) -> None:
    from ferrolm import _core
    from ferrolm.bpe import reference

    for name in ("gpt2", "cl100k", "o200k"):
        split = reference._compile_pattern(name)[1]
        for part in slices(text, 1 << 20):
            got, want = _core.pretokenize(part, name), split(part)
            if got != want:
                fail(path, "pretokenize", name, got, want)


def check_train(path: Path, text: str, megabytes: float, vocab_size: int) -> None:
    from ferrolm.bpe import reference, trainer

    data = text.encode("utf-8")
    limit = int(megabytes * 1e6)
    if len(data) > limit:
        data = data[: data.rfind(b"\n", 0, limit) + 1]
    with tempfile.TemporaryDirectory() as d:
        head = Path(d) / path.name
        head.write_bytes(data)
        got = trainer.train(head, vocab_size, [EOT], progress=False)
        want = reference.train_bpe(head, vocab_size, [EOT])
    if got[1] != want[1]:
        fail(path, "train", "merges", got[1], want[1])
    if got[0] != want[0]:
        fail(path, "train", "vocab", sorted(got[0].items()), sorted(want[0].items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpora", type=Path, default=SHARED / "corpora", help="folder of .txt corpora")
    ap.add_argument("--only", default="", help="only files whose name contains this")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    ap.add_argument("--train-mb", type=float, default=1.0, help="MB of each file the trainers compare on")
    ap.add_argument("--vocab-size", type=int, default=5_000)
    args = ap.parse_args(argv)
    checks = [c for c in args.checks.split(",") if c]
    unknown = set(checks) - set(CHECKS)
    if unknown:
        ap.error(f"unknown checks: {', '.join(sorted(unknown))} (choose from {', '.join(CHECKS)})")
    files = [p for p in sorted(args.corpora.rglob("*.txt")) if args.only in p.name]
    if not files:
        print(f"no corpora under {args.corpora} (set FERROLM_SHARED, or --corpora DIR)", file=sys.stderr)
        return 2

    from ferrolm import Tokenizer
    from ferrolm.bpe import patterns

    tok = peer = None
    if "encode" in checks:
        import tiktoken

        tok = Tokenizer.from_files(FIXTURES / "gpt2_vocab.json", FIXTURES / "gpt2_merges.txt", [EOT])
        ranks = {b: i for i, b in tok.vocab.items() if i != tok.eos_id}
        peer = tiktoken.Encoding(
            "gpt2-offline", pat_str=patterns.GPT2, mergeable_ranks=ranks, special_tokens={EOT: tok.eos_id}
        )
    for path in files:
        text = path.read_bytes().decode("utf-8")
        for check in checks:
            t0 = time.perf_counter()
            if check == "encode":
                check_encode(path, text, tok, peer)
            elif check == "pretokenize":
                check_pretokenize(path, text)
            elif args.train_mb > 0:
                check_train(path, text, args.train_mb, args.vocab_size)
            else:
                continue
            print(f"equal   {path.name} {check} ({len(text.encode()) / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

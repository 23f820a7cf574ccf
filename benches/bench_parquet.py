"""Parquet vs plain text into the same shard, side by side: `ferrolm.bpe.shards.encode` on
the same documents stored both ways, each run in its own process.

    python benches/bench_parquet.py                 # 74 MB webtext, 5 timed runs each
    python benches/bench_parquet.py --runs 9 --threads 2

Input: the documents of all of ../shared/corpora/webtext (split at <|endoftext|>), written
once under --work as a text file (documents separated by <|endoftext|>) and as a Parquet file
(pyarrow's defaults: snappy, one `text` column, row groups of --row-group rows). The GPT-2
vocabulary from ../shared/fixtures. Both write the same .bin (checked by sha256 before
timing). MB/s counts the documents' UTF-8 bytes, the same for both, so the ratio of the rates
is the ratio of the times. Runs alternate between the two; the ratio is reported from the
medians and as the median of per-run ratios.

The core reads the Parquet file itself (no pyarrow in the child processes); each child loads
the tokenizer before its clock starts, so the rates compare reading and encoding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("FERROLM_SHARED", REPO.parent / "shared"))
EOT = "<|endoftext|>"


def child(args) -> None:
    from ferrolm.bpe import shards
    from ferrolm.bpe.tokenizer import Tokenizer

    tok = Tokenizer.load(args.tokdir)
    t = time.perf_counter()
    shards.encode(tok, args.input, args.out, threads=args.threads, progress=False)
    print(json.dumps({"seconds": time.perf_counter() - t}))


def build(work: Path, row_group: int) -> tuple[Path, Path, Path, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ferrolm.bpe.files import read_merges, read_vocab
    from ferrolm.bpe.tokenizer import Tokenizer

    work.mkdir(parents=True, exist_ok=True)
    docs = []
    for f in sorted((SHARED / "corpora" / "webtext").glob("*.txt")):
        docs.extend(d for d in f.read_text(encoding="utf-8").split(EOT) if d.strip())
    text, parquet, tokdir = work / "docs.txt", work / "docs.parquet", work / "gpt2"
    text.write_text(EOT.join(docs) + EOT, encoding="utf-8")
    pq.write_table(pa.table({"text": docs}), parquet, row_group_size=row_group)
    vocab = read_vocab(SHARED / "fixtures" / "gpt2_vocab.json", [EOT])
    merges = read_merges(SHARED / "fixtures" / "gpt2_merges.txt")
    Tokenizer(vocab, merges, [EOT]).save(tokdir)
    return text, parquet, tokdir, sum(len(d.encode("utf-8")) for d in docs)


def run(inp: Path, out: Path, tokdir: Path, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    cmd = [sys.executable, __file__, "--child", "--input", str(inp), "--out", str(out), "--tokdir", str(tokdir)]
    cmd += ["--threads", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--input")
    ap.add_argument("--out")
    ap.add_argument("--tokdir")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--row-group", type=int, default=10_000, help="rows per Parquet row group")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ferrolm-bench-parquet")
    args = ap.parse_args()
    if args.child:
        return child(args)
    text, parquet, tokdir, nbytes = build(args.work, args.row_group)
    outs = {"text": args.work / "out_text", "parquet": args.work / "out_parquet"}
    for name, inp in (("text", text), ("parquet", parquet)):
        run(inp, outs[name], tokdir, args.threads)  # warm-up
    digests = {n: hashlib.sha256(Path(f"{o}.bin").read_bytes()).hexdigest() for n, o in outs.items()}
    assert digests["text"] == digests["parquet"], "the two shards differ"
    times: dict[str, list[float]] = {"text": [], "parquet": []}
    for _ in range(args.runs):
        for name, inp in (("text", text), ("parquet", parquet)):
            times[name].append(run(inp, outs[name], tokdir, args.threads)["seconds"])
    med = {n: statistics.median(t) for n, t in times.items()}
    per_run = statistics.median(t / p for t, p in zip(times["text"], times["parquet"]))
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; {args.threads} threads; {args.runs} runs each")
    print(f"documents: {nbytes / 1e6:.1f} MB of text; parquet file {parquet.stat().st_size / 1e6:.1f} MB")
    for n in ("text", "parquet"):
        print(
            f"{n:8s} median {med[n]:.3f} s  {nbytes / 1e6 / med[n]:7.1f} MB/s  runs {[round(t, 3) for t in times[n]]}"
        )
    print(
        f"parquet / text MB/s: {med['text'] / med['parquet']:.2f} (medians), {per_run:.2f} (median of per-run ratios)"
    )


if __name__ == "__main__":
    main()

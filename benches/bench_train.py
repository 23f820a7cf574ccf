"""Side-by-side BPE training benchmark: ferrolm vs gigatoken, rustbpe, HF tokenizers and
ferrolm.bpe.reference, each run in its own subprocess.

    python benches/bench_train.py                       # webtext at 32,000 and 10,000, 2 threads
    python benches/bench_train.py --skip-reference --runs 3 --concat 4

For every (vocab size, library): `--runs` fresh child processes; each loads its library,
trains once and reports its wall time (the training call only) and its own peak RSS
(VmHWM from /proc/self/status). The table gives the median time, the largest peak RSS and
the ratio to ferrolm, and the CPU time of the training call (all threads, user + system;
on a busy machine it is steadier than wall time).
The reference runs once by default (`--reference-runs N` for more), each time right
after a ferrolm run of its own, and the ratio of each such back-to-back pair is printed
as well: on a VM whose speed drifts over minutes it is steadier than the ratio of the
medians. Before timing, ferrolm's merges are checked equal to the
reference's (when the reference runs) and the share of each peer's first merges that
agree with ferrolm's is printed (peers break ties differently, so some differ).

Peers and how they are called:
  gigatoken.train_bpe(TextFileSource(files, separator=b"<|endoftext|>"), V, ["<|endoftext|>"])
  rustbpe.Tokenizer().train_from_iterator(iter(docs), V - 1, pattern=GPT2)   (no special tokens)
  HF tokenizers: BPE + ByteLevel(add_prefix_space=False), BpeTrainer(initial_alphabet=ByteLevel.alphabet()),
                 train_from_iterator(docs)
  ferrolm.bpe.reference.train_bpe(files, V, ["<|endoftext|>"])
rustbpe and HF read the corpus into a Python list of documents (split at <|endoftext|>)
first; that load is not timed, but its memory is in their peak RSS.
"""

from __future__ import annotations

import argparse
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
GPT2 = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LIBS = ["ferrolm", "gigatoken", "rustbpe", "hf", "reference"]


# ----------------------------------------------------------------------------------------
# Child: train once, print one JSON line
# ----------------------------------------------------------------------------------------


def vmhwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def load_docs(files: list[str]) -> list[str]:
    docs: list[str] = []
    for f in files:
        docs.extend(d for d in Path(f).read_text(encoding="utf-8").split(EOT) if d)
    return docs


def child(lib: str, files: list[str], vocab_size: int, threads: int) -> dict:
    out: dict = {"lib": lib}
    if lib == "ferrolm":
        from ferrolm.bpe.trainer import train

        stats: dict = {}
        t, c = time.perf_counter(), time.process_time()
        _, merges = train(files, vocab_size, [EOT], num_threads=threads, progress=False, stats=stats)
        out["seconds"], out["cpu_s"] = time.perf_counter() - t, time.process_time() - c
        out["stats"] = stats
    elif lib == "gigatoken":
        import gigatoken

        t, c = time.perf_counter(), time.process_time()
        _, merges = gigatoken.train_bpe(gigatoken.TextFileSource(files, separator=EOT.encode()), vocab_size, [EOT])
        out["seconds"], out["cpu_s"] = time.perf_counter() - t, time.process_time() - c
    elif lib == "rustbpe":
        import rustbpe

        docs = load_docs(files)
        tok = rustbpe.Tokenizer()
        t, c = time.perf_counter(), time.process_time()
        tok.train_from_iterator(iter(docs), vocab_size - 1, pattern=GPT2)
        out["seconds"], out["cpu_s"] = time.perf_counter() - t, time.process_time() - c
        ranks = tok.get_mergeable_ranks()
        by_rank = sorted(((r, bytes(b)) for b, r in ranks), key=lambda x: x[0])
        merges = [(b"", tok_bytes) for _, tok_bytes in by_rank[256:]]  # pairs unknown; compare merged tokens
    elif lib == "hf":
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        docs = load_docs(files)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        t, c = time.perf_counter(), time.process_time()
        tok.train_from_iterator(docs, trainer)
        out["seconds"], out["cpu_s"] = time.perf_counter() - t, time.process_time() - c
        from ferrolm.bpe.fileformat import str_to_token

        hf_merges = json.loads(tok.to_str())["model"]["merges"]
        merges = []
        for m in hf_merges:
            a, b = m.split(" ") if isinstance(m, str) else m
            merges.append((str_to_token(a), str_to_token(b)))
    elif lib == "reference":
        from ferrolm.bpe import reference

        t, c = time.perf_counter(), time.process_time()
        _, merges = reference.train_bpe(files, vocab_size, [EOT])
        out["seconds"], out["cpu_s"] = time.perf_counter() - t, time.process_time() - c
    else:
        raise SystemExit(f"unknown library {lib}")
    out["vmhwm_mb"] = vmhwm_mb()
    out["merged_tokens"] = [(a + b).hex() for a, b in merges]
    return out


# ----------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------


def run_child(lib: str, files: list[str], vocab_size: int, threads: int, timeout: float) -> dict:
    env = dict(os.environ)
    # Every rayon-based library gets the same number of threads.
    env.update(RAYON_NUM_THREADS=str(threads), RAYON_RS_NUM_CPUS=str(threads), TOKENIZERS_PARALLELISM="true")
    cmd = [
        sys.executable,
        __file__,
        "--child",
        lib,
        "--vocab",
        str(vocab_size),
        "--threads",
        str(threads),
        "--files",
        *files,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{lib} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def agreement(a: list[str], b: list[str], n: int = 1000) -> float:
    """Share of the first n merged tokens of a that are among the first n of b."""
    sa, sb = a[:n], set(b[:n])
    return sum(t in sb for t in sa) / max(1, len(sa))


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("ferrolm", "gigatoken", "rustbpe", "tokenizers"):
        try:
            from importlib.metadata import version

            out[mod] = version(mod)
        except Exception:
            out[mod] = "?"
    return out


def fmt_stats(s: dict) -> str:
    return (
        f"read {s['read_s']:.2f} s, pre-tokenize+count {s['count_s']:.2f} s, merge tables {s['merge_tables_s']:.2f} s, "
        f"build words+pairs {s['build_s']:.2f} s, merge loop {s['merge_s']:.2f} s "
        f"({s['bytes'] / 1e6:.0f} MB, {s['unique_pretokens']:,} unique pre-tokens, {s['merges']:,} merges)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--files", nargs="*", help="corpus files (default: all of ../shared/corpora/webtext)")
    ap.add_argument("--vocab", type=int, nargs="*", default=[32_000, 10_000])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--libs", nargs="*", default=LIBS, choices=LIBS)
    ap.add_argument("--skip-reference", action="store_true", help="do not run ferrolm.bpe.reference (minutes)")
    ap.add_argument(
        "--reference-runs",
        type=int,
        default=1,
        help="runs of the reference, each right after a ferrolm run of its own: the ratio of each such pair is "
        "reported too (the VM's speed drifts over minutes, which a pair taken back to back mostly cancels)",
    )
    ap.add_argument(
        "--concat",
        type=int,
        default=0,
        help="also train on the corpus concatenated N times (a file in the temporary directory)",
    )
    ap.add_argument("--concat-libs", nargs="*", default=["ferrolm", "gigatoken"], choices=LIBS)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", help="write all results to this file")
    args = ap.parse_args()

    if args.child:
        print(json.dumps(child(args.child, args.files, args.vocab[0], args.threads)))
        return

    files = args.files or [str(p) for p in sorted((SHARED / "corpora" / "webtext").glob("*.txt"))]
    if not files:
        raise SystemExit(f"no corpus files (looked in {SHARED / 'corpora' / 'webtext'})")
    libs = [l for l in args.libs if not (l == "reference" and args.skip_reference)]
    total_mb = sum(os.path.getsize(f) for f in files) / 1e6
    print(f"# BPE training: {len(files)} files, {total_mb:.1f} MB, {args.threads} threads, median of {args.runs} runs")
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {versions()}"
    )
    for f in files:  # warm the page cache
        Path(f).read_bytes()

    results: dict = {}
    for vocab_size in args.vocab:
        rows = []
        ferro_tokens = None
        paired: list[float] = []  # reference time / the ferrolm run just before it
        for lib in libs:
            if lib == "reference":
                outs = []
                for _ in range(max(1, args.reference_runs)):
                    before = run_child("ferrolm", files, vocab_size, args.threads, args.timeout)
                    outs.append(run_child(lib, files, vocab_size, args.threads, args.timeout))
                    paired.append(outs[-1]["seconds"] / before["seconds"])
            else:
                outs = [run_child(lib, files, vocab_size, args.threads, args.timeout) for _ in range(args.runs)]
            secs = statistics.median(o["seconds"] for o in outs)
            cpu = statistics.median(o["cpu_s"] for o in outs)
            rss = max(o["vmhwm_mb"] for o in outs)
            tokens = outs[0]["merged_tokens"]
            if lib == "ferrolm":
                ferro_tokens = tokens
                assert all(o["merged_tokens"] == tokens for o in outs), "ferrolm is not deterministic"
            note = ""
            if lib == "reference" and ferro_tokens is not None:
                same = tokens == ferro_tokens
                note = "merges identical to ferrolm" if same else "MERGES DIFFER FROM FERROLM"
                if not same:
                    print("ERROR: ferrolm and the reference disagree", file=sys.stderr)
            elif lib != "ferrolm" and ferro_tokens is not None:
                note = f"{agreement(tokens, ferro_tokens):.0%} of first 1000 merged tokens shared with ferrolm"
            rows.append((lib, secs, rss, len(tokens), note, outs, cpu))
            print(f"  {vocab_size:>6} {lib:<10} {secs:8.2f} s  cpu {cpu:8.2f} s  {rss:7.0f} MB  {note}", flush=True)
        base = next(r[1] for r in rows if r[0] == "ferrolm") if any(r[0] == "ferrolm" for r in rows) else None
        print(f"\n## vocab {vocab_size:,}\n")
        base_cpu = next(r[6] for r in rows if r[0] == "ferrolm") if base else None
        print("| library | time (s) | vs ferrolm | CPU time (s) | vs ferrolm | peak RSS (MB) | merges | note |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for lib, secs, rss, n, note, outs, cpu in rows:
            ratio = f"{secs / base:.1f}×" if base else ""
            cratio = f"{cpu / base_cpu:.1f}×" if base_cpu else ""
            print(f"| {lib} | {secs:.2f} | {ratio} | {cpu:.2f} | {cratio} | {rss:.0f} | {n:,} | {note} |")
        if paired:
            ps = sorted(paired)
            print(
                f"\nreference / ferrolm, each reference run against the ferrolm run just before it: "
                f"{ps[0]:.1f}-{ps[-1]:.1f}×, median {statistics.median(ps):.1f}× ({len(ps)} pairs)"
            )
        for lib, secs, rss, n, note, outs, cpu in rows:
            if lib == "ferrolm":
                med = sorted(outs, key=lambda o: o["seconds"])[len(outs) // 2]
                print(f"\nferrolm stages (median run): {fmt_stats(med['stats'])}")
                print(
                    f"ferrolm throughput (pre-tokenize+count): {med['stats']['bytes'] / 1e6 / max(1e-9, med['stats']['count_s']):.0f} MB/s"
                )
        results[vocab_size] = [
            {
                "lib": r[0],
                "seconds": r[1],
                "cpu_s": r[6],
                "vmhwm_mb": r[2],
                "merges": r[3],
                "note": r[4],
                "runs": [{k: v for k, v in o.items() if k != "merged_tokens"} for o in r[5]],
            }
            for r in rows
        ]
        print()

    if args.concat > 1:
        big = Path(tempfile.gettempdir()) / f"ferrolm_bench_concat{args.concat}.txt"
        if not big.exists() or big.stat().st_size != args.concat * sum(os.path.getsize(f) for f in files):
            with open(big, "wb") as out:
                for _ in range(args.concat):
                    for f in files:
                        out.write(Path(f).read_bytes())
        vocab_size = args.vocab[0]
        print(
            f"\n## the corpus concatenated {args.concat}× ({big.stat().st_size / 1e6:.0f} MB, one file), vocab {vocab_size:,}\n"
        )
        print("| library | time (s) | peak RSS (MB) | peak RSS on 1× (MB) |")
        print("|---|---:|---:|---:|")
        for lib in args.concat_libs:
            outs = [
                run_child(lib, [str(big)], vocab_size, args.threads, args.timeout)
                for _ in range(max(1, args.runs // 2))
            ]
            secs = statistics.median(o["seconds"] for o in outs)
            rss = max(o["vmhwm_mb"] for o in outs)
            one = next((r["vmhwm_mb"] for r in results.get(vocab_size, []) if r["lib"] == lib), float("nan"))
            print(f"| {lib} | {secs:.2f} | {rss:.0f} | {one:.0f} |", flush=True)
            if lib == "ferrolm":
                print(f"\nferrolm stages: {fmt_stats(outs[0]['stats'])}\n")
            results[f"concat{args.concat}_{lib}"] = {"seconds": secs, "vmhwm_mb": rss}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Corpus → uint16 .bin, end to end, side by side: ferrolm encode vs gigatoken's file API vs a
tiktoken pipeline as nanoGPT's prepare.py does it. Each contender runs in its own process.

    python benches/bench_shards.py                      # 74 MB webtext, 3 timed runs each
    python benches/bench_shards.py --big-gb 1.0         # + the memory check on ~1 GB

Input: all of ../shared/corpora/webtext concatenated (built once under --work). The GPT-2
vocabulary from ../shared/fixtures, <|endoftext|> = 50256. Every contender writes the same
bytes (checked by sha256 before timing): the whole file's ids, special tokens included, as
`Tokenizer.encode(text)` gives them.

* ferrolm: `ferrolm.bpe.shards.encode` (what `ferrolm encode` runs), --threads N and 1; "1 core" also pins
  the process to one CPU, so that the reader thread and the encoder share it (single-core throughput).
* gigatoken: `encode_files(TextFileSource([path], separator=b"<|endoftext|>"))` (documents
  between separators, run on all cores), then eos inserted between documents and written as
  uint16 (gigatoken has no file sink). "gigatoken 1 core": the same with parallel=False, pinned
  to one CPU, for how far its own second core takes it on this machine.
* tiktoken (nanoGPT prepare.py style): read the file, split into documents, a
  multiprocessing.Pool of N processes runs `encode_ordinary(doc) + [eot]`, then the ids
  are written into an np.memmap.

Each child reports its own wall time for read → encode → written and fsynced .bin
("encode+write"), its set-up time (loading the vocabulary), and its peak RSS (VmHWM from its
own /proc/self/status). The parent also times each child process from start to exit.
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
EOT_ID = 50256


def vmhwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s() -> float:
    """CPU seconds (user + system) of this process, its threads and its finished children."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------- children


def child_ferrolm(args) -> dict:
    from ferrolm.bpe import shards
    from ferrolm.bpe.tokenizer import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer.load(args.tokdir)
    _ = tok.fingerprint  # computed once per tokenizer; part of loading
    t1, c1 = time.perf_counter(), cpu_s()
    sc = shards.encode(tok, [args.input], args.out, threads=args.threads, progress=False, hash_inputs=not args.no_hash)
    t2 = time.perf_counter()
    return {"setup_s": t1 - t0, "encode_s": t2 - t1, "cpu_s": cpu_s() - c1, "tokens": sc["num_tokens"]}


def child_gigatoken(args) -> dict:
    import awkward as ak
    import gigatoken
    import numpy as np

    t0 = time.perf_counter()
    g = gigatoken.Tokenizer.from_tiktoken(args.ranks, pretokenizer="gpt2", special_tokens={EOT: EOT_ID})
    t1, c1 = time.perf_counter(), cpu_s()
    arr = g.encode_files(gigatoken.TextFileSource([args.input], separator=EOT.encode()), parallel=args.threads > 1)
    offsets = np.asarray(arr.layout.offsets)
    flat = ak.to_numpy(ak.flatten(arr))
    n = len(offsets) - 1
    out = np.full(len(flat) + n - 1, EOT_ID, dtype=np.uint16)
    keep = np.ones(len(out), dtype=bool)
    keep[offsets[1:-1] + np.arange(n - 1)] = False
    out[keep] = flat
    with open(args.out + ".bin", "wb") as f:
        out.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    t2 = time.perf_counter()
    return {"setup_s": t1 - t0, "encode_s": t2 - t1, "cpu_s": cpu_s() - c1, "tokens": int(len(out))}


_ENC = None


def _tiktoken_doc(doc: str) -> list[int]:
    ids = _ENC.encode_ordinary(doc)
    ids.append(EOT_ID)
    return ids


def child_tiktoken(args) -> dict:
    global _ENC
    import multiprocessing as mp

    import numpy as np
    import tiktoken

    sys.path.insert(0, str(REPO / "python"))
    from ferrolm.bpe import patterns
    from ferrolm.bpe.files import read_tiktoken_ranks

    t0 = time.perf_counter()
    _ENC = tiktoken.Encoding(
        "gpt2-offline",
        pat_str=patterns.GPT2,
        mergeable_ranks=read_tiktoken_ranks(args.ranks),
        special_tokens={EOT: EOT_ID},
    )
    t1, c1 = time.perf_counter(), cpu_s()
    with open(args.input, encoding="utf-8") as f:
        docs = f.read().split(EOT)
    with mp.get_context("fork").Pool(args.threads) as pool:
        results = pool.map(_tiktoken_doc, docs, chunksize=16)
    results[-1].pop()  # the text after the last separator is not a document: no eot after it
    total = sum(len(r) for r in results)
    arr = np.memmap(args.out + ".bin", dtype=np.uint16, mode="w+", shape=(total,))
    idx = 0
    for r in results:
        arr[idx : idx + len(r)] = r
        idx += len(r)
    arr.flush()
    del arr
    fsync_path(args.out + ".bin")
    t2 = time.perf_counter()
    return {"setup_s": t1 - t0, "encode_s": t2 - t1, "cpu_s": cpu_s() - c1, "tokens": total}


CHILDREN = {"ferrolm": child_ferrolm, "gigatoken": child_gigatoken, "tiktoken": child_tiktoken}


def run_child(argv) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--tokdir", required=True)
    p.add_argument("--ranks", required=True)
    p.add_argument("--no-hash", action="store_true")
    p.add_argument(
        "--one-core", action="store_true", help="pin the whole process (reader and encoder threads) to one CPU"
    )
    args = p.parse_args(argv)
    if args.one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before any thread starts: all inherit it
    import gc

    gc.disable()
    r = CHILDREN[args.child](args)
    r["vmhwm_mb"] = vmhwm_mb()
    print("RESULT " + json.dumps(r))


# ------------------------------------------------------------------------- parent


def build_inputs(work: Path, big_gb: float) -> tuple[Path, Path | None]:
    srcs = sorted((SHARED / "corpora" / "webtext").glob("*.txt"))
    if not srcs:
        sys.exit(f"no corpora under {SHARED}/corpora/webtext (set FERROLM_SHARED)")
    cat = work / "webtext_all.txt"
    want = sum(p.stat().st_size for p in srcs)
    if not cat.exists() or cat.stat().st_size != want:
        with open(cat, "wb") as out:
            for p in srcs:
                out.write(p.read_bytes())
    big = None
    if big_gb > 0:
        reps = max(1, round(big_gb * 1e9 / want))
        big = work / f"webtext_x{reps}.txt"
        if not big.exists() or big.stat().st_size != want * reps:
            data = cat.read_bytes()
            with open(big, "wb") as out:
                for _ in range(reps):
                    out.write(data)
    return cat, big


def build_tokenizer(work: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "python"))
    from ferrolm.bpe import files as tf
    from ferrolm.bpe.tokenizer import Tokenizer

    tokdir, ranks = work / "gpt2_tok", work / "gpt2.tiktoken"
    if not (tokdir / "tokenizer.json").exists() or not ranks.exists():
        tok = Tokenizer.from_files(
            SHARED / "fixtures" / "gpt2_vocab.json", SHARED / "fixtures" / "gpt2_merges.txt", [EOT]
        )
        tok.save(tokdir)
        tf.write_tiktoken_ranks(
            ranks, sorted(((b, i) for i, b in tok.vocab.items() if i != EOT_ID), key=lambda x: x[1])
        )
    return tokdir, ranks


def spawn(name: str, threads: int, inp: Path, out: Path, tokdir: Path, ranks: Path, extra=()) -> dict:
    for ext in (".bin", ".json", ".progress.json", ".bin.partial"):
        try:
            os.unlink(str(out) + ext)
        except FileNotFoundError:
            pass
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--input",
        str(inp),
        "--out",
        str(out),
        "--threads",
        str(threads),
        "--tokdir",
        str(tokdir),
        "--ranks",
        str(ranks),
        *extra,
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{p.stderr[-3000:]}")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT ") :])
    r["process_s"] = wall
    return r


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("ferrolm", "gigatoken", "tiktoken", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "?"
    return out


def main() -> None:
    if "--child" in sys.argv:
        return run_child(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "ferrolm-bench-shards"),
        help="scratch folder for inputs and outputs",
    )
    ap.add_argument("--runs", type=int, default=3, help="timed runs per contender (median reported)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument(
        "--big-gb", type=float, default=0.0, help="also run the memory check on the input repeated to ~this many GB"
    )
    ap.add_argument(
        "--contenders", default="ferrolm,ferrolm-1t,ferrolm-1core,ferrolm-nohash,gigatoken,gigatoken-1core,tiktoken"
    )
    ap.add_argument("--json", default=None, help="write the raw results here")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cat, big = build_inputs(work, args.big_gb)
    tokdir, ranks = build_tokenizer(work)
    size = cat.stat().st_size
    names = args.contenders.split(",")

    def spec(name):
        if name == "ferrolm-1t":
            return "ferrolm", 1, ()
        if name == "ferrolm-1core":
            return "ferrolm", 1, ("--one-core",)
        if name == "ferrolm-nohash":
            return "ferrolm", args.threads, ("--no-hash",)
        if name == "gigatoken-1core":
            return "gigatoken", 1, ("--one-core",)
        return name, args.threads, ()

    print(f"input {cat} ({size / 1e6:.1f} MB); threads {args.threads}; load average {os.getloadavg()}", file=sys.stderr)
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(
            "WARNING: the machine is busy; wall times will be inflated and noisy (CPU seconds less so)", file=sys.stderr
        )
    # Warm-up run of each, which also checks that all wrote the same bytes.
    hashes = {}
    for name in names:
        kind, th, extra = spec(name)
        spawn(kind, th, cat, work / f"out_{name}", tokdir, ranks, extra)
        hashes[name] = sha256_file(work / f"out_{name}.bin")
        print(f"  warm-up {name}: sha256 {hashes[name][:16]}", file=sys.stderr)
    if len(set(hashes.values())) != 1:
        sys.exit(f"outputs differ, refusing to time different work: {hashes}")
    results: dict[str, list[dict]] = {n: [] for n in names}
    for run in range(args.runs):
        # Interleaved, so that slow drifts in machine load hit all alike, in an order that
        # rotates each run: the process after the tiktoken pipeline (807 MB, freed just
        # before it) starts on memory the VM has handed back to its host, which is slow
        # to touch again (see shards.md), and that should not always be the same one.
        k = run % len(names)
        for name in names[k:] + names[:k]:
            kind, th, extra = spec(name)
            r = spawn(kind, th, cat, work / f"out_{name}", tokdir, ranks, extra)
            results[name].append(r)
            print(
                f"  run {run} {name}: encode+write {r['encode_s']:.2f} s ({r['cpu_s']:.2f} CPU s), process {r['process_s']:.2f} s, "
                f"VmHWM {r['vmhwm_mb']:.0f} MB, load {os.getloadavg()[0]:.1f}",
                file=sys.stderr,
            )

    def med(name, key):
        return statistics.median(r[key] for r in results[name])

    def per_run(slow, fast):
        """Ratios of encode+write times within each run (contenders of a run follow each
        other, so slow drifts of the VM cancel): range and median."""
        rs = sorted(a["encode_s"] / b["encode_s"] for a, b in zip(results[slow], results[fast]))
        return f"{rs[0]:.2f}-{rs[-1]:.2f}×, median {statistics.median(rs):.2f}×"

    tokens = results[names[0]][0]["tokens"]
    lines = []
    lines.append(f"Load average during the runs: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.")
    lines.append("")
    lines.append(
        f"Input: all of ../shared/corpora/webtext concatenated, {size / 1e6:.1f} MB, {tokens:,} GPT-2 tokens; "
        f"{args.threads} threads/processes; median of {args.runs} runs; outputs byte-identical (sha256 {hashes[names[0]][:16]})."
    )
    lines.append("")
    lines.append(
        "| contender | encode+write (s) | MB/s | vs ferrolm | CPU s | MB per CPU-s | process wall (s) | set-up (s) | peak RSS (MB) |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = med("ferrolm", "encode_s") if "ferrolm" in results else None
    label = {
        "ferrolm": f"ferrolm encode ({args.threads} threads)",
        "ferrolm-1t": "ferrolm encode (1 encoder thread + reader)",
        "ferrolm-1core": "ferrolm encode (1 thread, pinned to 1 core)",
        "ferrolm-nohash": f"ferrolm encode --no-hash ({args.threads} threads)",
        "gigatoken": "gigatoken encode_files + uint16 .bin",
        "gigatoken-1core": "gigatoken encode_files (parallel=False, pinned to 1 core)",
        "tiktoken": f"tiktoken, nanoGPT-style ({args.threads} processes)",
    }
    for name in names:
        e = med(name, "encode_s")
        ratio = f"{e / base:.2f}× the time" if base and name != "ferrolm" else "1"
        c = med(name, "cpu_s")
        lines.append(
            f"| {label.get(name, name)} | {e:.2f} | {size / 1e6 / e:.0f} | {ratio} | {c:.2f} | {size / 1e6 / c:.0f} | {med(name, 'process_s'):.2f} | "
            f"{med(name, 'setup_s'):.2f} | {max(r['vmhwm_mb'] for r in results[name]):.0f} |"
        )
    if base:
        lines.append("")
        for name in names:
            if name != "ferrolm":
                lines.append(
                    f"- {label.get(name, name)} takes {med(name, 'encode_s') / base:.2f}× the time of ferrolm "
                    f"({args.threads} threads) to encode and write, {med(name, 'process_s') / med('ferrolm', 'process_s'):.2f}× "
                    "as a whole process"
                )
        for lib in ("ferrolm", "gigatoken"):
            if lib in results and f"{lib}-1core" in results:
                lines.append(
                    f"- {lib}: {args.threads} threads are {med(f'{lib}-1core', 'encode_s') / med(lib, 'encode_s'):.2f}× "
                    f"its own single-core speed (per run: {per_run(f'{lib}-1core', lib)})"
                )
        for name in names:
            if name != "ferrolm" and not name.endswith("-1core"):
                lines.append(f"- per run, {label.get(name, name)} / ferrolm: {per_run(name, 'ferrolm')}")
        owt = 11.9e9
        lines.append(
            f"- Projected OpenWebText (11.9 GB) with ferrolm at {size / 1e6 / base:.0f} MB/s on this machine: "
            f"{owt / (size / base) / 60:.1f} min"
        )
    big_rows = []
    if big is not None:
        bsize = big.stat().st_size
        print(f"memory check on {big} ({bsize / 1e9:.2f} GB)", file=sys.stderr)
        for name in [n for n in ("ferrolm", "gigatoken") if n in names]:
            kind, th, extra = spec(name)
            r = spawn(kind, th, big, work / f"big_{name}", tokdir, ranks, extra)
            small = max(x["vmhwm_mb"] for x in results[name])
            big_rows.append(
                f"| {label[name]} | {small:.0f} | {r['vmhwm_mb']:.0f} | {r['encode_s']:.1f} | {bsize / 1e6 / r['encode_s']:.0f} |"
            )
            try:
                os.unlink(work / f"big_{name}.bin")
            except FileNotFoundError:
                pass
        lines.append("")
        lines.append(f"Memory check: the same input repeated to {bsize / 1e9:.2f} GB (one run each).")
        lines.append("")
        lines.append(
            f"| contender | peak RSS, {size / 1e6:.0f} MB input (MB) | peak RSS, {bsize / 1e9:.2f} GB input (MB) | encode+write (s) | MB/s |"
        )
        lines.append("|---|---:|---:|---:|---:|")
        lines.extend(big_rows)
    lines.append("")
    lines.append(
        f"Versions: {versions()}; Python {platform.python_version()}; {platform.machine()}, {os.cpu_count()} cores; "
        f"{time.strftime('%Y-%m-%d')}."
    )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "big": big_rows, "hashes": hashes}, indent=2))


if __name__ == "__main__":
    main()

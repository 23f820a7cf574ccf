"""Encode speed side by side: ferrolm vs gigatoken vs tiktoken vs HF tokenizers (vs tokendagger
when installed), GPT-2 vocab, each library in its own subprocess, ids hash-checked equal.

    python benches/bench_encode.py                      # everything (several minutes)
    python benches/bench_encode.py --quick              # TinyStories only, fewer runs
    python benches/bench_encode.py --write benches/out/encode.md     # the tables as markdown

Modes (each on the 25 MB Wikipedia file and the TinyStories file):
  encode        one `encode` call per document, one thread (documents split on the separator)
  batch-1/-2    the library's batch API over the documents, 1 and 2 threads
  file          the whole file in one call, all cores (ferrolm encode_file, gigatoken
                encode_files with a TextFileSource)
Plus: ferrolm's encode_iterable over a ~200 MB file (the corpora concatenated, in the temporary directory) with
peak RSS, and worst-case inputs ("a" * n, "!" * n) at 10 kB, 100 kB, 1 MB.

Each child reads VmHWM from its own /proc/self/status; times are the median of the timed runs
after one warm-up run that also computes the sha256 of the ids (checked equal across libraries
before any timing is reported). MB/s counts UTF-8 bytes of input. Wall and CPU time are both
recorded; on a shared machine CPU time is the steadier of the two.
"""

from __future__ import annotations

import argparse
import base64
import gc
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
WIKI = SHARED / "corpora/webtext/enwiki_2021_wikiextractor_part01.txt"
TINY = SHARED / "corpora/tinystories/TinyStories-v1-train_head_2MiB.txt"
EOT = "<|endoftext|>"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
WORK = Path(os.environ.get("FERROLM_BENCH_TMP", str(Path(tempfile.gettempdir()) / "ferrolm-bench-encode")))

# "ferrolm-np": the same encoder through its numpy-returning calls (encode_to_numpy,
# encode_batch_to_numpy), like gigatoken's, which return numpy/awkward arrays, not lists.
LIBS = ["ferrolm", "ferrolm-np", "gigatoken", "tiktoken", "tokendagger", "hf"]
MODES = ["encode", "batch-1", "batch-2", "file"]


# --------------------------------------------------------------------------------------
# Shared setup
# --------------------------------------------------------------------------------------


def gpt2_vocab() -> dict[int, bytes]:
    sys.path.insert(0, str(REPO / "python"))
    from ferrolm.bpe.files import read_vocab

    return read_vocab(SHARED / "fixtures/gpt2_vocab.json", [EOT])


def rank_file() -> Path:
    """GPT-2's ranks as a .tiktoken file (what gigatoken loads)."""
    path = WORK / "gpt2.tiktoken"
    if not path.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        vocab = gpt2_vocab()
        lines = [f"{base64.b64encode(vocab[i]).decode()} {i}\n" for i in sorted(vocab) if i != 50256]
        path.write_text("".join(lines))
    return path


def split_docs(text: str) -> list[str]:
    sep = f"\n{EOT}\n" if f"\n{EOT}\n" in text else EOT
    return [d for d in text.split(sep) if d]


def vmhwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def ids_hash(chunks) -> str:
    """sha256 over the ids as little-endian uint32, 50256 (<|endoftext|>) left out so that
    libraries that drop the separator between documents hash the same."""
    import numpy as np

    if type(chunks).__module__.partition(".")[0] == "awkward":
        import awkward as ak

        chunks = [ak.to_numpy(ak.flatten(chunks))]
    h = hashlib.sha256()
    for ids in chunks:
        a = np.asarray(ids, dtype=np.uint32).reshape(-1)
        h.update(a[a != 50256].astype("<u4").tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------
# Children: one library, one mode, one file
# --------------------------------------------------------------------------------------


def load(lib: str, threads: int):
    if lib in ("ferrolm", "ferrolm-np"):
        from ferrolm import Tokenizer

        return Tokenizer.from_files(SHARED / "fixtures/gpt2_vocab.json", SHARED / "fixtures/gpt2_merges.txt", [EOT])
    if lib == "gigatoken":
        import gigatoken

        return gigatoken.Tokenizer.from_tiktoken(str(rank_file()), pretokenizer="gpt2", special_tokens={EOT: 50256})
    if lib in ("tiktoken", "tokendagger"):
        mod = __import__(lib)
        vocab = gpt2_vocab()
        ranks = {b: i for i, b in vocab.items() if i != 50256}
        return mod.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: 50256})
    if lib == "hf":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(
            models.BPE.from_file(str(SHARED / "fixtures/gpt2_vocab.json"), str(SHARED / "fixtures/gpt2_merges.txt"))
        )
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOT])
        return tok
    raise ValueError(lib)


def runner(lib: str, mode: str, tok, path: Path, text: str, docs: list[str]):
    """A function doing one run of `mode`, returning what to hash (a list of id arrays), or None
    when the library has no such mode."""
    if mode == "encode":
        if lib == "ferrolm":
            enc = tok.encode
        elif lib == "ferrolm-np":
            enc = lambda d: tok.encode_to_numpy(d, num_threads=1)  # noqa: E731
        elif lib == "gigatoken":
            enc = tok.encode
        elif lib in ("tiktoken", "tokendagger"):
            enc = lambda d: tok.encode(d, allowed_special="all")  # noqa: E731
        else:
            enc = lambda d: tok.encode(d, add_special_tokens=False).ids  # noqa: E731
        return lambda: [enc(d) for d in docs]
    if mode.startswith("batch-"):
        n = int(mode.split("-")[1])
        if lib == "ferrolm":
            return lambda: tok.encode_batch(docs, num_threads=n)
        if lib == "ferrolm-np":
            return lambda: [tok.encode_batch_to_numpy(docs, num_threads=n)[0]]
        if lib == "gigatoken":
            # parallel=True uses gigatoken's global pool (all cores: 2 on the reference machine).
            return lambda: tok.encode_batch(docs, parallel=(n > 1))
        if lib in ("tiktoken", "tokendagger"):
            return lambda: tok.encode_batch(docs, num_threads=n, allowed_special="all")
        return lambda: [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    if mode == "file":
        if lib == "ferrolm":
            return lambda: [tok.encode_file(path)]
        if lib == "gigatoken":
            import gigatoken

            return lambda: tok.encode_files(gigatoken.TextFileSource([str(path)], separator=EOT.encode()))
        return None
    raise ValueError(mode)


def child(lib: str, mode: str, path: Path, runs: int) -> dict:
    threads = int(mode.split("-")[1]) if mode.startswith("batch-") else (os.cpu_count() or 1)
    if lib == "hf":
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    tok = load(lib, threads)
    text = path.read_text(encoding="utf-8")
    docs = split_docs(text)
    nbytes = len(text.encode("utf-8"))
    run = runner(lib, mode, tok, path, text, docs)
    if run is None:
        return {"lib": lib, "mode": mode, "file": path.name, "skipped": "no such mode"}
    out = run()  # warm-up, and the ids to check
    digest = ids_hash(out)
    if type(out).__module__.partition(".")[0] == "awkward":
        import awkward as ak

        ntok = len(ak.flatten(out))
    else:
        ntok = sum(len(x) for x in out)
    del out
    walls, cpus = [], []
    gc.disable()
    for _ in range(runs):
        c0, w0 = time.process_time(), time.perf_counter()
        run()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        if walls[-1] > 30 and len(walls) >= 1:
            break  # slow library: one timed run is enough
    gc.enable()
    return {
        "lib": lib,
        "mode": mode,
        "file": path.name,
        "bytes": nbytes,
        "docs": len(docs),
        "tokens": ntok,
        "hash": digest,
        "wall": walls,
        "cpu": cpus,
        "vmhwm_mb": vmhwm_mb(),
    }


def child_iterable(path: Path, chunk: str) -> dict:
    from ferrolm import Tokenizer

    tok = Tokenizer.from_files(SHARED / "fixtures/gpt2_vocab.json", SHARED / "fixtures/gpt2_merges.txt", [EOT])
    nbytes = path.stat().st_size
    c0, w0 = time.process_time(), time.perf_counter()
    n = 0
    with open(path, encoding="utf-8") as f:
        chunks = f if chunk == "lines" else iter(lambda: f.read(1 << 20), "")
        for _ in tok.encode_iterable(chunks):
            n += 1
    return {
        "mode": f"iterable-{chunk}",
        "file": path.name,
        "bytes": nbytes,
        "tokens": n,
        "wall": [time.perf_counter() - w0],
        "cpu": [time.process_time() - c0],
        "vmhwm_mb": vmhwm_mb(),
    }


def child_worst(lib: str, unit: str, n: int) -> dict:
    tok = load(lib, 1)
    text = unit * n
    if lib in ("ferrolm", "ferrolm-np"):
        enc = tok.encode
    elif lib == "gigatoken":
        enc = tok.encode
    elif lib in ("tiktoken", "tokendagger"):
        enc = tok.encode_ordinary
    else:
        enc = lambda d: tok.encode(d, add_special_tokens=False).ids  # noqa: E731
    c0, w0 = time.process_time(), time.perf_counter()
    ids = enc(text)
    return {
        "lib": lib,
        "unit": unit,
        "n": n,
        "tokens": len(ids),
        "hash": ids_hash([ids]),
        "wall": [time.perf_counter() - w0],
        "cpu": [time.process_time() - c0],
    }


# --------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------


def spawn(args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    # No encoder here uses BLAS, but importing numpy starts OpenBLAS threads that spin on
    # the CPUs for a while: on 2 cores that took half the CPU from a library whose runs
    # came right after the import (TinyStories' runs are short), so one thread for all.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def available(lib: str) -> bool:
    mod = {"hf": "tokenizers", "ferrolm-np": "ferrolm"}.get(lib, lib)
    return subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True).returncode == 0


def mbps(r: dict, key: str) -> float:
    return r["bytes"] / 1e6 / statistics.median(r[key])


def concat_corpora(target_mb: int) -> Path:
    path = WORK / f"corpora_{target_mb}MB.txt"
    if path.exists():
        return path
    files = sorted((SHARED / "corpora").rglob("*.txt"))
    WORK.mkdir(parents=True, exist_ok=True)
    size = 0
    with open(path, "w", encoding="utf-8") as out:
        while size < target_mb * 1_000_000:
            for f in files:
                t = f.read_text(encoding="utf-8")
                out.write(t)
                size += len(t.encode("utf-8"))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="TinyStories only, 2 runs, no 200 MB stream")
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--skip-iterable", action="store_true")
    ap.add_argument("--skip-worst", action="store_true")
    ap.add_argument("--write", help="write the markdown section to this file")
    args = ap.parse_args()

    if args.child:
        kind = args.child[0]
        if kind == "iterable":
            res = child_iterable(Path(args.child[1]), args.child[2])
        elif kind == "worst":
            res = child_worst(args.child[1], args.child[2], int(args.child[3]))
        else:
            res = child(kind, args.child[1], Path(args.child[2]), int(args.child[3]))
        print(json.dumps(res))
        return

    runs = 2 if args.quick else args.runs
    files = [TINY] if args.quick else [WIKI, TINY]
    libs = [lib for lib in args.libs.split(",") if available(lib)]
    missing = [lib for lib in args.libs.split(",") if lib not in libs]
    modes = args.modes.split(",")
    rank_file()
    results: list[dict] = []
    for path in files:
        for mode in modes:
            for lib in libs:
                r = spawn([lib, mode, str(path), str(runs)], timeout=1800)
                r.setdefault("lib", lib)
                r.setdefault("mode", mode)
                r.setdefault("file", path.name)
                results.append(r)
                print(json.dumps(r), flush=True)

    stream = []
    if not args.skip_iterable and not args.quick:
        big = concat_corpora(200)
        for chunk in ("lines", "1MB"):
            r = spawn(["iterable", str(big), chunk], timeout=3600)
            stream.append(r)
            print(json.dumps(r), flush=True)

    worst = []
    if not args.skip_worst:
        for unit in ("a", "!"):
            for n in (10_000, 100_000, 1_000_000):
                for lib in [x for x in libs if x != "ferrolm-np"]:
                    prev = [w for w in worst if w.get("lib") == lib and w.get("unit") == unit and "cpu" in w]
                    if prev and prev[-1]["cpu"][0] > 20:
                        worst.append({"lib": lib, "unit": unit, "n": n, "error": "skipped (previous size took > 20 s)"})
                        continue
                    r = spawn(["worst", lib, unit, str(n)], timeout=300)
                    r.update({"lib": lib, "unit": unit, "n": n})
                    worst.append(r)
                    print(json.dumps(r), flush=True)

    md = report(results, stream, worst, libs, missing, runs, files)
    print(md)
    if args.write:
        Path(args.write).write_text(md, encoding="utf-8")


def report(results, stream, worst, libs, missing, runs, files) -> str:
    lines = ["## Encode (GPT-2 vocab)", ""]
    lines.append(f"Command: `python benches/bench_encode.py{' --quick' if len(files) == 1 else ''}`  ")
    import importlib.metadata as md

    vers = []
    for lib in libs:
        name = {"hf": "tokenizers", "ferrolm-np": "ferrolm"}.get(lib, lib)
        try:
            vers.append(f"{lib} {md.version(name)}")
        except md.PackageNotFoundError:
            vers.append(lib)
    lines.append(
        f"Date {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; {', '.join(vers)}."
    )
    if missing:
        lines.append(f"Not installed, not measured: {', '.join(missing)}.")
    lines.append(
        f"Median of {runs} timed runs after a warm-up run. MB/s of UTF-8 input by wall time, CPU-time MB/s in brackets; ratio = wall MB/s / tiktoken's."
    )
    lines.append("")
    for path in files:
        rows = [r for r in results if r.get("file") == path.name]
        lines.append(f"### {path.name} ({path.stat().st_size / 1e6:.1f} MB)")
        lines.append("")
        lines.append("| mode | " + " | ".join(libs) + " | ids equal |")
        lines.append("|---|" + "---|" * len(libs) + "---|")
        for mode in MODES:
            mrows = {r["lib"]: r for r in rows if r["mode"] == mode}
            if not mrows:
                continue
            base = mrows.get("tiktoken")
            base_mbps = mbps(base, "wall") if base and "wall" in base else None
            cells = []
            hashes = set()
            for lib in libs:
                r = mrows.get(lib, {})
                if "wall" in r:
                    ratio = f", {mbps(r, 'wall') / base_mbps:.1f}×" if base_mbps else ""
                    cells.append(f"{mbps(r, 'wall'):.1f} ({mbps(r, 'cpu'):.0f}){ratio}")
                    hashes.add(r["hash"])
                else:
                    cells.append("n/a" if "skipped" in r else f"error: {r.get('error', '?')}")
            same = "yes" if len(hashes) == 1 else f"NO ({len(hashes)} different)"
            lines.append(f"| {mode} | " + " | ".join(cells) + f" | {same} |")
        lines.append("")
    if stream:
        lines.append("### encode_iterable, ferrolm, ~200 MB (the corpora concatenated)")
        lines.append("")
        lines.append("| chunks | MB/s wall (CPU) | tokens | peak RSS (VmHWM) |")
        lines.append("|---|---|---|---|")
        for r in stream:
            if "wall" in r:
                lines.append(
                    f"| {r['mode'].split('-', 1)[1]} | {mbps(r, 'wall'):.1f} ({mbps(r, 'cpu'):.0f}) | {r['tokens']:,} | {r['vmhwm_mb']:.0f} MB |"
                )
            else:
                lines.append(f"| {r.get('mode')} | error: {r.get('error')} | | |")
        lines.append("")
    if worst:
        lines.append("### Worst cases: one piece of n repeated characters (seconds, wall)")
        lines.append("")
        wlibs = [x for x in libs if x != "ferrolm-np"]
        lines.append("| input | " + " | ".join(wlibs) + " |")
        lines.append("|---|" + "---|" * len(wlibs))
        for unit in ("a", "!"):
            for n in (10_000, 100_000, 1_000_000):
                cells = []
                for lib in wlibs:
                    r = next((w for w in worst if w["lib"] == lib and w["unit"] == unit and w["n"] == n), {})
                    cells.append(f"{r['wall'][0]:.3f}" if "wall" in r else r.get("error", "n/a"))
                lines.append(f"| `{unit!r} * {n:,}` | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""Tokenizer training and encoding at scale: one machine, two phases, and Ray with 1 and 2
workers; wall time, CPU time and peak memory of each step, and the per-core rates that the
projections in benches/results/scale.md are made from.

    python benches/bench_scale.py --gb 10 --work /data/scale     # the full-size run
    python benches/bench_scale.py --gb 0.5 --work /data/scale    # what fits a busy machine

Corpus: the web text under ../shared/corpora/webtext, cut into documents at blank lines and
repeated until --gb, each document of each repetition given a few fresh words (made from its
number), so that the distinct pre-tokens keep growing as in a real corpus; documents are
separated by <|endoftext|> lines.

Steps, each its own process (CPU time: user + system of the process tree; peak memory: the
largest VmHWM of one process of it):
1. `ferrolm train-tokenizer --vocab-size 32000` on the corpus (one run);
2. `--part I/8 --counts-out` for I in 0..7, then `--counts` (the merge step alone), and a
   check that the merges equal step 1's;
3. `ferrolm encode` on all cores (the one-machine CLI);
4. `ferrolm encode --ray --parts 8` on a local Ray cluster of 1 and of 2 CPUs, and a check
   that the parts in manifest order equal step 3's .bin byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The shared data folder beside the clone (FERROLM_SHARED overrides it), as the other benches.
SHARED = Path(os.environ.get("FERROLM_SHARED", HERE.parent.parent / "shared"))
WEBTEXT = SHARED / "corpora" / "webtext"
EOT = "<|endoftext|>"


def fresh_word(n: int) -> str:
    letters = "bcdfghjklmnpqrstvwxz"
    out = ""
    while True:
        out += letters[n % 20]
        n //= 20
        if not n:
            return "q" + out


def build_corpus(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size >= size:
        return
    docs = []
    for f in sorted(WEBTEXT.glob("*.txt")):
        docs += [d.strip() for d in f.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    if not docs:
        sys.exit(f"no web text found under {WEBTEXT} (set FERROLM_SHARED to the shared data folder)")
    written, rep = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < size:
            for i, d in enumerate(docs):
                n = (rep * len(docs) + i) * 3
                text = f"{d} {fresh_word(n)} {fresh_word(n + 1)}, {fresh_word(n + 2)}.\n{EOT}\n"
                out.write(text)
                written += len(text.encode("utf-8"))
                if written >= size:
                    break
            rep += 1


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _cpu_and_peak(pids: list[int]) -> tuple[float, float]:
    tick = os.sysconf("SC_CLK_TCK")
    cpu, peak = 0.0, 0.0
    for p in pids:
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) / 1024)
        except OSError:
            continue
    return cpu, peak


def run(args: list[str], env=None) -> dict:
    """Run a command under /usr/bin/time: wall, CPU (user + sys of it and its children) and peak RSS."""
    t0 = time.perf_counter()
    r = subprocess.run(
        ["/usr/bin/time", "-f", "%U %S %M", *args], capture_output=True, text=True, env=env or os.environ.copy()
    )
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"failed: {' '.join(args)}\n{r.stderr[-3000:]}")
    user, sys_, peak_kb = r.stderr.strip().splitlines()[-1].split()
    return {"wall_s": wall, "cpu_s": float(user) + float(sys_), "peak_mb": int(peak_kb) / 1024, "stdout": r.stdout}


RAY_CHILD = """
import json, os, sys, time
sys.path.insert(0, {bench!r})
import ray
from bench_scale import _tree, _cpu_and_peak
ray.init(num_cpus={cpus}, include_dashboard=False, log_to_driver=False)
import ferrolm.ray
t0 = time.perf_counter()
m = ferrolm.ray.encode({tok!r}, [{corpus!r}], {out!r}, parts={parts}, progress=False)
wall = time.perf_counter() - t0
cpu, peak = _cpu_and_peak(_tree(os.getpid()))
print(json.dumps({{"wall_s": wall, "cpu_s_tree": cpu, "peak_mb": peak, "num_tokens": m["num_tokens"]}}))
ray.shutdown()
"""


def ferrolm_cmd(*a) -> list[str]:
    return [sys.executable, "-m", "ferrolm", *map(str, a)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=10.0)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--skip", nargs="*", default=[], choices=["train", "counts", "encode", "ray1", "ray2"])
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    corpus = a.work / "corpus.txt"
    build_corpus(corpus, int(a.gb * 1e9))
    size = corpus.stat().st_size
    results: dict = {"corpus_bytes": size, "cpus": os.cpu_count()}
    print(f"corpus {size / 1e9:.2f} GB", flush=True)
    tok = a.work / "tok"
    if "train" not in a.skip:
        results["train"] = run(
            ferrolm_cmd(
                "train-tokenizer", "--input", corpus, "--vocab-size", a.vocab_size, "--out", tok, "--no-progress"
            )
        )
        print("train", {k: v for k, v in results["train"].items() if k != "stdout"}, flush=True)
    if "counts" not in a.skip:
        parts = []
        for i in range(a.parts):
            out = a.work / f"counts.{i}"
            parts.append(
                run(
                    ferrolm_cmd(
                        "train-tokenizer",
                        "--input",
                        corpus,
                        "--part",
                        f"{i}/{a.parts}",
                        "--counts-out",
                        out,
                        "--no-progress",
                    )
                )
            )
        merge = run(
            ferrolm_cmd(
                "train-tokenizer",
                "--counts",
                *(a.work / f"counts.{i}" for i in range(a.parts)),
                "--vocab-size",
                a.vocab_size,
                "--out",
                a.work / "tok_counts",
                "--no-progress",
            )
        )
        results["counts_parts"] = [{k: v for k, v in p.items() if k != "stdout"} for p in parts]
        results["counts_merge"] = {k: v for k, v in merge.items() if k != "stdout"}
        same = (a.work / "tok_counts" / "merges.txt").read_bytes() == (tok / "merges.txt").read_bytes()
        results["counts_merges_identical"] = same
        print("counts", results["counts_merge"], "identical", same, flush=True)
    whole = a.work / "whole"
    if "encode" not in a.skip:
        results["encode"] = run(
            ferrolm_cmd("encode", "--tokenizer", tok, "--input", corpus, "--out", whole, "--no-progress")
        )
        print("encode", {k: v for k, v in results["encode"].items() if k != "stdout"}, flush=True)
    for cpus in (1, 2):
        if f"ray{cpus}" in a.skip:
            continue
        out = a.work / f"ray{cpus}" / "shards"
        child = RAY_CHILD.format(
            bench=str(HERE), cpus=cpus, tok=str(tok), corpus=str(corpus), out=str(out), parts=a.parts
        )
        r = run([sys.executable, "-c", child])
        rec = json.loads(r["stdout"].strip().splitlines()[-1])
        rec["process_wall_s"] = r["wall_s"]
        manifest = json.loads((out.parent / "shards.manifest.json").read_text())
        h = hashlib.sha256()
        for name in manifest["parts"]:
            with open(out.parent / f"{name}.bin", "rb") as f:
                while block := f.read(1 << 24):
                    h.update(block)
        ref = hashlib.sha256(Path(f"{whole}.bin").read_bytes()).hexdigest() if Path(f"{whole}.bin").exists() else None
        rec["identical_to_encode"] = h.hexdigest() == ref
        results[f"ray{cpus}"] = rec
        print(f"ray{cpus}", rec, flush=True)
    for k in ("train", "encode"):
        results.get(k, {}).pop("stdout", None)
    (a.work / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

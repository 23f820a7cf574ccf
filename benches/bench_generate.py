"""Generation speed: ferrolm's sampler with and without its KV cache, and HF transformers.

Tokens/s generating 256 tokens after a 32-token prompt, CPU, fp32, 2 threads, for the
`cpu-small` preset shape and the CS336 TinyStories shape. Every measurement runs in its
own subprocess (its own thread pool and peak memory, read from its VmHWM):

    ferrolm  cache        generate(...)                       (window_keep = context // 2)
    ferrolm  cache exact  generate(..., window_keep=context)  (one full window per token past the context)
    ferrolm  no cache     generate(..., use_cache=False)      (the whole window recomputed per token)
    HF       LlamaForCausalLM.generate(do_sample=True, ...)   (same weights, converted; DynamicCache)

Before timing, each child decodes greedily and the parent checks the ids agree: all 256
between ferrolm's exact cache and no cache, and the first 224 (the tokens generated
inside the 256-token context) between every row. Timed runs sample with temperature
1.0, top-k 50, top-p 0.95, no eos; median of 3 after that warm-up.

    python benches/bench_generate.py                 # both shapes, all rows
    python benches/bench_generate.py --shapes cpu-small --runs 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

SHAPES = {
    # cpu-small's size in the Llama shape HF computes: python/ferrolm/lm/presets/cs336.toml
    "cpu-small": dict(
        vocab_size=10_000, context_length=256, d_model=256, num_layers=4, num_heads=8, d_ff=683, rope_theta=10_000.0
    ),
    # CS336 assignment 1's TinyStories model
    "tinystories": dict(
        vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344, rope_theta=10_000.0
    ),
}
ROWS = ["ferrolm-cache", "ferrolm-cache-exact", "ferrolm-nocache", "hf-llama"]
PROMPT_LEN, NEW_TOKENS = 32, 256
SAMPLING = dict(temperature=1.0, top_k=50, top_p=0.95)
THREADS = 2


def vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build_ferrolm(shape: dict):
    import torch

    from ferrolm.lm.model import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(**shape).eval()


def build_hf(shape: dict):
    import transformers

    ours = build_ferrolm(shape)
    c = shape
    cfg = transformers.LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["d_model"],
        intermediate_size=c["d_ff"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_heads"],
        max_position_embeddings=c["context_length"] + NEW_TOKENS + PROMPT_LEN,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    from ferrolm.lm.hf import to_hf_state_dict

    new = to_hf_state_dict(ours)  # q/k rows permuted for HF's rotate-half RoPE
    missing, unexpected = hf.load_state_dict(new, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    del ours
    return hf, transformers.__version__


def child(row: str, shape_name: str, runs: int) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    shape = SHAPES[shape_name]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab_size"], (PROMPT_LEN,), generator=g).tolist()
    versions = {"torch": torch.__version__}

    if row.startswith("ferrolm"):
        import ferrolm
        from ferrolm.lm.generate import generate

        versions["ferrolm"] = ferrolm.__version__
        model = build_ferrolm(shape)
        kw = {
            "ferrolm-cache": {},
            "ferrolm-cache-exact": {"window_keep": shape["context_length"]},
            "ferrolm-nocache": {"use_cache": False},
        }[row]

        def run(greedy: bool, seed: int) -> list[int]:
            if greedy:
                return list(generate(model, prompt, NEW_TOKENS, temperature=0, **kw))
            gen = torch.Generator().manual_seed(seed)
            return list(generate(model, prompt, NEW_TOKENS, generator=gen, **SAMPLING, **kw))
    else:
        model, versions["transformers"] = build_hf(shape)
        ids = torch.tensor([prompt])
        common = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
            eos_token_id=None,
            use_cache=True,
        )

        def run(greedy: bool, seed: int) -> list[int]:
            with torch.inference_mode():
                if greedy:
                    out = model.generate(ids, do_sample=False, **common)
                else:
                    torch.manual_seed(seed)
                    out = model.generate(ids, do_sample=True, **SAMPLING, **common)
            return out[0, PROMPT_LEN:].tolist()

    greedy_ids = run(True, 0)  # also the warm-up
    times = []
    for r in range(runs):
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        out = run(False, 100 + r)
        times.append(time.perf_counter() - t0)
        gc.enable()
        assert len(out) == NEW_TOKENS, len(out)
    med = statistics.median(times)
    return {
        "row": row,
        "shape": shape_name,
        "greedy_ids": greedy_ids,
        "times_s": times,
        "median_s": med,
        "tokens_per_s": NEW_TOKENS / med,
        "peak_rss_mib": vm_hwm_mib(),
        "versions": versions,
    }


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "out", "generate.json"))
    ap.add_argument("--child", nargs=2, metavar=("ROW", "SHAPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.runs)))
        return 0

    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))
    results = []
    for shape in args.shapes:
        for row in args.rows:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", row, shape, "--runs", str(args.runs)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                raise SystemExit(f"child {row} {shape} failed")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(res)
            print(
                f"{shape:12s} {row:20s} {res['tokens_per_s']:8.1f} tok/s  runs {['%.2f' % t for t in res['times_s']]}  peak {res['peak_rss_mib']:.0f} MiB",
                file=sys.stderr,
            )

    # ids check: exact cache == no cache over all tokens; everyone agrees inside the context
    inside = SHAPES[args.shapes[0]]["context_length"] - PROMPT_LEN
    checks = []
    for shape in args.shapes:
        by = {r["row"]: r for r in results if r["shape"] == shape}
        ref_row = "ferrolm-nocache" if "ferrolm-nocache" in by else next(iter(by))
        ref = by[ref_row]
        for row, r in by.items():
            if row == ref_row:
                continue
            exact_pair = {row, ref_row} == {"ferrolm-cache-exact", "ferrolm-nocache"}
            n = NEW_TOKENS if exact_pair else inside
            mm = first_mismatch(r["greedy_ids"][:n], ref["greedy_ids"][:n])
            checks.append((shape, row, ref_row, n, mm))

    print()
    print(
        f"CPU fp32, torch.set_num_threads({THREADS}), {PROMPT_LEN}-token prompt + {NEW_TOKENS} new tokens, "
        f"sampling T={SAMPLING['temperature']} top-k {SAMPLING['top_k']} top-p {SAMPLING['top_p']}, median of {args.runs}"
    )
    print()
    print("| shape | sampler | tokens/s | vs no cache | vs HF | peak RSS MiB |")
    print("|---|---|---:|---:|---:|---:|")
    for shape in args.shapes:
        by = {r["row"]: r for r in results if r["shape"] == shape}
        base = by.get("ferrolm-nocache")
        hf = by.get("hf-llama")
        for row in args.rows:
            r = by[row]
            vs_nc = f"{r['tokens_per_s'] / base['tokens_per_s']:.1f}x" if base else "-"
            vs_hf = f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf else "-"
            print(f"| {shape} | {row} | {r['tokens_per_s']:.1f} | {vs_nc} | {vs_hf} | {r['peak_rss_mib']:.0f} |")
    print()
    for shape, row, ref_row, n, mm in checks:
        status = "equal" if mm is None else f"DIFFER at token {mm}"
        print(f"- greedy ids, {shape}, {row} vs {ref_row}, first {n} tokens: {status}")
    versions = {}
    for r in results:
        versions.update(r["versions"])
    print(
        f"- versions: {versions}; python {platform.python_version()}; {platform.processor() or platform.machine()}; "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d')}"
    )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"results": results, "checks": checks}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

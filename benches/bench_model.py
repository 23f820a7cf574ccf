"""Training-step speed of ferrolm's TransformerLM next to HF transformers' LlamaForCausalLM.

Both models get the same architecture (pre-norm RMSNorm, SwiGLU, RoPE, untied, no biases,
num_key_value_heads = num_heads, rms_norm_eps = 1e-5) and the SAME weights: HF's copy is
ferrolm's initialization converted (each head's q/k rows permuted, evens then odds, since
HF rotates halves where ferrolm rotates adjacent pairs). Before timing, each child
reports the loss of its first step on the same batch; the parent checks they agree, so
the timings compare the same computation.

One measured step = zero_grad, forward, cross-entropy loss, backward (no optimizer step).
ferrolm uses ferrolm.lm.functional.cross_entropy, HF uses F.cross_entropy on float logits
(what its own loss function does). Each (library, shape, dtype) runs in its own
subprocess: its own thread pool and its own peak memory (VmHWM from /proc/self/status).
Warm-up 1 step, then --runs timed runs of --steps steps each; the median is reported.
"tokens per CPU-second" divides by the process's CPU time instead of wall time: with
--threads 1 it is a fair measure of work even on a busy machine (with more threads it
also counts spin-waiting, so use wall time there).

    python benches/bench_model.py                        # both shapes, fp32 and bf16 autocast
    python benches/bench_model.py --shapes small --dtypes fp32 --runs 3
    python benches/bench_model.py --device cuda          # on a GPU (bf16 autocast, TF32 on)
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

SHAPES = {
    # CS336 TinyStories: 22.7 M parameters
    "tinystories": dict(
        vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344, batch=8
    ),
    "small": dict(vocab_size=10_000, context_length=256, d_model=256, num_layers=4, num_heads=8, d_ff=704, batch=8),
}


def vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def hf_llama_from_ferrolm(model, shape):
    """LlamaForCausalLM with ferrolm's weights (RoPE pair order converted)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["d_model"],
        intermediate_size=shape["d_ff"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_heads"],
        max_position_embeddings=shape["context_length"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    hf = transformers.LlamaForCausalLM(cfg)
    from ferrolm.lm.model import to_hf_llama_state_dict

    new = to_hf_llama_state_dict(model)  # q/k rows permuted for HF's rotate-half RoPE
    missing, unexpected = hf.load_state_dict(new, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


def child(impl: str, shape_name: str, dtype: str, device: str, runs: int, steps: int, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    import ferrolm
    from ferrolm.lm import functional
    from ferrolm.lm.model import TransformerLM

    if impl == "hf":
        import transformers  # noqa: F401  (import cost is not part of the peak we report below)

        version = f"transformers {transformers.__version__}"
    else:
        version = f"ferrolm {ferrolm.__version__}"
    rss_after_import = vm_kib("VmRSS")

    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    model = TransformerLM(
        *(shape[k] for k in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"))
    )
    if impl == "hf":
        model = hf_llama_from_ferrolm(model, shape)

        def logits_of(x):
            return model(input_ids=x).logits

        def loss_of(logits, y):
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    else:

        def logits_of(x):
            return model(x)

        loss_of = functional.cross_entropy
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())

    g = torch.Generator().manual_seed(1)
    B, T = shape["batch"], shape["context_length"]
    ids = torch.randint(0, shape["vocab_size"], (B, T + 1), generator=g).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=(dtype == "bf16"))

    def step() -> float:
        model.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_of(logits_of(x), y)
        loss.backward()
        return loss

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    first_loss = float(step())  # warm-up, and the check value
    sync()
    rates, cpu_rates = [], []
    gc.disable()
    for _ in range(runs):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        sync()
        rates.append(steps * B * T / (time.perf_counter() - t0))
        cpu_rates.append(steps * B * T / (time.process_time() - c0))
    gc.enable()
    out = dict(
        impl=impl,
        shape=shape_name,
        dtype=dtype,
        device=device,
        version=version,
        params=n_params,
        first_loss=first_loss,
        tokens_per_s=rates,
        median_tokens_per_s=statistics.median(rates),
        tokens_per_cpu_s=cpu_rates,
        median_tokens_per_cpu_s=statistics.median(cpu_rates),
        peak_rss_mib=vm_kib("VmHWM") / 1024,
        rss_after_import_mib=rss_after_import / 1024,
    )
    if device == "cuda":
        out["cuda_peak_alloc_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tinystories,small")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--impls", default="ferrolm,hf")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write all results to this JSON file")
    ap.add_argument("--child", nargs=3, metavar=("IMPL", "SHAPE", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print(json.dumps(child(*args.child, args.device, args.runs, args.steps, args.threads)))
        return

    import torch

    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {platform.processor() or platform.machine()}  "
        f"cpus={os.cpu_count()}  torch {torch.__version__}  threads={args.threads}  device={args.device}"
    )
    print(f"# python {' '.join(sys.argv)}")
    results = []
    print(
        "| shape | dtype | library | params | tokens/s (median) | runs | tokens per CPU-second | peak RSS MiB | RSS after imports MiB | first-step loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            row = {}
            for impl in args.impls.split(","):
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    impl,
                    shape,
                    dtype,
                    "--device",
                    args.device,
                    "--runs",
                    str(args.runs),
                    "--steps",
                    str(args.steps),
                    "--threads",
                    str(args.threads),
                ]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"| {shape} | {dtype} | {impl} | FAILED: {proc.stderr.strip().splitlines()[-1:]} |")
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                results.append(r)
                row[impl] = r
                print(
                    f"| {shape} | {dtype} | {r['version']} | {r['params'] / 1e6:.2f} M | {r['median_tokens_per_s']:,.0f} | "
                    f"{', '.join(f'{t:,.0f}' for t in r['tokens_per_s'])} | {r['median_tokens_per_cpu_s']:,.0f} | {r['peak_rss_mib']:,.0f} | "
                    f"{r['rss_after_import_mib']:,.0f} | {r['first_loss']:.5f} |",
                    flush=True,
                )
            if "ferrolm" in row and "hf" in row:
                a, b = row["ferrolm"], row["hf"]
                tol = 1e-4 if dtype == "fp32" else 2e-2
                same = abs(a["first_loss"] - b["first_loss"]) <= tol * max(1.0, abs(b["first_loss"]))
                ratio = a["median_tokens_per_s"] / b["median_tokens_per_s"]
                cpu_ratio = a["median_tokens_per_cpu_s"] / b["median_tokens_per_cpu_s"]
                mem = (a["peak_rss_mib"] - a["rss_after_import_mib"]) / max(
                    1e-9, b["peak_rss_mib"] - b["rss_after_import_mib"]
                )
                print(
                    f"| {shape} | {dtype} | **ferrolm / HF** | | **{ratio:.2f}x** | | {cpu_ratio:.2f}x | "
                    f"training memory above imports: {mem:.2f}x | | losses {'agree' if same else 'DIFFER'} |",
                    flush=True,
                )
                if not same:
                    print(f"WARNING: first-step losses differ: {a['first_loss']} vs {b['first_loss']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""Training-step speed of ferrolm's TransformerLM next to HF transformers' LlamaForCausalLM
and a nanoGPT-style GPT-2 of the same widths, each eager and compiled.

ferrolm and HF get the same architecture (pre-norm RMSNorm, SwiGLU, RoPE, untied, no
biases, num_key_value_heads = num_heads, rms_norm_eps = 1e-5) and the SAME weights: HF's
copy is ferrolm's initialization converted (each head's q/k rows permuted, evens then
odds, since HF rotates halves where ferrolm rotates adjacent pairs). Each child reports
the loss of its first step on the same batch and the parent checks ferrolm's and HF's
agree, so their timings compare the same computation. The nanoGPT-style GPT
(benches/nanogpt_baseline.py: learned positions, LayerNorm with biases, GELU MLP of
4 d_model, fused qkv) has its own GPT-2 initialization and about as many parameters.

One measured step is a whole training step, each library as its users write it:
zero_grad, forward, cross-entropy, backward, global-norm clip to 1.0, AdamW
(lr 1e-3, betas (0.9, 0.95), weight decay 0.1).

- ferrolm: the model called with targets (the LM head fused with the cross-entropy,
  ferrolm.lm.functional.linear_cross_entropy), ferrolm's clip_grad_norm and AdamW (torch's
  fused kernel), and on a CPU the two settings its training loop makes: the allocator
  (ferrolm.lm.device.reuse_freed_memory) and the float32 matmul kernel, torch's BLAS or
  oneDNN by a timed GEMM (ferrolm.lm.gemm.choose, run.cpu_matmul = "auto"). "ferrolm
  compiled" is `run.compile = true` (model and loss compiled as one graph), what `ferrolm
  train` runs by default on CUDA; on a CPU its default is eager.
- HF: F.cross_entropy on float logits (what its loss function does),
  torch.nn.utils.clip_grad_norm_, torch.optim.AdamW with torch's defaults.
- nanoGPT-style: F.cross_entropy, clip_grad_norm_, torch.optim.AdamW (fused on CUDA, as
  nanoGPT's train.py asks for it there).
- "compiled": torch.compile of the loss closure (model + loss), default mode.

Each (library, shape, dtype) runs in its own subprocess: its own thread pool and peak
memory (VmHWM from /proc/self/status on CPU; torch.cuda.max_memory_allocated on CUDA).
Warm-up steps (compilation happens there), then --runs timed runs of --steps steps; the
median is reported. "tokens per CPU-second" divides by the process's CPU time instead of
wall time: with --threads 1 it is a fair measure of work even on a busy machine. Every
row and ratio names the CPU's widest vector instructions (AVX2, AVX-512, AVX512-BF16, AMX:
ferrolm.lm.device.cpu_vector_width): float32 ratios on a CPU differ between them.

    python benches/bench_model.py --shapes tinystories --dtypes fp32 --threads 1     # the CPU comparison
    python benches/bench_model.py --shapes small --dtypes fp32 --runs 1 --steps 1 --impls ferrolm,hf
    python benches/bench_model.py --device cuda --dtypes bf16 --steps 20             # on a GPU (TF32 on)
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
from pathlib import Path

SHAPES = {
    # CS336 TinyStories: 22.7 M parameters
    "tinystories": dict(
        vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344, batch=8
    ),
    "small": dict(vocab_size=10_000, context_length=256, d_model=256, num_layers=4, num_heads=8, d_ff=704, batch=8),
    # seconds-long dry runs of every code path
    "tiny": dict(vocab_size=256, context_length=32, d_model=32, num_layers=2, num_heads=4, d_ff=64, batch=2),
}
IMPLS = ("ferrolm", "ferrolm-compiled", "hf", "hf-compiled", "nanogpt", "nanogpt-compiled")
DEFAULT_IMPLS = ",".join(IMPLS)
LABELS = {"ferrolm": "ferrolm", "hf": "HF Llama", "nanogpt": "nanoGPT-style"}


def vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def hf_llama_from_ferrolm(model, shape):
    """LlamaForCausalLM with ferrolm's weights (RoPE pair order converted), SDPA attention."""
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
    cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(cfg)
    from ferrolm.lm.hf import to_hf_state_dict

    new = to_hf_state_dict(model)  # q/k rows permuted for HF's rotate-half RoPE
    missing, unexpected = hf.load_state_dict(new, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


def train_flops_per_token(impl: str, shape: dict) -> int:
    """Training FLOPs per token (3x the forward), as ferrolm.lm.model.flops_per_token counts them."""
    from ferrolm.lm.model import ModelConfig, flops_per_token

    keys = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff")
    cfg = ModelConfig(*(shape[k] for k in keys))
    if impl == "nanogpt":  # GELU MLP of 4 d: 8 d^2 weights where SwiGLU has 3 d d_ff
        d, L, T = shape["d_model"], shape["num_layers"], shape["context_length"]
        return 3 * (2 * (L * 12 * d * d + shape["vocab_size"] * d) + 4 * L * T * d)
    return 3 * flops_per_token(cfg)


def build(impl: str, shape: dict, device: str):
    """(model, loss(x, y), optimizer, clip(params)) for one library, as its users write them."""
    import torch
    import torch.nn.functional as F

    from ferrolm.lm import device as _device
    from ferrolm.lm import gemm
    from ferrolm.lm.model import TransformerLM
    from ferrolm.lm.optim import AdamW, clip_grad_norm, param_groups_for_decay

    torch.manual_seed(0)
    keys = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff")
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    if impl == "nanogpt":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from nanogpt_baseline import GPT

        s = shape
        model = GPT(s["vocab_size"], s["context_length"], s["d_model"], s["num_layers"], s["num_heads"], tie=False)
    else:
        model = TransformerLM(*(shape[k] for k in keys))
        if impl == "hf":
            model = hf_llama_from_ferrolm(model, shape)
    model.to(device).train()
    V = shape["vocab_size"]
    if impl == "ferrolm":
        if device == "cpu":
            _device.reuse_freed_memory()  # as ferrolm's training loop sets up a CPU run
            gemm.choose("auto")  # its float32 matmul kernel, measured (run.cpu_matmul)
        opt = AdamW(param_groups_for_decay(model, 0.1), weight_decay=0.1, **hyper)

        def loss(x, y):
            return model(x, targets=y)  # the LM head fused with the loss, as ferrolm trains

        return model, loss, opt, clip_grad_norm
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    fused = {"fused": True} if impl == "nanogpt" and device == "cuda" else {}
    opt = torch.optim.AdamW(groups, **hyper, **fused)
    if impl == "hf":

        def loss(x, y):
            return F.cross_entropy(model(input_ids=x).logits.float().view(-1, V), y.reshape(-1))
    else:

        def loss(x, y):
            return F.cross_entropy(model(x).view(-1, V), y.reshape(-1))

    return model, loss, opt, torch.nn.utils.clip_grad_norm_


def child(name: str, shape_name: str, dtype: str, args) -> dict:
    import torch

    device, runs, steps = args.device, args.runs, args.steps
    torch.set_num_threads(args.threads)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    import ferrolm
    from ferrolm.lm.device import cpu_vector_width

    impl, compiled = name.removesuffix("-compiled"), name.endswith("-compiled")
    if impl == "hf":
        import transformers  # (import cost is not part of the training memory reported)

        version = f"transformers {transformers.__version__}"
    else:
        version = f"ferrolm {ferrolm.__version__}" if impl == "ferrolm" else f"torch {torch.__version__}"
    rss_after_import = vm_kib("VmRSS")

    shape = dict(SHAPES[shape_name], **({"batch": args.batch} if args.batch else {}))
    model, loss_of, opt, clip = build(impl, shape, device)
    if compiled:
        loss_of = torch.compile(loss_of, backend=args.compile_backend)
    n_params = sum(p.numel() for p in model.parameters())
    params = list(model.parameters())

    g = torch.Generator().manual_seed(1)
    B, T = shape["batch"], shape["context_length"]
    ids = torch.randint(0, shape["vocab_size"], (B, T + 1), generator=g).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=(dtype == "bf16"))

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_of(x, y)
        loss.backward()
        clip(params, 1.0)
        opt.step()
        return loss

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    first_loss = float(step())  # warm-up (compilation), and the check value
    for _ in range(2 if compiled else 1):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rates, cpu_rates = [], []
    gc.disable()
    if args.window:  # side by side: start when the parent says, run steps for the window
        print("READY", flush=True)
        sys.stdin.readline()
        deadline = time.perf_counter() + args.window
        while time.perf_counter() < deadline or len(rates) < 2:
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            rates.append(B * T / (time.perf_counter() - t0))
            cpu_rates.append(B * T / (time.process_time() - c0))
    for _ in range(0 if args.window else runs):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        sync()
        rates.append(steps * B * T / (time.perf_counter() - t0))
        cpu_rates.append(steps * B * T / (time.process_time() - c0))
    gc.enable()
    out = dict(
        impl=name,
        shape=shape_name,
        dtype=dtype,
        device=device,
        cpu_vector=cpu_vector_width(),
        version=version,
        params=n_params,
        first_loss=first_loss,
        warmup_s=warmup_s,
        train_flops_per_token=train_flops_per_token(impl, shape),
        tokens_per_s=rates,
        median_tokens_per_s=statistics.median(rates),
        tokens_per_cpu_s=cpu_rates,
        median_tokens_per_cpu_s=statistics.median(cpu_rates),
        peak_rss_mib=vm_kib("VmHWM") / 1024,
        rss_after_import_mib=rss_after_import / 1024,
    )
    if device == "cuda":
        out["cuda_peak_alloc_mib"] = torch.cuda.max_memory_allocated() / 2**20
    out["tokens_per_step"] = B * T
    return out


def run_child(name: str, shape: str, dtype: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, shape, dtype, "--device", args.device]
    cmd += ["--runs", str(args.runs), "--steps", str(args.steps), "--threads", str(args.threads)]
    cmd += ["--batch", str(args.batch), "--compile-backend", args.compile_backend]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(impl=name, shape=shape, dtype=dtype, failed=tail)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_side_by_side(names: list[str], shape: str, dtype: str, args) -> list[dict]:
    """Each of ``names`` in its own process on a core of its own, timed over the same
    wall-clock window once all have warmed up: whatever else the machine does then
    (other tenants of a VM, a changing clock), every row feels it alike."""
    procs = []
    for core, name in enumerate(names):
        cmd = [sys.executable, __file__, "--child", name, shape, dtype, "--device", args.device]
        cmd += ["--threads", str(args.threads), "--batch", str(args.batch), "--compile-backend", args.compile_backend]
        cmd += ["--window", str(args.side_by_side), "--cpu", str(core % os.cpu_count())]
        procs.append(
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    ready = [p.stdout.readline().strip() == "READY" for p in procs]
    for p, ok in zip(procs, ready):
        if ok:
            p.stdin.write("go\n")
            p.stdin.flush()
    out = []
    for name, p in zip(names, procs):
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            tail = (stderr.strip().splitlines() or ["no output"])[-1]
            out.append(dict(impl=name, shape=shape, dtype=dtype, failed=tail))
        else:
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def memory_mib(r: dict) -> float:
    """Training memory: CUDA peak allocation, or the CPU peak RSS above the imports."""
    return r["cuda_peak_alloc_mib"] if "cuda_peak_alloc_mib" in r else r["peak_rss_mib"] - r["rss_after_import_mib"]


def row_line(r: dict, peak_tflops: float | None) -> str:
    if "failed" in r:
        return f"| {r['shape']} | {r['dtype']} | {vector_width()} | {r['impl']} | FAILED: {r['failed']} |"
    mfu = ""
    if peak_tflops:
        mfu = f"{100 * r['train_flops_per_token'] * r['median_tokens_per_s'] / (peak_tflops * 1e12):.1f} %"
    return (
        f"| {r['shape']} | {r['dtype']} | {r['cpu_vector']} | {r['impl']} | {r['version']} | {r['params'] / 1e6:.2f} M | "
        f"{r['median_tokens_per_s']:,.0f} | {', '.join(f'{t:,.0f}' for t in r['tokens_per_s'])} | "
        f"{r['median_tokens_per_cpu_s']:,.0f} | {mfu} | {memory_mib(r):,.0f} | {r['warmup_s']:.1f} | "
        f"{r['first_loss']:.5f} |"
    )


ROW_HEADER = (
    "| shape | dtype | CPU vectors | implementation | version | params | tokens/s (median) | runs | "
    "tokens per CPU-second | MFU | training memory MiB | warm-up s | first-step loss |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)
RATIO_HEADER = (
    "| shape | dtype | CPU vectors | ratio | tokens/s ratio | tokens per CPU-second ratio | "
    "training memory ratio (eager ferrolm) |\n|---|---|---|---|---|---|---|"
)


def vector_width() -> str:
    """The CPU's widest vector instructions (AVX2, AVX-512, AVX512-BF16, AMX), printed beside
    every figure: a float32 CPU step's ratios differ between them (torch's BLAS and oneDNN
    each choose their kernels by them)."""
    from ferrolm.lm.device import cpu_vector_width

    return cpu_vector_width()


def ratio_lines(rows: dict, shape: str, dtype: str, device: str) -> list[str]:
    """ferrolm as `ferrolm train` runs it by default (compiled on CUDA, eager on a CPU;
    the other when that one was not measured) against each peer, eager and compiled."""
    lines = []
    first, second = ("ferrolm-compiled", "ferrolm") if device == "cuda" else ("ferrolm", "ferrolm-compiled")
    ours = rows.get(first) or rows.get(second)
    if not ours:
        return lines
    for peer in IMPLS[2:]:
        theirs = rows.get(peer)
        if not theirs:
            continue
        ratio = ours["median_tokens_per_s"] / theirs["median_tokens_per_s"]
        cpu_ratio = ours["median_tokens_per_cpu_s"] / theirs["median_tokens_per_cpu_s"]
        mem = memory_mib(rows.get("ferrolm") or ours) / max(1e-9, memory_mib(theirs))
        lines.append(
            f"| {shape} | {dtype} | {ours['cpu_vector']} | {ours['impl']} / {peer} | **{ratio:.2f}x** | "
            f"{cpu_ratio:.2f}x | {mem:.2f}x |"
        )
    return lines


def pair_lines(got: list[dict], shape: str, dtype: str) -> list[str]:
    """The ratio of two rows measured side by side over the same window."""
    if len(got) != 2 or any("failed" in r for r in got):
        return []
    ours, theirs = got
    ratio = ours["median_tokens_per_s"] / theirs["median_tokens_per_s"]
    cpu_ratio = ours["median_tokens_per_cpu_s"] / theirs["median_tokens_per_cpu_s"]
    mem = memory_mib(ours) / max(1e-9, memory_mib(theirs))
    return [
        f"| {shape} | {dtype} | {ours['cpu_vector']} | {ours['impl']} / {theirs['impl']} (side by side) | "
        f"**{ratio:.2f}x** | {cpu_ratio:.2f}x | {mem:.2f}x |"
    ]


def losses_agree(rows: dict, dtype: str) -> bool:
    """ferrolm's and HF's first-step losses (same weights, same batch) agree."""
    tol = 1e-4 if dtype == "fp32" else 2e-2
    pairs = [(rows[a], rows[b]) for a in ("ferrolm", "ferrolm-compiled") for b in ("hf", "hf-compiled")]
    pairs = [(a, b) for a, b in pairs if a and b]
    return all(abs(a["first_loss"] - b["first_loss"]) <= tol * max(1.0, abs(b["first_loss"])) for a, b in pairs)


def compare(args) -> tuple[list[dict], list[str]]:
    """Run every (shape, dtype, implementation) child; return the results and the report's lines."""
    lines = [ROW_HEADER]
    print(ROW_HEADER, flush=True)
    results, ratio_rows = [], []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            rows = {}
            names = args.impls.split(",")
            if args.side_by_side:  # the first against each of the others, two at a time
                batches = [[names[0], peer] for peer in names[1:]]
            else:
                batches = [[name] for name in names]
            for batch in batches:
                got = (
                    run_side_by_side(batch, shape, dtype, args)
                    if args.side_by_side
                    else [run_child(batch[0], shape, dtype, args)]
                )
                if args.side_by_side:
                    ratio_rows += pair_lines(got, shape, dtype)
                for r in got:
                    results.append(r)
                    lines.append(row_line(r, args.peak_tflops))
                    print(lines[-1], flush=True)
                    if "failed" not in r:
                        rows[r["impl"]] = r
            rows = {k: rows.get(k) for k in IMPLS}
            if not losses_agree(rows, dtype):
                print(f"WARNING: ferrolm's and HF's first-step losses differ ({shape}, {dtype})", file=sys.stderr)
                ratio_rows.append(
                    f"| {shape} | {dtype} | {vector_width()} | ferrolm and HF first-step losses DIFFER | | | |"
                )
            if not args.side_by_side:  # (side by side, each pair has its own line above)
                ratio_rows += ratio_lines(rows, shape, dtype, args.device)
    lines += ["", RATIO_HEADER, *ratio_rows]
    return results, lines


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tinystories")
    ap.add_argument("--dtypes", default="fp32")
    ap.add_argument("--impls", default=DEFAULT_IMPLS, help=f"comma-separated, of {', '.join(IMPLS)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="sequences per step (default: the shape's)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled rows")
    ap.add_argument("--peak-tflops", type=float, help="the device's matrix rate, for an MFU column")
    ap.add_argument(
        "--side-by-side",
        type=float,
        default=0,
        metavar="SECONDS",
        help="run the first of --impls at the same time as each other one, each on its own core, "
        "both timed over the same SECONDS once warmed up (the fair comparison on a noisy machine)",
    )
    ap.add_argument("--json", help="also write all results to this JSON file")
    ap.add_argument("--window", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=3, metavar=("IMPL", "SHAPE", "DTYPE"), help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()

    if args.child:
        print(json.dumps(child(*args.child, args)))
        return
    unknown = set(args.impls.split(",")) - set(IMPLS)
    if unknown:
        ap.error(f"unknown --impls {sorted(unknown)}; choose from {', '.join(IMPLS)}")

    import torch

    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.processor() or platform.machine()}  "
        f"cpus={os.cpu_count()}  CPU vectors={vector_width()}  torch {torch.__version__}  threads={args.threads}  "
        f"device={args.device}"
    )
    print(f"# python {' '.join(sys.argv)}")
    results, lines = compare(args)
    print("\n".join(lines[lines.index("") :]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

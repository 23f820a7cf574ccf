"""Training-step throughput of a preset's model: fp32 vs bf16 autocast, by thread count,
and (with --nanogpt) the nanoGPT-style baseline of the same shape beside it.

Each configuration runs in its own subprocess (its own thread pool), warms up, then times
`--steps` full optimizer steps (forward, backward, clip, AdamW) on random tokens, `--repeats`
times; the median tokens/s is reported.

    python benches/train_step_speed.py --preset cpu-small --threads 1 2 --steps 5 --repeats 3
    python benches/train_step_speed.py --threads 1 --fp32-only --nanogpt
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(args) -> None:
    import torch

    from ferrolm.lm.functional import cross_entropy
    from ferrolm.lm.optim import AdamW, clip_grad_norm, param_groups_for_decay
    from ferrolm.lm.train import build_model, load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset, args.set)
    torch.manual_seed(0)
    B, T, V = cfg.schedule.batch_size, cfg.model.context_length, cfg.model.vocab_size
    if args.arch == "nanogpt":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from nanogpt_baseline import GPT

        m = cfg.model
        model = GPT(V, T, m.d_model, m.num_layers, m.num_heads, tie=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        cross_entropy = torch.nn.functional.cross_entropy  # noqa: F811
        clip_grad_norm = torch.nn.utils.clip_grad_norm_  # noqa: F811
    else:
        model = build_model(cfg.model)
        opt = AdamW(param_groups_for_decay(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, T))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else torch.autocast("cpu", enabled=False)

    def step():
        with ctx:
            logits = model(x)
        loss = cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1))
        loss.backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    step()  # warm-up
    rates = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        rates.append(args.steps * B * T / (time.perf_counter() - t))
    print(
        json.dumps(
            {
                "threads": args.threads,
                "bf16": args.bf16,
                "arch": args.arch,
                "tokens_per_s": rates,
                "params": sum(p.numel() for p in model.parameters()),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--nanogpt", action="store_true", help="also time benches/nanogpt_baseline.py's GPT of the same shape"
    )
    ap.add_argument("--fp32-only", action="store_true", help="skip bf16 autocast (slow on CPUs without native bf16)")
    ap.add_argument("--arch", default="ferrolm", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.threads = args.threads[0]
        return child(args)
    print(f"preset {args.preset} {' '.join(args.set)}: {args.steps} steps x {args.repeats} repeats per configuration")
    archs = ["ferrolm", "nanogpt"] if args.nanogpt else ["ferrolm"]
    for threads in args.threads:
        for bf16 in (False,) if args.fp32_only else (False, True):
            for arch in archs:
                cmd = (
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        "--preset",
                        args.preset,
                        "--threads",
                        str(threads),
                        "--arch",
                        arch,
                        "--steps",
                        str(args.steps),
                        "--repeats",
                        str(args.repeats),
                    ]
                    + [f"--set={s}" for s in args.set]
                    + (["--bf16"] if bf16 else [])
                )
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                med = statistics.median(r["tokens_per_s"])
                print(
                    f"{arch:8s} threads {threads}  {'bf16 autocast' if bf16 else 'fp32         '}  median {med:8.0f} tokens/s  "
                    f"(runs: {', '.join(f'{v:.0f}' for v in r['tokens_per_s'])}; {r['params'] / 1e6:.2f} M params)",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""A minimal nanoGPT-style baseline trained on ferrolm's shards, logging like `ferrolm train`.

GPT-2 architecture: learned absolute position embeddings, pre-LayerNorm blocks (with
biases), one fused qkv projection, GELU MLP of width 4·d_model, torch's fused attention,
final LayerNorm, LM head; torch.optim.AdamW (weight decay on matrices only). Everything
it shares with the ferrolm run comes from that run's resolved config (the run directory's
``config.toml``): the shard files, d_model / layers / heads / context / vocab, batch,
tokens per step, learning rates and the warmup + cosine schedule (by steps or by time),
gradient clipping, bf16 autocast, evaluation cadence and the *same* fixed validation
windows (drawn with the same generator and seed as ferrolm's trainer), so the two
val-loss curves are directly comparable.

Parameter count: the GELU MLP with 4·d_model hidden units has as many weights as ferrolm's
SwiGLU with d_ff ≈ 8/3·d_model, and the LM head is untied as in ferrolm, so the two models
differ only by the position table, biases and LayerNorm shifts (< 2 %). `--tie` ties the
head to the embedding as GPT-2 does (fewer parameters).

The shards are read with np.memmap (no ferrolm import), and the log is
``OUT/metrics.jsonl`` with ferrolm's record keys, so `ferrolm plot` overlays the runs:

    ferrolm train --config cpu-small --set data.train=... --set data.val=... --set run.out_dir=runs/ferrolm
    python benches/nanogpt_baseline.py --config runs/ferrolm/config.toml --out runs/nanogpt
    ferrolm plot runs/ferrolm runs/nanogpt --x time --out docs/cpu_small_vs_nanogpt.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# ------------------------------------------------------------------- data ---------------


def open_tokens(src) -> np.ndarray:
    """A shard prefix / .bin / .json (or a list of them) as one memory-mapped token array."""
    srcs = src if isinstance(src, list) else [src]
    arrays = []
    for s in srcs:
        p = Path(s)
        prefix = p.with_suffix("") if p.suffix in (".bin", ".json") else p
        meta = json.loads(prefix.with_name(prefix.name + ".json").read_text())
        dtype = np.uint16 if meta["dtype"] == "uint16" else np.uint32
        arrays.append(np.memmap(prefix.with_name(prefix.name + ".bin"), dtype=dtype, mode="r"))
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # several parts: concatenated in RAM


def windows(tokens: np.ndarray, starts: np.ndarray, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(T + 1)
    w = torch.from_numpy(tokens[idx].astype(np.int64))
    return w[:, :-1], w[:, 1:]


# ------------------------------------------------------------------- model --------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int, tie: bool):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.wte.weight = self.lm_head.weight
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers), zero biases
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


# ------------------------------------------------------------------- training -----------


def cosine(it: float, max_lr: float, min_lr: float, warmup: int, cycle: int) -> float:
    if it < warmup:
        return it / warmup * max_lr
    if it > cycle:
        return min_lr
    if cycle == warmup:
        return max_lr
    return min_lr + 0.5 * (1 + math.cos(math.pi * (it - warmup) / (cycle - warmup))) * (max_lr - min_lr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", required=True, help="a ferrolm run's config.toml (or any ferrolm train TOML with all fields)"
    )
    ap.add_argument("--out", required=True, help="output directory (metrics.jsonl, config.json)")
    ap.add_argument("--tie", action="store_true", help="tie the LM head to the token embedding (GPT-2 style)")
    ap.add_argument("--max-time", type=float, default=None, help="override schedule.max_time_s")
    ap.add_argument("--max-steps", type=int, default=None, help="override schedule.max_steps")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: the config's run.num_threads)"
    )
    args = ap.parse_args()

    cfg = tomllib.loads(Path(args.config).read_text())
    m, d, o, s, r = cfg["model"], cfg["data"], cfg["optimizer"], cfg["schedule"], cfg["run"]
    if args.max_time is not None:
        s["max_time_s"] = args.max_time
    if args.max_steps is not None:
        s["max_steps"] = args.max_steps
    threads = args.threads if args.threads is not None else r.get("num_threads", 0)
    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() and r["device"] in ("auto", "cuda") else "cpu")
    bf16 = bool(r.get("autocast_bf16", False))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train_tokens, val_tokens = open_tokens(d["train"]), open_tokens(d["val"])
    B, T, V = s["batch_size"], m["context_length"], m["vocab_size"]
    torch.manual_seed(r["seed"])
    model = GPT(V, T, m["d_model"], m["num_layers"], m["num_heads"], args.tie).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not model.wte.weight and p is not model.wpe.weight]
    no_decay = [p for p in model.parameters() if not any(p is q for q in decay)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o["lr"],
        betas=(o["beta1"], o["beta2"]),
        eps=o["eps"],
    )
    accum = max(1, round(s["tokens_per_step"] / (B * T))) if s.get("tokens_per_step") else 1
    tokens_per_step = accum * B * T
    max_time, by_time = float(s.get("max_time_s", 0.0)), s.get("schedule_by", "steps") == "time"
    cycle = s.get("cosine_steps") or s["max_steps"]

    # ferrolm's fixed validation windows: same generator, seed and call
    g_val = torch.Generator().manual_seed(r["seed"] + 999_983)
    val_starts = torch.randint(0, len(val_tokens) - T, (r["eval_batches"] * B,), generator=g_val).numpy()
    g_train = torch.Generator().manual_seed(r["seed"] * 7 + 1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else torch.autocast(device.type, enabled=False)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total, n = 0.0, 0
        for i in range(0, len(val_starts), B):
            x, y = windows(val_tokens, val_starts[i : i + B], T)
            with autocast:
                logits = model(x.to(device))
            total += F.cross_entropy(logits.float().reshape(-1, V), y.to(device).reshape(-1)).item() * len(x)
            n += len(x)
        model.train()
        return total / n

    (out / "config.json").write_text(
        json.dumps({"ferrolm_config": cfg, "arch": "gpt2", "tie": args.tie, "params": n_params}, indent=2)
    )
    log = open(out / "metrics.jsonl", "w")
    print(
        f"nanoGPT-style baseline: {n_params / 1e6:.2f} M params, {tokens_per_step} tokens/step, bf16={bf16}",
        file=sys.stderr,
    )

    step, time_s, wall0 = 0, 0.0, time.perf_counter()
    last = (0, 0.0)
    loss_acc, loss_n = 0.0, 0

    def record(step, lr, gnorm, val):
        nonlocal last, loss_acc, loss_n
        dt = time_s - last[1]
        rec = {
            "step": step,
            "tokens": step * tokens_per_step,
            "time_s": round(time_s, 3),
            "wall_s": round(time.perf_counter() - wall0, 3),
            "lr": lr,
            "train_loss": loss_acc / loss_n if loss_n else None,
            "val_loss": val,
            "val_ppl": math.exp(val) if val is not None else None,
            "grad_norm": gnorm,
            "tokens_per_s": (step - last[0]) * tokens_per_step / dt if dt > 0 else None,
            "mfu": None,
        }
        log.write(json.dumps(rec) + "\n")
        log.flush()
        last, loss_acc, loss_n = (step, time_s), 0.0, 0
        if val is not None:
            print(f"step {step}: val loss {val:.4f}  ({time_s:.0f} s)", file=sys.stderr)

    if r.get("eval_at_start", True):
        record(0, 0.0, None, evaluate())
    while step < s["max_steps"]:
        t0 = time.perf_counter()
        it = min(time_s / max_time, 1.0) * s["max_steps"] if by_time else step
        lr = cosine(it, o["lr"], o["min_lr"], s["warmup_steps"], cycle)
        for group in opt.param_groups:
            group["lr"] = lr
        total = 0.0
        for _ in range(accum):
            starts = torch.randint(0, len(train_tokens) - T, (B,), generator=g_train).numpy()
            x, y = windows(train_tokens, starts, T)
            with autocast:
                logits = model(x.to(device))
            loss = F.cross_entropy(logits.float().reshape(-1, V), y.to(device).reshape(-1))
            (loss / accum).backward()
            total += loss.item() / accum
        gnorm = (
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
            if o["grad_clip"] > 0
            else torch.tensor(0.0)
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        time_s += time.perf_counter() - t0
        loss_acc += total
        loss_n += 1
        done = step >= s["max_steps"] or (max_time > 0 and time_s >= max_time)
        do_eval = (r["eval_every"] and step % r["eval_every"] == 0) or done
        if do_eval or step % r["log_every"] == 0:
            record(step, lr, float(gnorm), evaluate() if do_eval else None)
        if done:
            break
    log.close()


if __name__ == "__main__":
    main()

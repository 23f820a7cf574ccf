"""nanochat's own model and optimizer, trained as a peer on a ferrolm run's data.

The peer is nanochat's `GPT` (its block, initialisation, smear and backout, value
embeddings, per-layer scalars, logit soft-cap) and `MuonAdamW` with the parameter groups
its `setup_optimizer` makes, driven by the schedules of nanochat's base training script:
linear warmup then constant then a linear warm-down to a fraction of the peak learning
rate, Muon momentum warmed up from 0.85 to 0.97 over 400 steps and lowered to 0.90 during
the warm-down, and the Muon weight decay on a cosine to zero. Its learning rates and weight
decay are scaled for the batch size and token horizon by the same rules as that script
(``--lr-scale 1`` turns the batch scaling off). nanochat is imported from a checkout given
with ``--nanochat`` (a clone of its public repository); nothing of it is copied here.

Everything the runs must share comes from a ferrolm run's resolved ``config.toml``: the
shards, the shape (d_model, layers, heads, context, vocabulary), the batch, the steps or
the time budget, the evaluation cadence, the training windows (the same sampler and seed
as ferrolm's random-window trainer) and the very same validation windows, so the
``metrics.jsonl`` written here (ferrolm's record keys, bits per byte included) overlays a
ferrolm run's in `ferrolm plot`:

    python benches/nanochat_peer.py --nanochat PATH --config runs/x/config.toml --out runs/nanochat
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch


def load_nanochat(path: Path):
    """nanochat's GPT, GPTConfig from a checkout (its package folder is `nanochat/`)."""
    if not (path / "nanochat" / "gpt.py").is_file():
        sys.exit(f"nanochat_peer: {path} is not a nanochat checkout (no nanochat/gpt.py)")
    sys.path.insert(0, str(path))
    from nanochat.gpt import GPT, GPTConfig

    return GPT, GPTConfig


def build(GPT, GPTConfig, vocab: int, ctx: int, d: int, layers: int, heads: int, device):
    """A nanochat model of the given shape, initialised by its own init_weights.

    Full-context attention in every layer (window pattern "L", as nanochat's CPU script
    runs), as many key/value heads as query heads."""
    config = GPTConfig(
        sequence_len=ctx, vocab_size=vocab, n_layer=layers, n_head=heads, n_kv_head=heads, n_embd=d, window_pattern="L"
    )
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    return model


def reference_horizon(GPT, GPTConfig, ratio: float) -> float:
    """Tokens of nanochat's reference run (its depth-12 model at `ratio` tokens per scaling
    parameter): the anchor its script scales weight decay against."""
    config = GPTConfig(sequence_len=2048, vocab_size=32768, n_layer=12, n_head=6, n_kv_head=6, n_embd=768)
    with torch.device("meta"):
        ref = GPT(config)
    return ratio * scaling_params(ref)


def scaling_params(model) -> int:
    counts = model.num_scaling_params()
    return counts["transformer_matrices"] + counts["lm_head"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanochat", required=True, type=Path, help="a checkout of nanochat's repository")
    ap.add_argument("--config", required=True, help="a ferrolm run's resolved config.toml")
    ap.add_argument("--out", required=True, type=Path, help="output directory (metrics.jsonl, config.json)")
    ap.add_argument("--max-steps", type=int, default=None, help="override schedule.max_steps")
    ap.add_argument("--max-time", type=float, default=None, help="override schedule.max_time_s (seconds of training)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the config's)")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="train through torch.compile(model), as nanochat's script does (evaluations run the plain model)",
    )
    ap.add_argument(
        "--lr-scale",
        default="auto",
        help="learning-rate factor: 'auto' scales by sqrt(batch tokens / 2^19) as nanochat's script does",
    )
    ap.add_argument("--heldout", help="shards of a held-out text, scored once after training (OUT/heldout.json)")
    ap.add_argument(
        "--heldout-tokens", type=int, default=65_537, help="score the held-out text's first N tokens (N >= 2)"
    )
    args = ap.parse_args()

    GPT, GPTConfig = load_nanochat(args.nanochat.resolve())
    from ferrolm.lm.config import load_config
    from ferrolm.lm.data import BatchPrefetcher, TokenShards
    from ferrolm.lm.train import Dist, sampler_seed, val_bytes_per_token, validation_starts

    cfg = load_config(args.config)
    if args.max_steps is not None:
        cfg.schedule.max_steps = args.max_steps
    if args.max_time is not None:
        cfg.schedule.max_time_s = args.max_time
    threads = args.threads if args.threads is not None else cfg.run.num_threads
    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cpu" if cfg.run.device == "cpu" or not torch.cuda.is_available() else "cuda")
    m, s, r = cfg.model, cfg.schedule, cfg.run
    B, T = s.batch_size, m.context_length
    train_data, val_data = TokenShards(cfg.data.train), TokenShards(cfg.data.val)
    V = m.vocab_size or train_data.metadata[0]["vocab_size"]
    m.vocab_size = V

    torch.manual_seed(r.seed)
    model = build(GPT, GPTConfig, V, T, m.d_model, m.num_layers, m.num_heads, device)
    n_params = sum(p.numel() for p in model.parameters())
    # Fixed shapes in training; evaluations (a shorter last batch) stay uncompiled, as in the script.
    step_model = torch.compile(model, dynamic=False) if args.compile else model

    # The script's scaling rules: learning rates by sqrt(B / 2^19); weight decay so that
    # B / (lr * wd * D) stays at the reference's, D the horizon of 12 tokens per parameter.
    batch_tokens = B * T
    lr_scale = math.sqrt(batch_tokens / 2**19) if args.lr_scale == "auto" else float(args.lr_scale)
    horizon = 12 * scaling_params(model)
    weight_decay = 0.28 * math.sqrt(batch_tokens / 2**19) * reference_horizon(GPT, GPTConfig, 12) / horizon
    optimizer = model.setup_optimizer(
        unembedding_lr=0.008 * lr_scale,
        embedding_lr=0.3 * lr_scale,
        scalar_lr=0.5 * lr_scale,
        matrix_lr=0.02 * lr_scale,
        weight_decay=weight_decay,
    )

    # Steps of the schedule: by steps, or (time budget) the steps the budget is expected to
    # hold, re-estimated from the measured step time as training goes (as ferrolm does).
    by_time = s.schedule_by == "time" and s.max_time_s > 0
    max_time = float(s.max_time_s or 0.0)

    def multipliers(progress: float, total: int):
        """(lr multiplier, Muon momentum, Muon weight decay) at `progress` steps of `total`."""
        warmup, warmdown = 40, round(0.65 * total)
        if progress < warmup:
            lrm = (progress + 1) / warmup
        elif progress <= total - warmdown:
            lrm = 1.0
        else:
            left = (total - progress) / warmdown
            lrm = left + (1 - left) * 0.05
        start = total - warmdown
        if progress < 400 and progress < start:
            momentum = 0.85 + (0.97 - 0.85) * progress / 400
        elif progress >= start:
            momentum = 0.97 + (0.90 - 0.97) * (progress - start) / warmdown
        else:
            momentum = 0.97
        wd = weight_decay * 0.5 * (1 + math.cos(math.pi * min(progress / total, 1.0)))
        return lrm, momentum, wd

    sampler = torch.Generator()
    sampler.manual_seed(sampler_seed(r.seed, 0))
    batches = BatchPrefetcher(train_data, B, T, device, sampler)
    val_starts = validation_starts(cfg, val_data, Dist())
    bytes_per_token = val_bytes_per_token(cfg, val_data, val_starts, device, Dist())

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total, n = 0.0, 0
        for i in range(0, len(val_starts), B):
            x, y = val_data.windows_at(val_starts[i : i + B], T, device)
            total += model(x, y).item() * len(x)
            n += len(x)
        model.train()
        return total / n

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(
        json.dumps(
            {"peer": "nanochat", "params": n_params, "lr_scale": lr_scale, "weight_decay": weight_decay}, indent=2
        )
    )
    log = open(args.out / "metrics.jsonl", "w")
    print(f"nanochat peer: {n_params / 1e6:.2f} M params, {batch_tokens} tokens/step", file=sys.stderr)

    step, time_s, last, loss_acc, loss_n = 0, 0.0, (0, 0.0), 0.0, 0
    wall0 = time.perf_counter()

    def record(lr, val):
        nonlocal last, loss_acc, loss_n
        dt = time_s - last[1]
        rec = {
            "step": step,
            "tokens": step * batch_tokens,
            "time_s": round(time_s, 3),
            "wall_s": round(time.perf_counter() - wall0, 3),
            "lr": lr,
            "train_loss": loss_acc / loss_n if loss_n else None,
            "val_loss": val,
            "val_ppl": math.exp(val) if val is not None else None,
            "val_bpb": val / math.log(2) / bytes_per_token if val is not None and bytes_per_token else None,
            "tokens_per_s": (step - last[0]) * batch_tokens / dt if dt > 0 else None,
        }
        log.write(json.dumps(rec) + "\n")
        log.flush()
        last, loss_acc, loss_n = (step, time_s), 0.0, 0
        if val is not None:
            print(f"step {step}: val loss {val:.4f}  ({time_s:.0f} s)", file=sys.stderr)

    if r.eval_at_start:
        record(0.0, evaluate())
    while step < s.max_steps:
        t0 = time.perf_counter()
        if by_time and step > 0:
            total = max(step + 1, min(s.max_steps, round(max_time / (time_s / step))))
        else:
            total = s.max_steps
        lrm, momentum, wd = multipliers(step, total)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if group["kind"] == "muon":
                group["momentum"], group["weight_decay"] = momentum, wd
        x, y = batches.next()
        loss = step_model(x, y)
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        step += 1
        time_s += time.perf_counter() - t0
        loss_acc += loss.item()
        loss_n += 1
        done = step >= s.max_steps or (max_time > 0 and time_s >= max_time)
        do_eval = (r.eval_every and step % r.eval_every == 0) or done
        if do_eval or step % r.log_every == 0:
            record(optimizer.param_groups[-1]["lr"], evaluate() if do_eval else None)
        if done:
            break
    batches.close()
    log.close()
    if args.heldout:
        torch.save(model.state_dict(), args.out / "model.pt")  # a failed scoring keeps the training
        result = score_heldout(model, args.heldout, args.heldout_tokens, T, B, device, cfg.data.tokenizer)
        (args.out / "heldout.json").write_text(json.dumps({**result, "text": args.heldout}, indent=1))


@torch.no_grad()
def score_heldout(model, prefix: str, max_tokens: int, T: int, B: int, device, tokenizer) -> dict:
    """Mean loss and bits per byte over consecutive windows of the first ``max_tokens`` tokens
    of ``prefix``: the windows ``ferrolm eval --max-tokens`` scores, so both sides compare."""
    from ferrolm import Tokenizer
    from ferrolm.lm.data import TokenShards
    from ferrolm.lm.evaluate import token_byte_lengths

    shards = TokenShards(prefix)
    tokens = torch.from_numpy(shards[: min(max_tokens, len(shards))].astype("int64"))
    lengths = token_byte_lengths(Tokenizer.load(tokenizer), model.config.vocab_size)
    windows = [(s, min(T, len(tokens) - 1 - s)) for s in range(0, len(tokens) - 1, T)]
    # batches of equal-width windows (a shorter last window alone)
    groups = [windows[i : i + B] for i in range(0, len(windows), B)]
    if windows[-1][1] != T and len(groups[-1]) > 1:
        groups[-1:] = [groups[-1][:-1], groups[-1][-1:]]
    model.eval()
    nats, nbytes, n = 0.0, 0.0, 0
    for group in groups:
        x = torch.stack([tokens[s : s + w] for s, w in group]).to(device)
        y = torch.stack([tokens[s + 1 : s + w + 1] for s, w in group]).to(device)
        nats += model(x, y, loss_reduction="sum").item()
        nbytes += float(lengths[y.cpu()].sum())
        n += y.numel()
    return {"loss": nats / n, "bits_per_byte": nats / math.log(2) / nbytes if nbytes else None, "tokens": n}


if __name__ == "__main__":
    main()

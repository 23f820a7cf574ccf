"""Supervised fine-tuning, measured: a base model learns to answer, at pretraining's speed.

One run, on this machine:

1. A tokenizer of --vocab ids and token shards of English Wikipedia (as bench_learning.py
   makes them), and a base model pretrained on them with `ferrolm train --config cpu-small`
   for --base-steps steps (the schedule by steps, so that the run's length is the same on
   any machine).
2. A conversation task the script generates, with a held-out split no training row
   repeats: "What is 23 + 58?" -> "81" (two numbers below 100) and "Repeat: river stone
   apple" -> "river stone apple" (two to four words of a fixed list).
3. `ferrolm train --config sft --init-from BASE` on the training split for --sft-steps.
4. Exact-match accuracy on the held-out split, greedy through the generate API: the base
   model on a plain-text prompt ("Question: ...\\nAnswer:", its reply up to the newline; it
   has no chat tokens), the fine-tuned model on the chat rendering (up to <|end|>).
5. Tokens per second of fine-tuning against pretraining at the same shape, batch and
   optimizer (the sft preset's AdamW: a short pretraining run on the Wikipedia shards for
   the comparison, since the base run's Muon costs more per step), in this run (median of
   the runs' logged rates; every position of a row counts, padding too), and the share of
   real (non-padding) tokens in the packed rows the fine-tuning drew.

The report goes to --out (default benches/results/sft.md).

    python benches/bench_sft.py                  # ~10-15 minutes on 2 cores
    python benches/bench_sft.py --quick          # a tiny model, a minute: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHARED = Path(os.environ.get("FERROLM_SHARED", REPO.parent / "shared"))
WEB = SHARED / "corpora" / "webtext"
TRAIN_TEXT = "enwiki_2021_wikiextractor_part01.txt"
SMALL_TEXT = "enwiki_2016_wikiextractor.txt"  # --quick's only text; the full run's validation text
WORDS = (
    "river stone apple cloud green music paper light window garden silver market winter forest "
    "number yellow bridge letter summer island horse orange table candle coffee rabbit planet "
    "mirror pencil basket dragon violin marble jacket ladder engine rocket"
).split()
# --quick: a model small enough to pretrain and fine-tune in seconds
QUICK_SHAPE = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.context_length=64"]


def ferrolm(*args) -> list[str]:
    return [sys.executable, "-m", "ferrolm", *map(str, args)]


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"bench_sft: {shlex.join(cmd[2:6])} ... failed (exit {proc.returncode}); see {log}")


def prepare(work: Path, vocab: int, quick: bool) -> dict:
    """The tokenizer and shards (made once; reused when present)."""
    train_text = WEB / (SMALL_TEXT if quick else TRAIN_TEXT)
    for path in (train_text, WEB / SMALL_TEXT):
        if not path.is_file():
            sys.exit(f"bench_sft: {path} not found (set FERROLM_SHARED to the folder holding corpora/)")
    tok, train, val = work / f"tok{vocab}", work / "data" / "wiki.train", work / "data" / "wiki.val"
    if not (tok / "vocab.json").is_file():
        run(ferrolm("train-tokenizer", "--input", train_text, "--vocab-size", vocab, "--out", tok), work / "tok.log")
    if not train.with_name(train.name + ".json").is_file():
        run(ferrolm("encode", "--tokenizer", tok, "--input", train_text, "--out", train), work / "encode.log")
    if not val.with_name(val.name + ".json").is_file():
        run(ferrolm("encode", "--tokenizer", tok, "--input", WEB / SMALL_TEXT, "--out", val), work / "encode_val.log")
    return {"tok": tok, "train": train, "val": val}


# --------------------------------------------------------------------------- the conversations


def example(rng: random.Random, task: str) -> tuple[str, str]:
    if task == "add":
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} + {b}?", str(a + b)
    words = " ".join(rng.sample(WORDS, rng.randint(2, 4)))
    return f"Repeat: {words}", words


def make_task(work: Path, n_train: int, n_heldout: int, seed: int = 0) -> tuple[Path, Path, list[dict]]:
    """train.jsonl, val.jsonl and the held-out examples (questions no training row asks)."""
    rng = random.Random(seed)
    heldout: dict[str, dict] = {}
    while len(heldout) < n_heldout:
        task = ("add", "repeat")[len(heldout) % 2]
        q, a = example(rng, task)
        heldout.setdefault(q, {"task": task, "question": q, "answer": a})
    rows = []
    while len(rows) < n_train:
        q, a = example(rng, ("add", "repeat")[len(rows) % 2])
        if q not in heldout:
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    cut = max(len(rows) // 20, 1)
    train, val = work / "chats.train.jsonl", work / "chats.val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[cut:]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[:cut]))
    return train, val, list(heldout.values())


# --------------------------------------------------------------------------- measuring


def rates(run_dir: Path) -> float:
    """The median of a run's logged training tokens per second."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    values = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    return statistics.median(values)


def replies(model, prompts: list[list[int]], stop_id: int, max_new: int) -> list[list[int]]:
    """Greedy continuations of each prompt, up to (not including) ``stop_id``."""
    from ferrolm.lm.generate import generate

    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in generate(model, prompts, max_new, temperature=0.0, eos_id=stop_id):
        for r, token in enumerate(step):
            if token is None or done[r]:
                continue
            if token == stop_id:
                done[r] = True
            else:
                out[r].append(token)
    return out


def accuracy(run_dir: Path, heldout: list[dict], *, chat: bool) -> dict[str, float]:
    """Exact-match accuracy per task (and "all") of the model in ``run_dir`` on ``heldout``."""
    from ferrolm.lm.chat import END_TOKEN, render_prompt
    from ferrolm.lm.checkpoint import load_model

    model, tok, _ = load_model(run_dir, require_tokenizer=True)
    if chat:
        prompts = [render_prompt(tok, [{"role": "user", "content": h["question"]}]) for h in heldout]
        stop = tok.special_token_ids[END_TOKEN]
    else:
        prompts = [tok.encode(f"Question: {h['question']}\nAnswer:") for h in heldout]
        stop = tok.encode("\n")[0]
    got = [tok.decode(ids).strip() for ids in replies(model, prompts, stop, 16)]
    right: dict[str, list[bool]] = {}
    for h, text in zip(heldout, got):
        for key in (h["task"], "all"):
            right.setdefault(key, []).append(text == h["answer"])
    return {k: sum(v) / len(v) for k, v in right.items()}


def real_share(run_dir: Path, train_chats: Path, batches: int) -> float:
    """The share of conversation (not padding) tokens in the rows the fine-tuning run packs."""
    import torch

    from ferrolm.bpe.tokenizer import Tokenizer
    from ferrolm.lm.config import load_config
    from ferrolm.lm.conversations import read_conversations
    from ferrolm.lm.data import ConversationRows

    cfg = load_config(run_dir / "config.toml")
    tok = Tokenizer.load(cfg.data.tokenizer)
    T, B = cfg.model.context_length, cfg.schedule.batch_size
    data = read_conversations(train_chats, tok, row_len=T + 1, max_bad_share=cfg.data.max_bad_share)
    rows = ConversationRows(data, B, T, torch.Generator().manual_seed(cfg.run.seed), cfg.data.doc_buffer)
    for _ in range(batches):
        rows.next_rows()
    return rows.real / rows.total


# --------------------------------------------------------------------------- the run


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "unknown CPU"


SPEED_STEPS = 100  # the same-optimizer pretraining run: steps enough for a median of 10-step rates


def train_both(args, data: dict, chats: tuple[Path, Path]) -> tuple[Path, Path, Path, list[list[str]]]:
    work, shape = args.work, QUICK_SHAPE if args.quick else []
    base, sft = work / "base", work / "sft"
    common = ["run.device=cpu", "run.progress=false", "run.checkpoint_every=0", "run.keep_best=false"]
    common += ["schedule.warmup_steps=2"] if args.quick else []
    common += [f"schedule.batch_size={args.batch}", "run.log_every=10", "run.eval_batches=4"]
    base_cmd = ferrolm("train", "--config", "cpu-small")
    for s in [
        *shape,
        *common,
        f"data.train={data['train']}",
        f"data.val={data['val']}",
        f"data.tokenizer={data['tok']}",
    ]:
        base_cmd += ["--set", s]
    for s in ("schedule.schedule_by=steps", "schedule.max_time_s=0", f"schedule.max_steps={args.base_steps}"):
        base_cmd += ["--set", s]
    base_cmd += ["--set", f"run.eval_every={args.base_steps}", "--set", f"run.out_dir={base}"]
    sft_cmd = ferrolm("train", "--config", "sft", "--init-from", base)
    for s in [*common, f"data.train={chats[0]}", f"data.val={chats[1]}", f"schedule.max_steps={args.sft_steps}"]:
        sft_cmd += ["--set", s]
    sft_cmd += ["--set", f"run.eval_every={args.sft_steps}", "--set", f"run.out_dir={sft}"]
    # Pretraining with the fine-tuning's optimizer, for its speed only: the base run's Muon
    # costs more per step than AdamW, which is not what masking and packing cost.
    speed = work / "pretrain-adamw"
    speed_steps = min(SPEED_STEPS, args.base_steps)
    speed_cmd = base_cmd[: base_cmd.index("schedule.schedule_by=steps") - 1]
    for s in ("optimizer.name=adamw", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "optimizer.weight_decay=0.0"):
        speed_cmd += ["--set", s]
    for s in ("schedule.schedule_by=steps", "schedule.max_time_s=0", f"schedule.max_steps={speed_steps}"):
        speed_cmd += ["--set", s]
    speed_cmd += ["--set", f"run.eval_every={speed_steps}", "--set", f"run.out_dir={speed}"]
    for cmd, out, log in ((base_cmd, base, "base.log"), (sft_cmd, sft, "sft.log"), (speed_cmd, speed, "speed.log")):
        if not (out / "checkpoints").is_dir():
            run(cmd, work / log)
    return base, sft, speed, [base_cmd, sft_cmd, speed_cmd]


def _shown(arg: str) -> str:
    """A command's argument as the report shows it: paths relative to the repository."""
    key, eq, value = arg.rpartition("=")
    path = value if eq else arg
    if os.path.isabs(path):
        path = os.path.relpath(path, REPO)
    return f"{key}={path}" if eq else path


def report(args, figures: dict, commands: list[list[str]]) -> str:
    acc_base, acc_sft = figures["base_accuracy"], figures["sft_accuracy"]
    same = figures["pretrain_adamw_tokens_per_s"]
    ratio = figures["sft_tokens_per_s"] / same
    lines = [
        "# Supervised fine-tuning: a base model taught to answer",
        "",
        "## Method",
        "",
        f"    python benches/bench_sft.py {shlex.join(map(_shown, args.argv))}".rstrip(),
        "",
        "A `cpu-small` base model pretrained on English Wikipedia, then fine-tuned with `--config sft "
        "--init-from` on generated conversations (sums of two numbers below 100; repeating two to four words), "
        f"{args.heldout} held-out questions that no training row asks. Greedy decoding; the base model is prompted "
        'in plain text ("Question: ...\\nAnswer:", its reply up to the newline: it has no chat tokens), the '
        "fine-tuned model with the chat rendering (its reply up to <|end|>). Tokens per second count every "
        "position of a row (padding too), median of each run's logged rates. The base run trains with the "
        "preset's Muon, the fine-tuning with AdamW; the speed is compared with a short pretraining run on the "
        "same shards with the fine-tuning's AdamW (the third command), so that the optimizer's cost is not "
        "counted as masking's and packing's. The commands:",
        "",
        *(f"    {shlex.join(['ferrolm', *map(_shown, c[3:])])}" for c in commands),
        "",
        "## Latest result",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores.",
        "",
        "| job | compared with | result |",
        "|---|---|---|",
        f"| fine-tuned cpu-small: held-out exact match | the base model | **{100 * acc_sft.get('all', 0):.1f} %** "
        f"vs {100 * acc_base.get('all', 0):.1f} % |",
        f"| fine-tuning tokens/s | pretraining, same shape and optimizer | **{ratio:.2f}x** |",
        f"| packed conversation rows | target 90 % | **{100 * figures['real_share']:.1f} %** real tokens |",
        "",
        "## Details",
        "",
        "| held-out exact match | base model | fine-tuned |",
        "| --- | ---: | ---: |",
    ]
    for task in ("add", "repeat", "all"):
        lines.append(f"| {task} | {100 * acc_base.get(task, 0):.1f} % | {100 * acc_sft.get(task, 0):.1f} % |")
    lines += [
        "",
        "| throughput and packing | value | target |",
        "| --- | ---: | ---: |",
        f"| pretraining tokens/s (Muon, the base run) | {figures['base_tokens_per_s']:,.0f} | |",
        f"| pretraining tokens/s (AdamW, as the fine-tuning) | {same:,.0f} | |",
        f"| fine-tuning tokens/s | {figures['sft_tokens_per_s']:,.0f} | |",
        f"| fine-tuning / pretraining | {ratio:.2f}x | >= 0.9x |",
        f"| real (non-padding) tokens in packed rows | {100 * figures['real_share']:.1f} % | >= 90 % |",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=HERE / "out" / "sft", help="data and runs (reused when present)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "sft.md", help="the markdown report")
    p.add_argument("--json", type=Path, help="also write the figures as JSON")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--chats", type=int, default=20000, help="generated training conversations")
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="a tiny model and a few steps: checks the script")
    args = p.parse_args()
    args.argv = sys.argv[1:]
    if args.quick:
        args.vocab, args.base_steps, args.sft_steps, args.batch = 512, 6, 6, 4
        args.chats, args.heldout = 400, 10
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data = prepare(args.work, args.vocab, args.quick)
    train_chats, val_chats, heldout = make_task(args.work, args.chats, args.heldout)
    base, sft, speed, commands = train_both(args, data, (train_chats, val_chats))
    figures = {
        "base_accuracy": accuracy(base, heldout, chat=False),
        "sft_accuracy": accuracy(sft, heldout, chat=True),
        "base_tokens_per_s": rates(base),
        "pretrain_adamw_tokens_per_s": rates(speed),
        "sft_tokens_per_s": rates(sft),
        "real_share": real_share(sft, train_chats, min(args.sft_steps, 50)),
    }
    text = report(args, figures, commands)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    print(text)
    print(f"bench_sft: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

"""How much a model learns per token and per second: ferrolm's recipes against nanochat's,
judged on a development text and on a held-out one.

Every contender trains the same widths (d_model 256, 4 layers, 4 heads, context 256,
16 x 256 tokens a step) on the same shards with the same ferrolm tokenizer, each in its own
process, one after the other, with the same number of torch threads:

- ferrolm presets, or variants of them (--contenders, ``LABEL=PRESET+KEY=VALUE+...``):
  `ferrolm train --config PRESET` with only the shape, batch, data and evaluation forced;
- ``nanochat``: nanochat's own `GPT` and `MuonAdamW` with its schedules
  (benches/nanochat_peer.py), from a checkout given with --nanochat.

Two texts score them. The development text (Wikinews: 96 fixed random windows, evaluated
during training) is the one settings are chosen on. The held-out text (by default the
2016 English Wikipedia articles, whose articles the 2021 training dump does not hold; any
text with --heldout) is scored once, at the end of each run, on its first --heldout-windows
consecutive windows, and is never used to choose anything: a preset's setting chosen by its
held-out figure would make that figure worthless. --seeds runs each contender once per seed
(initialisation and training windows) and reports the mean and the spread.

Two races: equal steps (--steps, the schedule by steps) and equal wall-clock (--minutes of
training time, the schedule by time). Data, made once under --work: a tokenizer of --vocab
ids trained on English Wikipedia, the training shards of those articles, and the
development and held-out shards (text the tokenizer never saw). The report is
benches/results/learning.md, every contender in one table, with a plot of development loss
against tokens and seconds.

    python benches/bench_learning.py --nanochat ../nanochat            # both races (~40 min)
    python benches/bench_learning.py --nanochat ../nanochat --races steps --steps 60 --quick

The races may run in separate calls with the same --work (say, the equal-steps races of
some variants at a time while the machine is shared, and the wall-clock race when it is
quiet); `--report-only` then writes the report from the runs there, with the commands that
trained them and --note.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHARED = Path(os.environ.get("FERROLM_SHARED", REPO.parent / "shared"))
WEB = SHARED / "corpora" / "webtext"
TRAIN_TEXTS = ["enwiki_2021_wikiextractor_part01.txt", "enwiki_2021_wikiextractor_part02.txt"]
VAL_TEXT = "enwikinews_wikiextractor.txt"
HELDOUT_TEXT = WEB / "enwiki_2016_wikiextractor.txt"

# The widths every contender trains at (the cpu-small shape with 4 heads).
SHAPE = {
    "model.d_model": 256,
    "model.num_layers": 4,
    "model.num_heads": 4,
    "model.context_length": 256,
    "schedule.batch_size": 16,
    "schedule.tokens_per_step": 0,
    "run.eval_batches": 6,  # 96 validation windows
    "run.device": "cpu",
    "run.seed": 1337,
    "run.progress": "false",
    "run.checkpoint_every": 0,
    "run.keep_best": "false",
    "run.log_every": 10,
}


class ContenderFailed(RuntimeError):
    """A step's process failed (an exception, so that a caller racing several can go on)."""


def run(cmd: list, log: Path, env=None) -> float:
    """Run one contender's process, its output to `log`; return its wall time."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise ContenderFailed(f"{' '.join(map(str, cmd[:4]))} ... failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - t0


def ferrolm(*args) -> list:
    return [sys.executable, "-m", "ferrolm", *args]


def prepare(work: Path, vocab: int, quick: bool, heldout: Path) -> dict:
    """The tokenizer and shards (made once; reused when present)."""
    for path in [*(WEB / n for n in [*TRAIN_TEXTS, VAL_TEXT]), heldout]:
        if not path.is_file():
            sys.exit(f"bench_learning: {path} not found (set FERROLM_SHARED to the folder holding corpora/)")
    train_inputs = [WEB / TRAIN_TEXTS[0]] if quick else [WEB / n for n in TRAIN_TEXTS]
    tok, train, val = work / f"tok{vocab}", work / "data" / "wiki.train", work / "data" / "news.val"
    held = work / "data" / f"{heldout.stem}.heldout"
    if not (tok / "vocab.json").is_file():
        run(
            ferrolm("train-tokenizer", "--input", *train_inputs, "--vocab-size", vocab, "--out", tok),
            work / "tokenizer.log",
        )
    # the shard prefixes have a dot of their own: their sidecar is PREFIX.json, not with_suffix's
    for prefix, inputs, log in ((train, train_inputs, "encode"), (val, [WEB / VAL_TEXT], "encode_val")):
        if not prefix.with_name(prefix.name + ".json").is_file():
            run(ferrolm("encode", "--tokenizer", tok, "--input", *inputs, "--out", prefix), work / f"{log}.log")
    if not held.with_name(held.name + ".json").is_file():
        run(ferrolm("encode", "--tokenizer", tok, "--input", heldout, "--out", held), work / "encode_heldout.log")
    return {"tok": tok, "train": train, "val": val, "heldout": held}


def race_settings(race: str, steps: int, minutes: float) -> dict:
    if race == "steps":
        return {"schedule.max_steps": steps, "schedule.max_time_s": 0.0, "schedule.schedule_by": "steps"}
    return {"schedule.max_steps": 1_000_000, "schedule.max_time_s": minutes * 60, "schedule.schedule_by": "time"}


def parse_contender(spec: str) -> tuple[str, str, dict]:
    """``LABEL=PRESET+KEY=VALUE+...`` (or a bare preset name) as (label, preset, overrides)."""
    label, _, rest = spec.partition("=") if "=" in spec.split("+", 1)[0] else ("", "", spec)
    preset, *sets = rest.split("+")
    return label or preset, preset, dict(s.split("=", 1) for s in sets)


def timed_spec(spec: str, steps: int) -> str:
    """The contender with its warmup kept at its preset's share of the run.

    A time-scheduled run maps elapsed time onto max_steps, which the race sets to `steps`
    (race_settings' stand-in for "until the clock runs out"); unscaled, a preset's warmup
    would be over in the first milliseconds."""
    from ferrolm.lm.config import load_config

    label, preset, overrides = parse_contender(spec)
    s = load_config(preset, [f"{k}={v}" for k, v in overrides.items()]).schedule
    overrides["schedule.warmup_steps"] = round(s.warmup_steps / max(s.max_steps, 1) * steps)
    return f"{label}={preset}+" + "+".join(f"{k}={v}" for k, v in overrides.items())


def train_ferrolm(
    spec: str,
    data: dict,
    out: Path,
    race: dict,
    threads: int,
    eval_every: int,
    shape: dict = SHAPE,
    *,
    seed: int | None = None,
    heldout_windows: int = 0,
    keep_checkpoints: bool = True,
) -> None:
    """One ferrolm contender's run in OUT; with ``heldout_windows``, its held-out score too,
    and then, unless ``keep_checkpoints``, its checkpoints deleted (the report reads the run's
    metrics and score only, and a cpu-small checkpoint is 1.6 GB)."""
    _, preset, overrides = parse_contender(spec)
    sets = {
        **shape,
        **race,
        "data.train": data["train"],
        "data.val": data["val"],
        "data.tokenizer": data["tok"],
        "run.out_dir": out,
        "run.num_threads": threads,
        "run.eval_every": eval_every,
        **({"run.seed": seed} if seed is not None else {}),
        **overrides,
    }
    args = ["train", "--config", preset]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    run(ferrolm(*args), out.parent / f"{out.name}.log")
    if heldout_windows:
        score_heldout(out, data, heldout_windows, threads)
        if not keep_checkpoints:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)


def heldout_tokens(windows: int, context: int = SHAPE["model.context_length"]) -> int:
    """Tokens to read for `windows` whole consecutive windows (each predicts `context` tokens)."""
    return windows * context + 1


def score_heldout(out: Path, data: dict, windows: int, threads: int) -> None:
    """The finished run's loss on the held-out text, in OUT/heldout.json (`ferrolm eval`)."""
    cmd = ["eval", "--checkpoint", out, "--data", data["heldout"], "--max-tokens", heldout_tokens(windows)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = out.parent / f"{out.name}.heldout.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(
            [str(c) for c in ferrolm(*cmd, "--json", "--no-progress")], stdout=subprocess.PIPE, stderr=f, env=env
        )
    if proc.returncode != 0:
        raise ContenderFailed(f"ferrolm eval of {out} failed (exit {proc.returncode}); see {log}")
    result = json.loads(proc.stdout)
    (out / "heldout.json").write_text(
        json.dumps(
            {
                "loss": result["loss"],
                "bits_per_byte": result["bits_per_byte"],
                "tokens": result["tokens"],
                "text": str(data["heldout"]),
                "seconds": time.perf_counter() - t0,
            },
            indent=1,
        )
    )


def train_nanochat(
    nanochat: Path,
    config: Path,
    out: Path,
    race: dict,
    threads: int,
    compile: bool = False,
    env=None,
    lr_scale: str = "auto",
    *,
    data: dict | None = None,
    heldout_windows: int = 0,
) -> None:
    """nanochat's run in OUT (benches/nanochat_peer.py); with ``heldout_windows``, scored on
    ``data``'s held-out shards too."""
    cmd = [sys.executable, HERE / "nanochat_peer.py", "--nanochat", nanochat, "--config", config, "--out", out]
    cmd += ["--threads", threads, "--lr-scale", lr_scale] + (["--compile"] if compile else [])
    if heldout_windows:
        cmd += ["--heldout", data["heldout"], "--heldout-tokens", heldout_tokens(heldout_windows)]
    if race["schedule.schedule_by"] == "steps":
        cmd += ["--max-steps", race["schedule.max_steps"]]
    else:
        cmd += ["--max-time", race["schedule.max_time_s"]]
    run(cmd, out.parent / f"{out.name}.log", env)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def evals(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r.get("val_loss") is not None]


def reached(run_evals: list[dict], loss: float):
    """The first evaluation whose validation loss is at most `loss` (None: never)."""
    return next((r for r in run_evals if r["val_loss"] <= loss), None)


def tokens_to_reach(run_evals: list[dict], loss: float):
    """Tokens at the first evaluation whose validation loss is at most `loss` (None: never)."""
    first = reached(run_evals, loss)
    return first["tokens"] if first else None


def relative_loss(loss: float, ref: float) -> str:
    """How `loss` stands to `ref`, worded by its sign: "2.0 % lower", "9.6 % higher", "level"."""
    percent = 100 * (loss / ref - 1)
    if round(percent, 1) == 0:
        return "level"
    return f"{abs(percent):.1f} % {'higher' if percent > 0 else 'lower'}"


def run_name(label: str, seed: int, seeds: list[int]) -> str:
    """A run's folder name: the label for the first seed, LABEL.seedN for the others."""
    return label if seed == seeds[0] else f"{label}.seed{seed}"


def finished(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").is_file() and (run_dir / "heldout.json").is_file() and bool(evals(run_dir))


def summary(run_dirs: list[Path]) -> dict:
    """One contender over its seeds: the means of its final figures and their spread (max - min)."""
    finals = [evals(d)[-1] for d in run_dirs]
    held = [json.loads((d / "heldout.json").read_text()) for d in run_dirs]
    dev, ho = [f["val_loss"] for f in finals], [h["loss"] for h in held]
    bpb = [h["bits_per_byte"] for h in held if h.get("bits_per_byte")]
    return {
        "seeds": len(run_dirs),
        "step": finals[0]["step"],
        "tokens": finals[0]["tokens"],
        "time_s": statistics.mean(f["time_s"] for f in finals),
        "dev": statistics.mean(dev),
        "dev_spread": max(dev) - min(dev),
        "heldout": statistics.mean(ho),
        "heldout_spread": max(ho) - min(ho),
        "heldout_bpb": statistics.mean(bpb) if bpb else None,
    }


def with_spread(mean: float, spread: float, seeds: int) -> str:
    return f"{mean:.3f}" if seeds == 1 else f"{mean:.3f} ±{spread / 2:.3f}"


def against(summaries: dict, ref: str, key: str = "heldout") -> list[str]:
    """One line per contender: its mean `key` loss against `ref`'s."""
    base = summaries[ref][key]
    text = "held-out" if key == "heldout" else "development"
    lines = []
    for name, sm in summaries.items():
        if name != ref:
            words = relative_loss(sm[key], base)
            lines.append(f"- {name}: {text} loss {words} {'with' if words == 'level' else 'than'} {ref}'s")
    return lines


def lower_than(finals: dict, ref: str) -> list[str]:
    """One line per contender: its final validation loss (a metrics record) against `ref`'s."""
    base = finals[ref]["val_loss"]
    lines = []
    for name, last in finals.items():
        if name != ref:
            words = relative_loss(last["val_loss"], base)
            lines.append(f"- {name}: validation loss {words} {'with' if words == 'level' else 'than'} {ref}'s")
    return lines


def settings_of(label: str, specs: dict) -> str:
    """The contender's preset and its changes, as the table shows them."""
    if label == "nanochat":
        return "nanochat's GPT + MuonAdamW"
    _, preset, overrides = parse_contender(specs[label])
    return " ".join([preset, *(f"{k.split('.', 1)[-1]}={v}" for k, v in overrides.items())])


def plot(results: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    races = [r for r in ("steps", "time") if r in results]
    fig, axes = plt.subplots(1, len(races), figsize=(6.5 * len(races), 4.2), squeeze=False)
    for ax, race in zip(axes[0], races):
        xkey = "tokens" if race == "steps" else "time_s"
        for name, run_dirs in results[race].items():
            ev = evals(run_dirs[0])
            ax.plot([r[xkey] for r in ev], [r["val_loss"] for r in ev], marker=".", label=name)
        ax.set_xlabel("training tokens" if race == "steps" else "training seconds")
        ax.set_ylabel("development loss (nats/token)")
        ax.set_title("equal steps" if race == "steps" else "equal wall-clock")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def precision() -> str:
    """What the contenders compute in: ferrolm's as its presets choose here (run.autocast_bf16
    = auto: bf16 on a CPU with native bf16), nanochat's script float32 on a CPU."""
    import torch

    from ferrolm.lm.device import use_bf16

    if use_bf16("auto", torch.device("cpu")):
        return "ferrolm in bf16 autocast (this CPU has native bf16; its presets' auto), nanochat in float32"
    return "float32"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(results: dict, args, command_lines: list[str]) -> str:
    specs = {parse_contender(spec)[0]: spec for spec in args.contenders.split(",") if spec}
    lines = [
        "# Learning per token and per second: ferrolm's recipes and nanochat's",
        "",
        "Same widths (d_model 256, 4 layers, 4 heads, context 256, 16 x 256 tokens a step) and",
        f"the same {args.vocab:,}-id ferrolm tokenizer and Wikipedia training shards for every contender,",
        f"each in its own process, {precision()}, "
        + ("run as the commands and the note below say." if args.report_only else f"{args.threads} torch threads."),
        "Development loss: the 96 fixed validation windows of Wikinews that settings are chosen on.",
        f"Held-out loss: the first {args.heldout_windows:,} windows of {Path(args.heldout).name}, scored once",
        "after training and never used for a choice. With several seeds: the mean ± half the range.",
        "nanochat: its own `GPT` and `MuonAdamW` with its schedules (benches/nanochat_peer.py).",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores.",
        "",
        *["    " + line for line in command_lines],
        "",
        *([args.note, ""] if args.note else []),
    ]
    for race, runs in results.items():
        title = f"equal steps ({args.steps})" if race == "steps" else f"equal wall-clock ({args.minutes:g} minutes)"
        lines += [
            f"## {title}",
            "",
            "| contender | settings | seeds | steps | tokens | seconds | dev loss | held-out loss | held-out bits/byte |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        sums = {name: summary(run_dirs) for name, run_dirs in runs.items()}
        for name, sm in sums.items():
            bpb = f"{sm['heldout_bpb']:.3f}" if sm["heldout_bpb"] else "-"
            shown = f"{name} (its lrs x{peer_lr_scale(runs[name][0]):.3g})" if name == "nanochat" else name
            lines.append(
                f"| {shown} | {settings_of(name, specs)} | {sm['seeds']} | {sm['step']} | {sm['tokens']:,} | "
                f"{sm['time_s']:.0f} | {with_spread(sm['dev'], sm['dev_spread'], sm['seeds'])} | "
                f"{with_spread(sm['heldout'], sm['heldout_spread'], sm['seeds'])} | {bpb} |"
            )
        lines.append("")
        for ref in ("nanochat", args.baseline):
            if ref in sums:
                lines += against(sums, ref, "heldout") + against(sums, ref, "dev")
        if race == "steps" and "cs336" in runs:
            lines += cs336_tokens(runs, args.steps)
        lines.append("")
    lines += ["![development loss against tokens and seconds](learning.png)", ""]
    return "\n".join(lines[:2] + latest_result(results, args) + lines[2:])


def cs336_tokens(runs: dict, steps: int) -> list[str]:
    """Each contender's tokens to reach cs336's final development loss (first seeds)."""
    final = evals(runs["cs336"][0])[-1]
    lines = []
    for name, run_dirs in runs.items():
        if name != "cs336":
            reached = tokens_to_reach(evals(run_dirs[0]), final["val_loss"])
            lines.append(
                f"- {name}: reaches cs336's final development loss ({final['val_loss']:.3f}) in "
                f"{reached / final['tokens']:.2f} of its tokens"
                if reached
                else f"- {name}: does not reach cs336's final development loss in {steps} steps"
            )
    return lines


def peer_lr_scale(run_dir: Path) -> float:
    """The learning-rate factor nanochat's run trained with (benches/nanochat_peer.py's record)."""
    return float(json.loads((run_dir / "config.json").read_text())["lr_scale"])


def latest_result(results: dict, args) -> list[str]:
    """The summary benches/run.py puts in RESULTS.md: the --main contender against nanochat
    (held-out and development), portable against cpu-small, and the cs336 recipe's tokens and
    step time."""
    rows = []
    for race, runs in results.items():
        sums = {name: summary(run_dirs) for name, run_dirs in runs.items()}
        main = args.main if args.main in sums else next((n for n in sums if n not in ("nanochat", "cs336")), None)
        what = f"equal steps ({args.steps})" if race == "steps" else f"equal wall-clock ({args.minutes:g} min)"
        for ref, label in (("nanochat", "nanochat (GPT + MuonAdamW)"), (args.baseline, args.baseline)):
            if main is None or ref not in sums or ref == main:
                continue
            for key, text in (("heldout", "held-out"), ("dev", "development")):
                ours, peer = sums[main][key], sums[ref][key]
                rows.append(
                    f"| {main}: {text} loss, {what} | {label} | **{relative_loss(ours, peer)}** ({ours:.3f} vs {peer:.3f}) |"
                )
        if "portable" in sums and "cpu-small" in sums:
            ours, ref = sums["portable"]["heldout"], sums["cpu-small"]["heldout"]
            rows.append(
                f"| portable (exports to GGUF and HF): held-out loss, {what} | cpu-small | "
                f"**{relative_loss(ours, ref)}** ({ours:.3f} vs {ref:.3f}) |"
            )
        if main and "cs336" in runs and race == "steps":
            final = evals(runs["cs336"][0])[-1]
            reached = tokens_to_reach(evals(runs[main][0]), final["val_loss"])
            share = f"**{reached / final['tokens']:.2f}x** the tokens" if reached else "not reached"
            rows.append(f"| {main}: tokens to cs336's final development loss | cs336 recipe | {share} |")
        if main and "cs336" in runs and race == "time":
            per_step = {n: sums[n]["time_s"] / max(sums[n]["step"], 1) for n in (main, "cs336")}
            rows.append(
                f"| {main}: time per step (same tokens) | cs336 recipe | "
                f"**{per_step[main] / per_step['cs336']:.2f}x** ({1000 * per_step[main]:.0f} vs "
                f"{1000 * per_step['cs336']:.0f} ms) |"
            )
    return [
        "## Latest result",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores. "
        + ("How the races ran: below." if args.report_only else f"{args.threads} torch threads, {precision()}."),
        "",
        "| job | compared with | result |",
        "|---|---|---|",
        *rows,
        "",
    ]


def main() -> None:
    try:
        race_all()
    except ContenderFailed as e:
        sys.exit(f"bench_learning: {e}")


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanochat", type=Path, help="a checkout of nanochat's repository (the peer); omit to skip it")
    ap.add_argument(
        "--nanochat-lr-scale",
        default="auto",
        help="the peer's learning-rate factor: 'auto' (its script's sqrt(batch tokens / 2^19)) or a number "
        "(1: its learning rates as written, unscaled)",
    )
    ap.add_argument(
        "--contenders",
        default="cs336,cpu-small,portable",
        help="ferrolm presets, comma-separated; LABEL=PRESET+KEY=VALUE+... adds settings "
        "(muon=cpu-small+optimizer.name=muon+optimizer.lr=0.02)",
    )
    ap.add_argument("--races", default="steps,time", help="steps, time or both")
    ap.add_argument(
        "--seeds", default="1337", help="seeds, comma-separated: each contender runs once per seed (mean and spread)"
    )
    ap.add_argument("--heldout", type=Path, default=HELDOUT_TEXT, help="the held-out text (never used for a choice)")
    ap.add_argument("--heldout-windows", type=int, default=256, help="consecutive windows of it to score")
    ap.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each ferrolm run's checkpoints (by default deleted once its held-out score is written)",
    )
    ap.add_argument("--main", default="cpu-small", help="the contender the summary sets against nanochat")
    ap.add_argument("--baseline", default="cpu-small", help="the contender every variant is worded against")
    ap.add_argument("--steps", type=int, default=250, help="steps of the equal-steps race")
    ap.add_argument("--minutes", type=float, default=6.0, help="training minutes of the equal-wall-clock race")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every contender")
    ap.add_argument("--vocab", type=int, default=8192, help="tokenizer size")
    ap.add_argument("--eval-every", type=int, default=25, help="steps between validation evaluations")
    ap.add_argument("--work", type=Path, default=REPO / "benches" / "out" / "learning", help="data and runs")
    ap.add_argument("--quick", action="store_true", help="one Wikipedia file for the tokenizer and shards")
    ap.add_argument("--results", type=Path, default=HERE / "results", help="where learning.md and learning.png go")
    ap.add_argument("--note", default="", help="a sentence for the report (how the races were run)")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write the report from the runs already under --work (races run in separate calls)",
    )
    return ap


def race_all() -> None:
    args = arg_parser().parse_args()
    presets = [p for p in args.contenders.split(",") if p]
    races = [r for r in args.races.split(",") if r]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    command = "python benches/bench_learning.py " + " ".join(sys.argv[1:])
    if args.report_only:
        results = {race: finished_runs(args.work / race, presets, seeds) for race in races}
        write_report(results, args, commands(args.work, races))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    data = prepare(args.work, args.vocab, args.quick, args.heldout)
    for race in races:
        settings = race_settings(race, args.steps, args.minutes)
        (args.work / race).mkdir(parents=True, exist_ok=True)
        with open(args.work / race / "commands.txt", "a") as f:
            f.write(command + "\n")
        for seed in seeds:
            for spec in presets:
                out = args.work / race / run_name(parse_contender(spec)[0], seed, seeds)
                if finished(out):
                    print(f"[{race}] {out.name}: finished before, kept", file=sys.stderr, flush=True)
                    continue
                print(f"[{race}] {out.name} ...", file=sys.stderr, flush=True)
                if race == "time":
                    spec = timed_spec(spec, settings["schedule.max_steps"])
                train_ferrolm(
                    spec,
                    data,
                    out,
                    settings,
                    args.threads,
                    args.eval_every,
                    seed=seed,
                    heldout_windows=args.heldout_windows,
                    keep_checkpoints=args.keep_checkpoints,
                )
            out = args.work / race / run_name("nanochat", seed, seeds)
            if args.nanochat and not finished(out):
                # The peer reads data, shape, seed and validation windows from a ferrolm run's config.
                base = args.work / race / run_name(parse_contender(presets[0])[0], seed, seeds) / "config.toml"
                print(f"[{race}] {out.name} ...", file=sys.stderr, flush=True)
                train_nanochat(
                    args.nanochat,
                    base,
                    out,
                    settings,
                    args.threads,
                    lr_scale=args.nanochat_lr_scale,
                    data=data,
                    heldout_windows=args.heldout_windows,
                )
    if args.nanochat:
        presets = [*presets, "nanochat"]
    results = {race: finished_runs(args.work / race, presets, seeds) for race in races}
    write_report(results, args, [command])


def finished_runs(race_dir: Path, presets: list[str], seeds: list[int]) -> dict:
    """The finished runs of one race under --work: {label: [run folder of each seed done]},
    the contenders named, then nanochat's if there. A contender without its first seed's
    run is left out of this race (one race may hold fewer contenders than another), saying
    so; the other seeds count where they finished (the table says how many each has)."""
    labels = [parse_contender(spec)[0] for spec in presets if spec != "nanochat"] + ["nanochat"]
    runs = {}
    for label in labels:
        done = [race_dir / run_name(label, seed, seeds) for seed in seeds]
        done = [d for d in done if finished(d)]
        if done and done[0].name == label:
            runs[label] = done
        elif label != "nanochat":
            print(f"bench_learning: no finished run of {label} under {race_dir}: left out", file=sys.stderr)
    if not any(label != "nanochat" for label in runs):
        raise ContenderFailed(f"no finished run of {', '.join(labels[:-1])} under {race_dir}")
    return runs


def commands(work: Path, races: list[str]) -> list[str]:
    """The commands that trained the races' runs (each race's calls, in order, once each)."""
    lines = []
    for race in races:
        path = work / race / "commands.txt"
        for line in path.read_text().splitlines() if path.is_file() else []:
            if line and line not in lines:
                lines.append(line)
    return lines


def write_report(results: dict, args, command_lines: list[str]) -> None:
    args.results.mkdir(parents=True, exist_ok=True)
    plot(results, args.results / "learning.png")
    (args.results / "learning.md").write_text(report(results, args, command_lines))
    print((args.results / "learning.md").read_text())


if __name__ == "__main__":
    main()

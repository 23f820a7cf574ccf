"""How much a model learns per token and per second: ferrolm's recipes against nanochat's.

Every contender trains the same widths (d_model 256, 4 layers, 4 heads, context 256,
16 x 256 tokens a step) on the same shards with the same ferrolm tokenizer and is scored
on the same validation windows, each in its own process, one after the other, with the
same number of torch threads:

- ``cs336``, ``cpu-small``, ``portable`` (or any preset named with --contenders): `ferrolm
  train --config PRESET` with only the shape, batch, data and evaluation forced (portable is
  cpu-small less the switches llama.cpp lacks: the report says what that costs);
- ``nanochat``: nanochat's own `GPT` and `MuonAdamW` with its schedules
  (benches/nanochat_peer.py), from a checkout given with --nanochat.

Two races: equal steps (--steps, the schedule by steps) and equal wall-clock (--minutes
of training time, the schedule by time). Data, made once under --work: a tokenizer of
--vocab ids trained on English Wikipedia, the training shards of those articles, and
validation shards of Wikinews (text the tokenizer never saw). The report is
benches/results/learning.md with a plot of validation loss against tokens and seconds.

    python benches/bench_learning.py --nanochat ../nanochat            # both races (~40 min)
    python benches/bench_learning.py --nanochat ../nanochat --races steps --steps 60 --quick

The races may run in separate calls with the same --work (say, the equal-steps race while
the machine is shared and the wall-clock race when it is quiet); `--report-only` then
writes the report from the runs there, with the commands that trained them and --note.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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


def prepare(work: Path, vocab: int, quick: bool) -> dict:
    """The tokenizer and shards (made once; reused when present)."""
    for name in [*TRAIN_TEXTS, VAL_TEXT]:
        if not (WEB / name).is_file():
            sys.exit(f"bench_learning: {WEB / name} not found (set FERROLM_SHARED to the folder holding corpora/)")
    train_inputs = [WEB / TRAIN_TEXTS[0]] if quick else [WEB / n for n in TRAIN_TEXTS]
    tok, train, val = work / f"tok{vocab}", work / "data" / "wiki.train", work / "data" / "news.val"
    if not (tok / "vocab.json").is_file():
        run(
            ferrolm("train-tokenizer", "--input", *train_inputs, "--vocab-size", vocab, "--out", tok),
            work / "tokenizer.log",
        )
    # the shard prefixes have a dot of their own: their sidecar is PREFIX.json, not with_suffix's
    if not train.with_name(train.name + ".json").is_file():
        run(ferrolm("encode", "--tokenizer", tok, "--input", *train_inputs, "--out", train), work / "encode.log")
    if not val.with_name(val.name + ".json").is_file():
        run(ferrolm("encode", "--tokenizer", tok, "--input", WEB / VAL_TEXT, "--out", val), work / "encode_val.log")
    return {"tok": tok, "train": train, "val": val}


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
    spec: str, data: dict, out: Path, race: dict, threads: int, eval_every: int, shape: dict = SHAPE
) -> None:
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
        **overrides,
    }
    args = ["train", "--config", preset]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    run(ferrolm(*args), out.parent / f"{out.name}.log")


def train_nanochat(
    nanochat: Path,
    config: Path,
    out: Path,
    race: dict,
    threads: int,
    compile: bool = False,
    env=None,
    lr_scale: str = "auto",
) -> None:
    cmd = [sys.executable, HERE / "nanochat_peer.py", "--nanochat", nanochat, "--config", config, "--out", out]
    cmd += ["--threads", threads, "--lr-scale", lr_scale] + (["--compile"] if compile else [])
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


def lower_than(finals: dict, ref: str) -> list[str]:
    """One line per contender: its final validation loss against `ref`'s."""
    base = finals[ref]["val_loss"]
    lines = []
    for name, last in finals.items():
        if name != ref:
            words = relative_loss(last["val_loss"], base)
            lines.append(f"- {name}: validation loss {words} {'with' if words == 'level' else 'than'} {ref}'s")
    return lines


def plot(results: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    races = [r for r in ("steps", "time") if r in results]
    fig, axes = plt.subplots(1, len(races), figsize=(6.5 * len(races), 4.2), squeeze=False)
    for ax, race in zip(axes[0], races):
        xkey = "tokens" if race == "steps" else "time_s"
        for name, run_dir in results[race].items():
            ev = evals(run_dir)
            ax.plot([r[xkey] for r in ev], [r["val_loss"] for r in ev], marker=".", label=name)
        ax.set_xlabel("training tokens" if race == "steps" else "training seconds")
        ax.set_ylabel("validation loss (nats/token)")
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


def portable_cost(finals: dict) -> list[str]:
    """The portable preset's final loss against cpu-small's, when both ran: what leaving out
    the switches llama.cpp lacks costs."""
    if "portable" not in finals or "cpu-small" not in finals:
        return []
    return lower_than({name: finals[name] for name in ("cpu-small", "portable")}, "cpu-small")


def report(results: dict, args, command_lines: list[str]) -> str:
    lines = [
        "# Learning per token and per second: ferrolm's recipes and nanochat's",
        "",
        "Same widths (d_model 256, 4 layers, 4 heads, context 256, 16 x 256 tokens a step),",
        f"same {args.vocab:,}-id ferrolm tokenizer and Wikipedia shards, the same 96 validation windows",
        f"of Wikinews; each contender in its own process, {precision()}, "
        + (
            "run as the commands and the note below say."
            if args.report_only
            else f"one after the other, {args.threads} torch threads."
        ),
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
            "| contender | steps | tokens | seconds | val loss | bits/byte |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        finals = {}
        for name, run_dir in runs.items():
            last = evals(run_dir)[-1]
            finals[name] = last
            bpb = f"{last['val_bpb']:.3f}" if last.get("val_bpb") else "-"
            shown = f"{name} (its lrs x{peer_lr_scale(run_dir):.3g})" if name == "nanochat" else name
            lines.append(
                f"| {shown} | {last['step']} | {last['tokens']:,} | {last['time_s']:.0f} | {last['val_loss']:.3f} | {bpb} |"
            )
        lines.append("")
        if "nanochat" in finals:
            lines += lower_than(finals, "nanochat")
        lines += portable_cost(finals)
        if race == "steps" and "cs336" in finals:
            target = finals["cs336"]["val_loss"]
            for name, run_dir in runs.items():
                if name == "cs336":
                    continue
                reached = tokens_to_reach(evals(run_dir), target)
                if reached:
                    share = reached / finals["cs336"]["tokens"]
                    lines.append(f"- {name}: reaches cs336's final loss ({target:.3f}) in {share:.2f} of its tokens")
                else:
                    lines.append(f"- {name}: does not reach cs336's final loss ({target:.3f}) in {args.steps} steps")
        lines.append("")
    lines += ["![validation loss against tokens and seconds](learning.png)", ""]
    return "\n".join(lines[:2] + latest_result(results, args) + lines[2:])


def peer_lr_scale(run_dir: Path) -> float:
    """The learning-rate factor nanochat's run trained with (benches/nanochat_peer.py's record)."""
    return float(json.loads((run_dir / "config.json").read_text())["lr_scale"])


def latest_result(results: dict, args) -> list[str]:
    """The summary benches/run.py puts in RESULTS.md: the main ferrolm contender (cpu-small,
    else the last one named) against nanochat and against the cs336 recipe."""
    names = [n for n in next(iter(results.values()), {}) if n not in ("nanochat", "cs336")]
    if not names:
        return []
    main = "cpu-small" if "cpu-small" in names else names[-1]
    rows = []
    for race, runs in results.items():
        finals = {name: evals(run_dir)[-1] for name, run_dir in runs.items()}
        what = f"equal steps ({args.steps})" if race == "steps" else f"equal wall-clock ({args.minutes:g} min)"
        if "nanochat" in finals:
            ours, peer = finals[main]["val_loss"], finals["nanochat"]["val_loss"]
            rows.append(
                f"| {main}: val loss, {what} | nanochat (GPT + MuonAdamW) | "
                f"**{relative_loss(ours, peer)}** ({ours:.3f} vs {peer:.3f}) |"
            )
        if "portable" in finals and "cpu-small" in finals:
            ours, ref = finals["portable"]["val_loss"], finals["cpu-small"]["val_loss"]
            rows.append(
                f"| portable (exports to GGUF and HF): val loss, {what} | cpu-small | "
                f"**{relative_loss(ours, ref)}** ({ours:.3f} vs {ref:.3f}) |"
            )
        if "cs336" in finals and race == "steps":
            reached = tokens_to_reach(evals(runs[main]), finals["cs336"]["val_loss"])
            share = f"**{reached / finals['cs336']['tokens']:.2f}x** the tokens" if reached else "not reached"
            rows.append(f"| {main}: tokens to cs336's final val loss | cs336 recipe | {share} |")
        if "cs336" in finals and race == "time":
            per_step = {n: finals[n]["time_s"] / max(finals[n]["step"], 1) for n in (main, "cs336")}
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
    command = "python benches/bench_learning.py " + " ".join(sys.argv[1:])
    if args.report_only:
        results = {race: finished_runs(args.work / race, presets) for race in races}
        write_report(results, args, commands(args.work, races))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    data = prepare(args.work, args.vocab, args.quick)
    results: dict = {}
    for race in races:
        settings = race_settings(race, args.steps, args.minutes)
        runs = results.setdefault(race, {})
        (args.work / race).mkdir(parents=True, exist_ok=True)
        with open(args.work / race / "commands.txt", "a") as f:
            f.write(command + "\n")
        for spec in presets:
            label = parse_contender(spec)[0]
            out = args.work / race / label
            print(f"[{race}] {label} ...", file=sys.stderr, flush=True)
            if race == "time":
                spec = timed_spec(spec, settings["schedule.max_steps"])
            train_ferrolm(spec, data, out, settings, args.threads, args.eval_every)
            runs[label] = out
        if args.nanochat:
            # The peer reads data, shape and validation windows from a ferrolm run's config.
            base = runs[parse_contender(presets[0])[0]] / "config.toml"
            out = args.work / race / "nanochat"
            print(f"[{race}] nanochat ...", file=sys.stderr, flush=True)
            train_nanochat(args.nanochat, base, out, settings, args.threads, lr_scale=args.nanochat_lr_scale)
            runs["nanochat"] = out
    write_report(results, args, [command])


def finished_runs(race_dir: Path, presets: list[str]) -> dict:
    """The runs of one race under --work: each contender named, then nanochat's, if there."""
    labels = [parse_contender(spec)[0] for spec in presets] + ["nanochat"]
    runs = {label: race_dir / label for label in labels if (race_dir / label / "metrics.jsonl").is_file()}
    missing = [label for label in labels[:-1] if label not in runs]
    if missing:
        raise ContenderFailed(f"no finished run of {', '.join(missing)} under {race_dir}")
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

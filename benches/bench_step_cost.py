"""What a recipe's training step costs per token against another's, at the learning
benchmark's shape and in each precision: `ferrolm train` runs of the contenders taking
turns, so that a change in the machine's load falls on every contender alike.

Each run trains --steps steps on bench_learning's shards (its --work; made there first)
with the shape, batch and threads forced and no evaluation; its speed is the median of the
tokens/s of its logged intervals after the first --skip steps (warmup, the first GEMM
choice). Rounds alternate the contenders (A B A B ...); the figure is the median over the
rounds, reported as each contender's time per token against the first one's.

    python benches/bench_step_cost.py --contenders cpu-small,cs336 --precisions fp32,bf16

The report goes to benches/results/step_cost.md. bf16 autocast on a CPU without native
bf16 (no AVX512-BF16 or AMX) is emulated and many times slower than float32; its figure
there says what the recipe costs in that mode, not what a bf16 CPU would see.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_learning  # noqa: E402  (the learning benchmark's shape, data and contender specs)

PRECISIONS = {"fp32": "false", "bf16": "true"}
WORK = HERE / "out" / "learning"


def run_speed(spec: str, data: dict, out: Path, precision: str, steps: int, threads: int, skip: int) -> float:
    """One run's median tokens/s over its logged intervals after step `skip`."""
    label, preset, overrides = bench_learning.parse_contender(spec)
    race = {"schedule.max_steps": steps, "schedule.max_time_s": 0.0, "schedule.schedule_by": "steps"}
    shape = {**bench_learning.SHAPE, "run.eval_every": 0, "run.eval_batches": 1, "run.log_every": 5}
    # warmup shapes the learning rate, not the step: one step of it fits any --steps
    overrides = {**overrides, "run.autocast_bf16": PRECISIONS[precision], "run.eval_at_start": "false"}
    overrides["schedule.warmup_steps"] = 1
    spec = f"{label}={preset}+" + "+".join(f"{k}={v}" for k, v in overrides.items())
    shutil.rmtree(out, ignore_errors=True)
    bench_learning.train_ferrolm(spec, data, out, race, threads, 0, shape)
    rates = [r["tokens_per_s"] for r in bench_learning.records(out) if r["step"] > skip and r.get("tokens_per_s")]
    if not rates:
        raise bench_learning.ContenderFailed(f"{out}: no timed interval after step {skip}")
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--contenders", default="cpu-small,cs336", help="the first is the reference; specs as in bench_learning"
    )
    ap.add_argument("--precisions", default="fp32,bf16", help="fp32, bf16 (autocast) or both")
    ap.add_argument("--steps", type=int, default=40, help="steps of each run")
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the timing (warmup)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each contender, taking turns")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every run")
    ap.add_argument("--work", type=Path, default=WORK, help="bench_learning's data folder (made when absent)")
    ap.add_argument("--results", type=Path, default=HERE / "results", help="where step_cost.md goes")
    args = ap.parse_args()
    specs = [s for s in args.contenders.split(",") if s]
    labels = [bench_learning.parse_contender(s)[0] for s in specs]
    data = bench_learning.prepare(args.work, 8192, False, bench_learning.HELDOUT_TEXT)
    speeds: dict = {}
    for precision in [p for p in args.precisions.split(",") if p]:
        if precision not in PRECISIONS:
            sys.exit(f"bench_step_cost: --precisions takes {', '.join(PRECISIONS)}, got {precision!r}")
        for r in range(args.rounds):
            for spec, label in zip(specs, labels):
                out = args.work / "step_cost" / f"{label}.{precision}"
                rate = run_speed(spec, data, out, precision, args.steps, args.threads, args.skip)
                speeds.setdefault(precision, {}).setdefault(label, []).append(rate)
                print(f"[{precision}] round {r + 1}: {label} {rate:,.0f} tokens/s", file=sys.stderr, flush=True)
    write_report(speeds, specs, labels, args)


def write_report(speeds: dict, specs: list[str], labels: list[str], args) -> None:
    ref = labels[0]
    lines = [
        "# Training step cost per token, recipe against recipe",
        "",
        "## Latest result",
        "",
        f"Machine: {bench_learning.cpu_model()}, {os.cpu_count()} cores. {args.threads} torch threads.",
        "",
        "| job | compared with | result |",
        "|---|---|---|",
    ]
    table = [
        "| precision | contender | settings | tokens/s (median of rounds) | time per token |",
        "|---|---|---|---:|---:|",
    ]
    for precision, by_label in speeds.items():
        base = statistics.median(by_label[ref])
        for spec, label in zip(specs, labels):
            rate = statistics.median(by_label[label])
            settings = bench_learning.settings_of(label, dict(zip(labels, specs)))
            table.append(f"| {precision} | {label} | {settings} | {rate:,.0f} | {base / rate:.2f}x |")
            if label != ref:
                lines.append(
                    f"| {label}: training step per token ({precision}) | {ref} | **{base / rate:.2f}x** the time "
                    f"({rate:,.0f} vs {base:,.0f} tokens/s) |"
                )
    command = "python benches/bench_step_cost.py " + " ".join(sys.argv[1:])
    lines += [
        "",
        f"Each contender trains {args.steps} steps at the learning benchmark's shape (d_model 256, 4 layers, "
        f"4 heads, context 256, 16 x 256 tokens a step) on its shards, {args.rounds} rounds taking turns; a run's "
        f"speed is the median tokens/s of its 5-step intervals after step {args.skip}, the figure the median over "
        "the rounds. Time per token is against the first contender's.",
        "",
        "    " + command,
        "",
        *table,
        "",
    ]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "step_cost.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

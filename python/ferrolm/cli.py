"""The `ferrolm` command: one subcommand per job.

Each subcommand lives in its own function that parses nothing itself: `build_parser`
declares the arguments, `main` dispatches. Heavy imports (torch) happen inside the
subcommand that needs them, so `ferrolm --help` is instant.
"""

from __future__ import annotations

import argparse
import sys

import ferrolm


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferrolm",
        description="From raw text to a trained language model: train a BPE tokenizer, "
        "encode a corpus into uint16 shards, train a Transformer LM, sample from it.",
    )
    parser.add_argument("--version", action="version", version=f"ferrolm {ferrolm.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Subcommands register themselves here (see the add_*_command functions below).
    for add in COMMANDS:
        add(sub)
    return parser


COMMANDS: list = []


# --- train / plot (the LM training loop; ferrolm.train) -----------------------------------


def add_train_command(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a Transformer LM on token shards",
        description="Train ferrolm's Transformer LM on shards written by `ferrolm encode`. "
        "Config: a TOML file or a preset (%s), any field overridable with --set section.field=value. "
        "Multi-process: torchrun --nproc_per_node N -m ferrolm train ..." % ", ".join(_preset_names()),
    )
    p.add_argument("--config", "-c", metavar="FILE|PRESET", help="TOML config file or preset name")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. --set optimizer.lr=3e-4 (repeatable)")
    p.add_argument("--resume", metavar="RUN_DIR|CKPT", help="continue a run (its config.toml is used; --set still applies)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.set_defaults(run=_run_train)


def _preset_names() -> list:
    from ferrolm.train_config import preset_names

    return preset_names()


def _run_train(args) -> int:
    from pathlib import Path

    from ferrolm.train_config import CONFIG_NAME, load_config

    config = args.config
    overrides = list(args.overrides)
    if args.resume and config is None:
        rdir = Path(args.resume)
        if not rdir.is_dir():  # a checkpoint file: RUN/checkpoints/step_N.pt or RUN/best.pt
            rdir = rdir.parent.parent if rdir.parent.name == "checkpoints" else rdir.parent
        config = rdir / CONFIG_NAME
        if not config.is_file():
            raise FileNotFoundError(f"--resume {args.resume}: {config} not found (pass --config too)")
        overrides = [f"run.out_dir={rdir}"] + overrides
    if config is None and not args.print_config:
        raise ValueError("give --config FILE|PRESET (presets: %s) or --resume RUN_DIR" % ", ".join(_preset_names()))
    cfg = load_config(config, overrides)
    if args.print_config:
        from ferrolm.train_config import to_toml

        print(to_toml(cfg), end="")
        return 0
    from ferrolm.train import train

    summary = train(cfg, resume=args.resume)
    import os

    if summary.status in ("done", "time") and summary.final_val_loss is not None and os.environ.get("RANK", "0") == "0":
        print(f"val loss {summary.final_val_loss:.4f} at step {summary.step}; checkpoint {summary.last_checkpoint}")
    return {"done": 0, "time": 0, "interrupted": 130, "nan": 3}.get(summary.status, 1)


def add_plot_command(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="plot loss curves of one or more training runs",
        description="Plot train and validation loss from RUN_DIR/metrics.jsonl (several runs are overlaid) to a PNG.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    p.add_argument("--x", choices=["step", "time", "tokens"], default="step", help="x axis (default: step)")
    p.add_argument("--out", "-o", metavar="PNG", help="output path (default: RUN_DIR/loss_<x>.png)")
    p.add_argument("--label", action="append", default=None, help="legend label per run (repeatable, in order)")
    p.add_argument("--title", help="figure title")
    p.set_defaults(run=_run_plot)


def _run_plot(args) -> int:
    from ferrolm.train import plot_run

    path = plot_run(args.runs, x=args.x, out=args.out, labels=args.label, title=args.title)
    print(path)
    return 0


COMMANDS.extend([add_train_command, add_plot_command])

# --- end train / plot ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"ferrolm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

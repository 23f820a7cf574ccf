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

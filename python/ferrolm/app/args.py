"""The arguments several `ferrolm` commands share, each group added by one function, so an
option means the same and reads the same wherever it appears.

Imports only the standard library: `ferrolm --help` builds every subparser.
"""

from __future__ import annotations

import argparse

CHECKPOINT_HELP = (
    "a run folder of `ferrolm train` (its best.pt, else its newest checkpoint), a checkpoint .pt, "
    "or a folder or .safetensors file written by `ferrolm export`"
)
TOKENIZER_HELP = "the tokenizer folder the model was trained with (default: the one its checkpoint names)"
DEVICE_HELP = "auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:1, mps ..."


def int_at_least(low: int):
    """An argparse type: an int >= ``low``; argparse names the option in the error (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_model(p, *, tokenizer_help: str = TOKENIZER_HELP) -> None:
    """--checkpoint (required) and --tokenizer: the model a command loads."""
    p.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    add_tokenizer(p, help=tokenizer_help)


def add_tokenizer(p, *, required: bool = False, help: str = TOKENIZER_HELP) -> None:
    """--tokenizer DIR."""
    p.add_argument("--tokenizer", required=required, default=None, metavar="DIR", help=help)


def add_sampling(
    p,
    *,
    max_new_tokens: int = 256,
    seed: int | None = None,
    seed_help: str = "random seed in [0, 2**63) (default: a fresh one, printed on stderr unless --temperature is 0)",
    distribution: bool = True,
) -> None:
    """--max-new-tokens and --seed, and with ``distribution`` --temperature, --top-k, --top-p."""
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        metavar="N",
        help=f"tokens to generate per sample (default {max_new_tokens})",
    )
    if distribution:
        p.add_argument(
            "--temperature",
            type=float,
            default=1.0,
            metavar="T",
            help="softmax temperature, >= 0; 0 = greedy (default 1.0)",
        )
        p.add_argument(
            "--top-k", type=int, default=None, metavar="K", help="sample among the K most probable tokens only"
        )
        p.add_argument(
            "--top-p",
            type=float,
            default=None,
            metavar="P",
            help="nucleus sampling: the smallest most-probable set with mass >= P, P in (0, 1]",
        )
    p.add_argument("--seed", type=int, default=seed, metavar="S", help=seed_help)


def add_device(p) -> None:
    """--device: where the model runs."""
    p.add_argument("--device", default="auto", help=DEVICE_HELP)


def add_threads(p, help: str = "threads (default: all cores)") -> None:
    """--threads N."""
    p.add_argument("--threads", type=int, default=None, metavar="N", help=help)


def add_progress(p, help: str = "no progress bar on stderr") -> None:
    """--no-progress."""
    p.add_argument("--no-progress", action="store_true", help=help)


def add_column(p) -> None:
    """--column / --jsonl-field: where a document's text is in JSON Lines and Parquet inputs."""
    p.add_argument(
        "--column",
        "--jsonl-field",
        default="text",
        dest="column",
        metavar="NAME",
        help="Parquet column or JSON Lines field holding the text (default: text)",
    )


def add_inputs(p, *, help: str, required: bool = True) -> None:
    """--input FILE... (paths, globs, folders) and --column."""
    p.add_argument("--input", nargs="+", required=required, default=None, metavar="FILE", help=help)
    add_column(p)


def add_output(p, *, help: str, metavar: str = "FILE", required: bool = False, default=None, force_help=None) -> None:
    """--out, and --force when ``force_help`` says what it lets --out replace."""
    p.add_argument("--out", "-o", required=required, default=default, metavar=metavar, help=help)
    if force_help:
        add_force(p, force_help)


def add_force(p, help: str) -> None:
    """--force: replace an output that this command did not write (never one of its inputs)."""
    p.add_argument("--force", action="store_true", help=help)


def add_overrides(p, help: str) -> None:
    """--set KEY=VALUE (repeatable): a training config field."""
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_split(p, *, part_help: str, ray_help: str) -> None:
    """--part I/N, --ray and --parts N: a job split into parts."""
    p.add_argument("--part", default=None, metavar="I/N", help=part_help)
    p.add_argument("--ray", action="store_true", help=ray_help)
    p.add_argument(
        "--parts", type=int, default=None, metavar="N", help="with --ray: number of parts (default: the cluster's CPUs)"
    )

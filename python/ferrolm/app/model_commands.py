"""The model commands of `ferrolm` besides train and generate: export, eval, demo, download.

Argument parsing and printing only; each command imports what it runs (torch included)
when it runs, so `ferrolm --help` stays fast.
"""

from __future__ import annotations

import sys

from ferrolm.app.args import (
    add_device,
    add_model,
    add_output,
    add_overrides,
    add_progress,
    add_sampling,
    int_at_least,
    positive_number,
)

COMMANDS: list = []


# ---------------------------------------------------------------------------------------
# export, eval (ferrolm.lm.export, ferrolm.lm.evaluate)
# ---------------------------------------------------------------------------------------


def add_export_command(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a checkpoint as a Hugging Face model folder (or a safetensors file)",
        description="Write a folder that transformers loads with no ferrolm code: config.json (LlamaForCausalLM), "
        "model.safetensors, generation_config.json and the tokenizer files (AutoModelForCausalLM and "
        "AutoTokenizer .from_pretrained(DIR)); a model no transformers architecture computes gets ferrolm's "
        "modeling_ferrolm.py beside them (from_pretrained(DIR, trust_remote_code=True)). --format safetensors "
        "writes the weights alone under ferrolm's names, with the model config in the metadata (`ferrolm generate --checkpoint FILE` reads it). "
        "--format gguf writes one GGUF file for llama.cpp and the tools built on it, tokenizer included "
        '(needs the gguf extra: pip install "ferrolm[gguf]").',
    )
    add_model(p)
    add_output(
        p,
        required=True,
        metavar="DIR|FILE",
        help="output folder (or .safetensors / .gguf file)",
        force_help="replace an --out that is not an earlier export (of this model, for hf); never the export's input",
    )
    p.add_argument(
        "--format", default="hf", choices=["hf", "safetensors", "gguf"], help="hf (default), safetensors, gguf"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "f32", "bf16", "f16", "q8_0"],
        help="the weights' type: float32 (f32), bfloat16 (bf16) or float16 (f16); gguf also q8_0 "
        "(8-bit blocks of 32 with a float16 scale; norms stay float32)",
    )
    p.add_argument(
        "--no-remote-code",
        dest="remote_code",
        action="store_false",
        help="hf: refuse a model that no transformers architecture computes (value embeddings, x0 mixing, ReLU^2, "
        "soft-capped logits, ...) instead of writing it with ferrolm's modeling file (trust_remote_code=True)",
    )
    p.set_defaults(run=_run_export)


def _run_export(args) -> int:
    from ferrolm.lm.export import export_hf, export_safetensors
    from ferrolm.lm.gguf_export import DTYPE_ALIASES, export_gguf  # the gguf package is imported when it writes

    if args.format == "safetensors":
        out = export_safetensors(args.checkpoint, args.out, force=args.force)
    elif args.format == "gguf":
        out = export_gguf(args.checkpoint, args.out, args.tokenizer, dtype=args.dtype, force=args.force)
    else:
        dtype = {short: long for long, short in DTYPE_ALIASES.items()}.get(args.dtype, args.dtype)
        out = export_hf(
            args.checkpoint, args.out, args.tokenizer, dtype=dtype, force=args.force, remote_code=args.remote_code
        )
        _say_remote_code(out)
    print(out)
    return 0


def _say_remote_code(out) -> None:
    from ferrolm.lm.hf_remote import MODELING_FILE, is_remote_folder

    if is_remote_folder(out):
        print(
            f"{out}: no transformers architecture computes this model; it runs from the folder's {MODELING_FILE}: "
            "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)",
            file=sys.stderr,
        )


def add_eval_command(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="score a checkpoint on token shards (loss, perplexity, bits per byte) or on lm-eval tasks",
        description="Run the model over the shards in consecutive context-length windows and report the mean loss "
        "(nats/token), perplexity, bits per byte (total nats / ln 2 / UTF-8 bytes of the text; special tokens "
        "count 0 bytes; needs the tokenizer) and tokens/s.",
    )
    add_model(p)
    p.add_argument(
        "--data",
        nargs="+",
        metavar="SHARD",
        help="shard prefix(es), as for training; or conversation files (.jsonl, .parquet): the loss over the "
        "assistant's tokens",
    )
    p.add_argument(
        "--batch-size",
        type=int_at_least(1),
        default=8,
        metavar="B",
        help="windows (or lm-eval requests) per forward pass (default 8)",
    )
    p.add_argument(
        "--max-tokens", type=int_at_least(2), default=None, metavar="N", help="score only the first N tokens (N >= 2)"
    )
    add_device(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_progress(p)
    tasks = p.add_argument_group(
        'lm-evaluation-harness tasks (instead of --data; needs the eval extra: pip install "ferrolm[eval]")'
    )
    tasks.add_argument("--tasks", metavar="A,B", help="lm-eval task names, comma-separated (hellaswag,arc_easy,...)")
    tasks.add_argument(
        "--num-fewshot", type=int_at_least(0), default=None, metavar="N", help="few-shot examples per prompt"
    )
    tasks.add_argument(
        "--limit", type=positive_number, default=None, metavar="N", help="examples per task (a fraction if < 1)"
    )
    tasks.add_argument("--include-path", default=None, metavar="DIR", help="a folder of task YAMLs of your own")
    tasks.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="prompts as conversations, rendered with the chat template (a chat model: --config sft)",
    )
    p.set_defaults(run=_run_eval)


def _run_eval(args) -> int:
    import json

    from ferrolm.lm.evaluate import evaluate

    if bool(args.data) == bool(args.tasks):
        raise ValueError("give --data SHARD (loss, bits per byte) or --tasks NAMES (lm-eval tasks)")
    if args.tasks:
        if args.max_tokens is not None:
            raise ValueError("--max-tokens is for --data; with --tasks, --limit caps the examples per task")
        return _run_eval_tasks(args)
    for flag, value in (
        ("--num-fewshot", args.num_fewshot),
        ("--limit", args.limit),
        ("--include-path", args.include_path),
        ("--apply-chat-template", args.apply_chat_template or None),
    ):
        if value is not None:
            raise ValueError(f"{flag} is for --tasks (lm-eval tasks), not --data")
    data = args.data if len(args.data) > 1 else args.data[0]
    r = evaluate(
        args.checkpoint,
        data,
        args.tokenizer,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        device=args.device,
        progress=not args.no_progress,
    )
    if args.json:
        print(json.dumps(r))
        return 0
    bpb = f"{r['bits_per_byte']:.4f}" if r["bits_per_byte"] is not None else "n/a (no tokenizer)"
    print(f"loss {r['loss']:.4f}  perplexity {r['perplexity']:.2f}  bits/byte {bpb}")
    if "conversations" in r:
        bad = f", {r['bad_rows']:,} malformed rows skipped" if r["bad_rows"] else ""
        print(f"{r['conversations']:,} conversations{bad}; the assistant's tokens scored")
    print(f"{r['tokens']:,} tokens in {r['seconds']:.2f} s ({r['tokens_per_s'] or 0:,.0f} tokens/s)")
    return 0


def _run_eval_tasks(args) -> int:
    import json

    from ferrolm.lm.harness import run_tasks

    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    r = run_tasks(
        args.checkpoint,
        args.tasks,
        args.tokenizer,
        num_fewshot=args.num_fewshot,
        limit=limit,
        batch_size=args.batch_size,
        device=args.device,
        include_path=args.include_path,
        apply_chat_template=args.apply_chat_template,
    )
    if args.json:
        print(json.dumps({k: r[k] for k in ("results", "n-shot", "n-samples") if k in r}, default=str))
        return 0
    from lm_eval.utils import make_table

    print(make_table(r))
    return 0


COMMANDS.extend([add_export_command, add_eval_command])


# ---------------------------------------------------------------------------------------
# demo, download (ferrolm.app.demo, ferrolm.app.download)
# ---------------------------------------------------------------------------------------


def add_demo_command(sub) -> None:
    from ferrolm.app.demo import DEFAULT_MAX_MB, DEFAULT_MINUTES, DEFAULT_OUT, DEFAULT_VOCAB_SIZE

    p = sub.add_parser(
        "demo",
        help="run the whole pipeline on real text in a few minutes",
        description="Train a BPE tokenizer, encode token shards, train the cpu-small Transformer LM for a few "
        "minutes, sample from it and plot its loss curve; every artefact goes under one directory. Default "
        "data: the source of this Python's own standard library (nothing is downloaded). With the defaults "
        "it takes under 10 minutes on a 2-core machine.",
    )
    p.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        help="your own text files (or directories of .txt files): plain text with documents separated "
        "by <|endoftext|>, as TinyStories or OpenWebText (.gz/.zst too); a validation slice is split off",
    )
    add_output(
        p,
        metavar="DIR",
        default=DEFAULT_OUT,
        help=f"output directory (default ./{DEFAULT_OUT}; a previous demo there is replaced)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=DEFAULT_MINUTES,
        metavar="M",
        help=f"training time in minutes (default {DEFAULT_MINUTES:g})",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        metavar="N",
        help=f"tokenizer vocabulary size (default {DEFAULT_VOCAB_SIZE})",
    )
    add_device(p)
    p.add_argument(
        "--max-mb",
        type=float,
        default=DEFAULT_MAX_MB,
        metavar="MB",
        help=f"use at most this much text (default {DEFAULT_MAX_MB:g}; 0: all of it)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        dest="prompts",
        help="a prompt to sample from (repeatable; default: a few code openings for the standard "
        "library, new documents for --data)",
    )
    add_sampling(
        p, max_new_tokens=200, seed=1337, seed_help="seed of training and sampling (default 1337)", distribution=False
    )
    add_overrides(p, "override a field of the cpu-small training config, e.g. --set model.num_layers=2 (repeatable)")
    add_progress(p, "no progress bars")
    p.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    from ferrolm.app.demo import run_demo

    try:
        run_demo(
            args.out,
            args.data,
            minutes=args.minutes,
            vocab_size=args.vocab_size,
            device=args.device,
            max_mb=args.max_mb,
            overrides=args.overrides,
            prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            progress=not args.no_progress,
        )
    except RuntimeError as e:  # training diverged (NaN) or left no checkpoint: the message says what to do
        print(f"ferrolm demo: error: {e}", file=sys.stderr)
        return 1
    return 0


def add_download_command(sub) -> None:
    from ferrolm.app.download import DATASETS

    p = sub.add_parser(
        "download",
        help="download a public corpus (TinyStories, an OpenWebText sample)",
        description="Download the files of a public corpus with a progress bar; an interrupted download resumes "
        "where it stopped, and each file's sha256 is checked (recorded on the first complete download). "
        + "; ".join(f"{k}: {', '.join(r.filename for r in v)}" for k, v in sorted(DATASETS.items())),
    )
    p.add_argument("dataset", choices=sorted(DATASETS), help="which corpus")
    add_output(p, metavar="DIR", default="data", help="directory for the files (default ./data)")
    add_progress(p, "no progress bar")
    p.set_defaults(run=_run_download)


def _run_download(args) -> int:
    from ferrolm.app.download import download_dataset

    paths = download_dataset(args.dataset, args.out, progress=not args.no_progress)
    for path in paths:
        print(path)
    print(f"train on it: ferrolm demo --data {paths[0]}", file=sys.stderr)
    return 0


COMMANDS.extend([add_demo_command, add_download_command])

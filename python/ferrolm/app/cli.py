"""The `ferrolm` command: one subcommand per job.

Each subcommand lives in its own function that parses nothing itself: `build_parser`
declares the arguments, `main` dispatches. Heavy imports (torch) happen inside the
subcommand that needs them, so `ferrolm --help` is instant.
"""

from __future__ import annotations

import argparse
import sys

import ferrolm
from ferrolm._util import ForgivingStream, fix_surrogates, say_where_possible, silence


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


# ---------------------------------------------------------------------------------------
# train, plot: the LM training loop (ferrolm.lm.train) and its loss curves
# ---------------------------------------------------------------------------------------


def add_text_column_option(p) -> None:
    """--column / --jsonl-field: where encode and train-tokenizer find a document's text."""
    p.add_argument(
        "--column",
        "--jsonl-field",
        default="text",
        dest="column",
        metavar="NAME",
        help="Parquet column or JSON Lines field holding the text (default: text)",
    )


def add_train_command(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a Transformer LM on token shards",
        description="Train ferrolm's Transformer LM on shards written by `ferrolm encode`. "
        f"Config: a TOML file or a preset ({', '.join(_preset_names())}), any field overridable with --set section.field=value. "
        "Multi-process: torchrun --nproc_per_node N -m ferrolm train ...",
    )
    p.add_argument("--config", "-c", metavar="FILE|PRESET", help="TOML config file or preset name")
    p.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set optimizer.lr=3e-4 (repeatable)",
    )
    p.add_argument(
        "--resume", metavar="RUN_DIR|CKPT", help="continue a run (its config.toml is used; --set still applies)"
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.set_defaults(run=_run_train)


def _preset_names() -> list:
    from ferrolm.lm.config import preset_names

    return preset_names()


def _run_train(args) -> int:
    from pathlib import Path

    from ferrolm.lm.config import CONFIG_NAME, load_config

    config = args.config
    overrides = list(args.overrides)
    if args.resume and not Path(args.resume).exists():
        raise FileNotFoundError(f"--resume {args.resume}: no such run directory or checkpoint")
    if args.resume and config is None:
        rdir = Path(args.resume)
        if not rdir.is_dir():  # a checkpoint file: RUN/checkpoints/step_N.pt or RUN/best.pt
            rdir = rdir.parent.parent if rdir.parent.name == "checkpoints" else rdir.parent
        config = rdir / CONFIG_NAME
        if not config.is_file():
            raise FileNotFoundError(f"--resume {args.resume}: {config} not found (pass --config too)")
        overrides = [f"run.out_dir={rdir}"] + overrides
    if config is None and not args.print_config:
        raise ValueError(f"give --config FILE|PRESET (presets: {', '.join(_preset_names())}) or --resume RUN_DIR")
    cfg = load_config(config, overrides)
    if args.print_config:
        from ferrolm.lm.config import to_toml

        print(to_toml(cfg), end="")
        return 0
    from ferrolm.lm.train import train

    summary = train(cfg, resume=args.resume)
    import os

    if summary.status in ("done", "time") and summary.final_val_loss is not None and os.environ.get("RANK", "0") == "0":
        # the run is saved: a reader gone from stdout does not make it a failure
        say_where_possible(
            f"val loss {summary.final_val_loss:.4f} at step {summary.step}; checkpoint {summary.last_checkpoint}",
            ForgivingStream(sys.stdout),
        )
    return {"done": 0, "time": 0, "interrupted": 130, "nan": 3, "dead": 4}.get(summary.status, 1)


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
    p.add_argument("--force", action="store_true", help="replace an --out file that is not a plot of ferrolm's")
    p.set_defaults(run=_run_plot)


def _run_plot(args) -> int:
    from ferrolm.app.plot import plot_run

    path = plot_run(args.runs, x=args.x, out=args.out, labels=args.label, title=args.title, force=args.force)
    print(path)
    return 0


COMMANDS.extend([add_train_command, add_plot_command])


# ---------------------------------------------------------------------------------------
# generate: sampling from a trained model (ferrolm.lm.generate)
# ---------------------------------------------------------------------------------------


CHECKPOINT_HELP = (
    "a run folder of `ferrolm train` (its best.pt, else its newest checkpoint), a checkpoint .pt, "
    "or a folder or .safetensors file written by `ferrolm export`"
)
TOKENIZER_HELP = "the tokenizer folder the model was trained with (default: the one its checkpoint names)"


def add_generate_command(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a trained model",
        description="Sample from a checkpoint written by `ferrolm train`, printing the text as it is "
        "generated. Each sample echoes the prompt and stops at the tokenizer's end-of-text token "
        "or after --max-new-tokens tokens.",
    )
    p.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help=TOKENIZER_HELP,
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        dest="prompts",
        metavar="TEXT",
        help="text to continue; '-' reads it from stdin (one trailing newline dropped); '' starts a new document "
        "(from the end-of-text token). Repeat it (or --prompt-file) to run several prompts as one batch",
    )
    p.add_argument(
        "--prompt-file",
        action="append",
        default=[],
        dest="prompt_files",
        metavar="FILE",
        help="read a prompt from a UTF-8 file (one trailing newline dropped; repeatable)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a sample where it produces this text, which is not printed (repeatable)",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=256, metavar="N", help="tokens to generate per sample (default 256)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="softmax temperature, >= 0; 0 = greedy (default 1.0)",
    )
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most probable tokens only")
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="nucleus sampling: the smallest most-probable set with mass >= P, P in (0, 1]",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="random seed in [0, 2**63) (default: a fresh one, printed on stderr unless --temperature is 0)",
    )
    p.add_argument(
        "--num-samples", type=int, default=1, metavar="M", help="samples to draw, one after the other (default 1)"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:1, mps ...")
    p.set_defaults(run=_run_generate)


def _drop_newline(text: str) -> str:
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def _stdin_text() -> str:
    """Standard input as text: UTF-8 whatever the locale, an invalid byte as U+FFFD."""
    raw = getattr(sys.stdin, "buffer", None)
    return raw.read().decode("utf-8", "replace") if raw is not None else sys.stdin.read()


def _prompts(args) -> list:
    # An argument that is not valid UTF-8 reaches Python as lone surrogates (surrogateescape):
    # they become U+FFFD, as the tokenizer and the server take them, so the echo can print them.
    prompts = [fix_surrogates(_drop_newline(_stdin_text()) if p == "-" else p) for p in args.prompts]
    for path in args.prompt_files:
        with open(path, "rb") as f:
            data = f.read()
        try:
            prompts.append(_drop_newline(data.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise ValueError(
                f"--prompt-file {path}: not UTF-8 text (byte {e.start:,} is {data[e.start]:#04x})"
            ) from None
    if not prompts:
        raise ValueError("give --prompt TEXT (or --prompt-file FILE); --prompt '' starts a new document")
    return prompts


def _emitter():
    out = getattr(sys.stdout, "buffer", None)

    def emit(text: str) -> None:
        # UTF-8 bytes whatever the locale; flushed so the text appears as it is generated
        if out is not None:
            sys.stdout.flush()
            out.write(text.encode("utf-8"))
            out.flush()
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    return emit


def _run_generate(args) -> int:
    import torch

    from ferrolm.lm.checkpoint import load_model
    from ferrolm.lm.config import SEED_LIMIT
    from ferrolm.lm.generate import StopText, check_sampling_args, generate, iter_text, resolve_device

    check_sampling_args(args.temperature, args.top_k, args.top_p)  # before any loading
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be an int in [0, 2**63), got {args.seed}")
    prompts = _prompts(args)
    args.stop = [fix_surrogates(t) for t in args.stop]
    device = resolve_device(args.device)
    model, tok, _ = load_model(args.checkpoint, device, tokenizer=args.tokenizer, require_tokenizer=True)
    eos = tok.eos_id
    rows = [tok.encode(p) for p in prompts]
    if any(not ids for ids in rows) and eos is None:
        raise ValueError("an empty prompt starts from the end-of-text token, but this tokenizer has none")
    seed = args.seed
    if seed is None:
        seed = torch.Generator().seed() % SEED_LIMIT
        if args.temperature > 0:  # greedy decoding draws nothing: its seed is not worth reporting
            _report(f"seed {seed}")
    generator = torch.Generator(device=device).manual_seed(seed)
    known = tok.vocab_size

    def piece_of(t: int) -> bytes:
        # A model may have more ids than its tokenizer (a rounded-up vocab_size): such an
        # id has no text; it shows as U+FFFD.
        return tok.token_bytes(t) if t < known else "\ufffd".encode()

    emit = _emitter()
    sampling = (args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    for i in range(args.num_samples):
        if len(rows) > 1:
            texts = _batch_texts(model, rows, sampling, eos, generator, piece_of, args.stop)
            for r, (prompt, text) in enumerate(zip(prompts, texts)):
                sample = f", sample {i + 1}/{args.num_samples}" if args.num_samples > 1 else ""
                emit(f"--- prompt {r + 1}/{len(rows)}{sample} ---\n{prompt}{text}\n")
            continue
        if args.num_samples > 1:
            emit(f"--- sample {i + 1}/{args.num_samples} ---\n")
        emit(prompts[0])
        stream = generate(model, rows[0], *sampling, eos_id=eos, generator=generator)
        stop = StopText(args.stop)
        for piece in iter_text((t for t in stream if t != eos), piece_of):
            emit(stop.feed(piece))
            if stop.done:
                break
        emit(stop.flush() + "\n")
    return 0


def _batch_texts(model, rows, sampling, eos, generator, piece_of, stops) -> list:
    """The generated text of each prompt, run as one batch, each cut at its first stop string."""
    from ferrolm.lm.generate import StopText, generate

    new: list = [[] for _ in rows]
    for step in generate(model, rows, *sampling, eos_id=eos, generator=generator):
        for r, t in enumerate(step):
            if t is not None and t != eos:
                new[r].append(t)
    return [StopText(stops).cut(b"".join(map(piece_of, ids)).decode("utf-8", "replace")) for ids in new]


COMMANDS.append(add_generate_command)


def add_serve_command(sub) -> None:
    from ferrolm.app.serve import (  # the standard library only: no torch, no starlette
        MAX_QUEUE,
        SHUTDOWN_GRACE,
        STREAM_INTERVAL,
        WRITE_TIMEOUT,
    )

    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI HTTP API (needs the serve extra)",
        description="Serve a checkpoint (or a folder written by `ferrolm export`) with OpenAI's API: POST "
        "/v1/completions and /v1/chat/completions (streaming or not), GET /v1/models and /health. Concurrent "
        'requests are decoded as one batch. Needs pip install "ferrolm[serve]". Ctrl-C or SIGTERM lets the '
        "running requests finish (within --shutdown-grace), then exits; a second one exits at once.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="a run folder, a checkpoint, a .safetensors file or a folder of `ferrolm export`",
    )
    p.add_argument(
        "--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: the run's, or the export's)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one, printed on stderr)")
    p.add_argument("--model-name", default=None, metavar="NAME", help="the model's name in the API (default: RUN/FILE)")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template (default: the tokenizer folder's, else plain text)",
    )
    p.add_argument("--max-batch", type=int, default=16, metavar="N", help="sequences decoded together (default 16)")
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=4096,
        metavar="N",
        help="the largest max_tokens a request may ask (default 4096)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=MAX_QUEUE,
        metavar="N",
        help=f"requests that may wait for a batch row; one more gets HTTP 429 (default {MAX_QUEUE}; 0: none wait)",
    )
    p.add_argument(
        "--write-timeout",
        type=float,
        default=WRITE_TIMEOUT,
        metavar="SECONDS",
        help=f"a stream whose client takes nothing for this long is ended (default {WRITE_TIMEOUT:g})",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=SHUTDOWN_GRACE,
        metavar="SECONDS",
        help=f"after Ctrl-C or SIGTERM, running requests are cancelled after this long (default {SHUTDOWN_GRACE:g})",
    )
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads (default: torch's choice)")
    p.add_argument(
        "--stream-interval",
        type=float,
        default=STREAM_INTERVAL,
        metavar="SECONDS",
        help=f"a stream's new tokens go out together at most this often (default {STREAM_INTERVAL:g}; the first at once; 0: "
        "every token as it comes, which on a CPU slows decoding: each hand-over takes a core from the model)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:1, mps ...")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="server log")
    p.set_defaults(run=_run_serve)


def _run_serve(args) -> int:
    from ferrolm.app.serve import serve

    return serve(
        args.checkpoint,
        tokenizer=args.tokenizer,
        host=args.host,
        port=args.port,
        device=args.device,
        name=args.model_name,
        chat_template=args.chat_template,
        max_batch=args.max_batch,
        max_tokens_limit=args.max_tokens_limit,
        threads=args.threads,
        log_level=args.log_level,
        stream_interval=args.stream_interval,
        max_queue=args.max_queue,
        write_timeout=args.write_timeout,
        shutdown_grace=args.shutdown_grace,
    )


COMMANDS.append(add_serve_command)

# ---------------------------------------------------------------------------------------
# Corpus commands: train-tokenizer, encode, decode, shards
# ---------------------------------------------------------------------------------------


def _peak_rss_mb() -> float | None:
    """This process's peak resident memory (VmHWM), in MB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except (ImportError, OSError):  # pragma: no cover
        return None


def _read_sample(path: str, limit: int, column: str = "text") -> str:
    """Up to `limit` bytes of text from the start of a (possibly .gz/.zst or Parquet) file."""
    from ferrolm.bpe import inputs

    if inputs.is_parquet(path):
        data, offsets = next(inputs.parquet_batches(path, column), (b"", [0]))
        return bytes(data[: min(limit, int(offsets[-1]))]).decode("utf-8", errors="ignore")
    if path.endswith(".gz"):
        import gzip

        f = gzip.open(path, "rb")
    elif path.endswith((".zst", ".zstd")):
        try:
            import zstandard
        except ImportError:
            raise ImportError(
                'reading a .zst sample needs the zstandard package: pip install "ferrolm[zstd]"'
            ) from None

        f = zstandard.open(path, "rb")
    else:
        f = open(path, "rb")
    with f:
        text = f.read(limit).decode("utf-8", errors="ignore").removeprefix("\ufeff")
    return _jsonl_documents(text, column) or text


def _jsonl_documents(text: str, column: str) -> str | None:
    """The documents of the whole JSON Lines records in `text`, one after another; None
    when `text` does not start with one (it is then plain text)."""
    import json

    docs = []
    for line in text.split("\n")[:-1] or [text]:
        if not line.strip():
            continue
        try:
            doc = json.loads(line)[column]
        except (ValueError, TypeError, KeyError):
            return None
        if not isinstance(doc, str):
            return None
        docs.append(fix_surrogates(doc))  # a JSON escape may name a lone surrogate
    return "".join(docs) if docs else None


def _add_train_tokenizer(sub) -> None:
    p = sub.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE tokenizer on text files",
        description="Train a byte-level BPE tokenizer (Rust trainer, all cores) and save it as a tokenizer "
        "directory (vocab.json, merges.txt, the Hugging Face files, ferrolm_tokenizer.json). Prints a summary at the end: time, peak memory, "
        "number of merges, the longest tokens and the compression (bytes per token) on a sample of the input.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        default=None,
        metavar="FILE",
        help="training files, read as `ferrolm encode` reads them: text whose documents are separated by a "
        "special token, .gz/.zst compressed text, JSON Lines, Parquet; globs ('data/*.parquet') and folders "
        "are expanded, sorted",
    )
    add_text_column_option(p)
    p.add_argument(
        "--counts",
        nargs="+",
        default=None,
        metavar="FILE",
        help="train from these pre-token counts files (from --counts-out) instead of --input",
    )
    p.add_argument(
        "--counts-out",
        default=None,
        metavar="FILE",
        help="write the pre-token counts of --input (or of its --part) to FILE instead of training",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="let --counts-out replace a file that is not a counts file of ferrolm's (never an input)",
    )
    p.add_argument(
        "--part",
        default=None,
        metavar="I/N",
        help="with --counts-out: count only the I-th (0-based) of N byte ranges of the inputs, cut after a "
        "special token (one job of a Slurm array, say); train later from all N counts files with --counts",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help='count --parts parts of --input as Ray tasks, then train here; needs pip install "ferrolm[ray]"',
    )
    p.add_argument(
        "--parts", type=int, default=None, metavar="N", help="with --ray: number of parts (default: the cluster's CPUs)"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="final vocabulary size: 256 bytes + merges + special tokens",
    )
    p.add_argument(
        "--special-token",
        action="append",
        default=None,
        metavar="T",
        dest="special_tokens",
        help="a special token (repeatable; default: <|endoftext|>)",
    )
    p.add_argument(
        "--pattern", default="gpt2", help="pre-tokenization pattern: gpt2, cl100k, o200k or a regex (default: gpt2)"
    )
    p.add_argument("--threads", type=int, default=None, metavar="N", help="threads (default: all cores)")
    p.add_argument("--out", default=None, metavar="DIR", help="output tokenizer directory")
    p.add_argument(
        "--sample-bytes",
        type=int,
        default=1 << 20,
        metavar="B",
        help="bytes of the first input used to measure compression (default: 1 MiB)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=_run_train_tokenizer)


def _run_train_tokenizer(args) -> int:
    import os
    import time

    from ferrolm.bpe import inputs
    from ferrolm.bpe.tokenizer import Tokenizer

    if _two_phase(args):
        return _run_train_tokenizer_in_phases(args)
    for flag in ("input", "vocab_size", "out"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')} is required")
    args.input = inputs.expand(args.input)  # folders and globs to their files
    for path in args.input:  # what exists but is no regular file, the core refuses by name
        if not os.path.exists(path):
            raise FileNotFoundError(f"input file not found: {path}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    specials = args.special_tokens if args.special_tokens is not None else ["<|endoftext|>"]
    for s in specials:  # refused by the save at the end: say so before the training
        if len(s.encode("utf-8")) == 1:
            raise ValueError(
                f"--special-token {s!r} is a single byte: a tokenizer directory cannot hold it beside that byte's own token"
            )
    t0 = time.perf_counter()
    tok = Tokenizer.train(
        args.input if len(args.input) > 1 else args.input[0],
        args.vocab_size,
        specials,
        pattern=args.pattern,
        num_threads=args.threads,
        progress=not args.no_progress,
        column=args.column,
    )
    elapsed = time.perf_counter() - t0
    out = tok.save(args.out)
    peak = _peak_rss_mb()
    longest = sorted(
        (b for i, b in tok.vocab.items() if b.decode("utf-8", "replace") not in specials), key=lambda b: (-len(b), b)
    )[:10]
    print(f"saved {out} (vocab_size {tok.vocab_size}, fingerprint {tok.fingerprint[:12]})")
    print(f"time          {elapsed:.1f} s")
    print(f"peak memory   {peak:,.0f} MB (VmHWM)" if peak is not None else "peak memory   unknown")
    print(f"merges        {len(tok.merges):,}")
    print(f"special       {', '.join(specials) or '(none)'}")
    _print_compression(tok, args.input[0], args.sample_bytes, args.column)
    print("longest tokens:")
    for b in longest:
        print(f"  {len(b):3d} bytes  {b.decode('utf-8', 'replace')!r}")
    return 0


def _print_compression(tok, path: str, limit: int, column: str) -> None:
    """The compression line of the summary. The tokenizer is saved by now: a sample that
    cannot be read or measured costs the line (with a note why), never the exit status."""
    try:
        sample = _read_sample(path, limit, column)
        n_ids = len(tok.encode(sample)) if sample else 0
        nbytes = len(sample.encode("utf-8"))
    except Exception as e:  # noqa: BLE001 - whatever it is, the saved tokenizer stands
        print(f"note: compression not measured: {e}", file=sys.stderr)
        return
    if n_ids:
        print(f"compression   {nbytes / n_ids:.2f} bytes/token on the first {nbytes:,} bytes of {path}")


def _two_phase(args) -> bool:
    """Whether the command is a phase of two-phase training (counts out, counts in, or Ray)."""
    if args.part is not None and args.counts_out is None:
        raise ValueError("--part goes with --counts-out (count one part; train later from all parts with --counts)")
    if args.parts is not None and not args.ray:
        raise ValueError("--parts goes with --ray")
    chosen = [
        name for name, on in (("--counts", args.counts), ("--counts-out", args.counts_out), ("--ray", args.ray)) if on
    ]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} do not go together")
    if args.counts is not None and args.input is not None:
        raise ValueError("give --input (text to count) or --counts (counts files), not both")
    return bool(chosen)


def _run_train_tokenizer_in_phases(args) -> int:
    import time

    from ferrolm.bpe import counts
    from ferrolm.bpe.tokenizer import Tokenizer

    specials = args.special_tokens if args.special_tokens is not None else ["<|endoftext|>"]
    t0 = time.perf_counter()
    if args.counts_out is not None:
        if args.input is None:
            raise ValueError("--counts-out needs --input")
        header = counts.count(
            args.input,
            args.counts_out,
            specials,
            part=args.part,
            pattern=args.pattern,
            num_threads=args.threads,
            column=args.column,
            progress=not args.no_progress,
            force=args.force,
        )
        print(
            f"wrote {args.counts_out}: {header['unique_pretokens']:,} distinct pre-tokens"
            + (f" of part {header['part'][0]}/{header['part'][1]}" if header["part"] else "")
            + f" in {time.perf_counter() - t0:.1f} s"
        )
        return 0
    for flag in ("vocab_size", "out"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')} is required")
    pattern = None if args.pattern == "gpt2" and args.counts is not None else args.pattern
    given_specials = args.special_tokens if args.counts is not None else specials
    if args.ray:
        if args.input is None:
            raise ValueError("--ray needs --input")
        import ferrolm.ray

        vocab, merges, specials, pattern = ferrolm.ray.train_tokenizer(
            args.input,
            args.vocab_size,
            specials,
            pattern=args.pattern,
            parts=args.parts,
            work_dir=args.out.rstrip("/") + ".counts",
            num_threads=args.threads,
            column=args.column,
            progress=not args.no_progress,
        )
    else:
        headers = [counts.read_header(p) for p in args.counts]
        specials = given_specials if given_specials is not None else headers[0].get("special_tokens", [])
        pattern = pattern or headers[0].get("pattern")
        vocab, merges = counts.train_from_counts(
            args.counts,
            args.vocab_size,
            specials,
            pattern=pattern,
            num_threads=args.threads,
            progress=not args.no_progress,
        )
    tok = Tokenizer(vocab, merges, specials, pattern)
    out = tok.save(args.out)
    print(f"saved {out} (vocab_size {tok.vocab_size}, fingerprint {tok.fingerprint[:12]})")
    print(f"time          {time.perf_counter() - t0:.1f} s")
    peak = _peak_rss_mb()
    print(f"peak memory   {peak:,.0f} MB (VmHWM)" if peak is not None else "peak memory   unknown")
    print(f"merges        {len(tok.merges):,}")
    return 0


def _add_encode(sub) -> None:
    p = sub.add_parser(
        "encode",
        help="encode text files into a uint16/uint32 token shard (PREFIX.bin + PREFIX.json)",
        description="Encode a corpus into a flat little-endian token file PREFIX.bin (uint16, or uint32 when the "
        "vocab does not fit) and its sidecar PREFIX.json (counts, vocab size, eos id, tokenizer fingerprint, "
        "inputs with sizes and sha256). Inputs: plain text whose documents are separated by <|endoftext|>, "
        ".gz and .zst compressed text, JSON Lines (*.jsonl, or a .json of one object per line), Parquet (the "
        "--column of each row); globs and folders are expanded, sorted. Uses all cores; the output is "
        "byte-identical for any --threads. Resumable: if the run is killed (Ctrl-C, kill -9), rerun the same "
        "command and it continues from the last completed chunk. The final names appear only when complete.",
    )
    p.add_argument(
        "--tokenizer", required=True, metavar="DIR", help="tokenizer directory (from train-tokenizer or Tokenizer.save)"
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help="input files, globs ('data/*.parquet') or folders, encoded in this order (each glob and folder sorted)",
    )
    p.add_argument("--out", required=True, metavar="PREFIX", help="output prefix: writes PREFIX.bin and PREFIX.json")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a PREFIX.bin or PREFIX.json that is not a shard of ferrolm's (never an input)",
    )
    p.add_argument("--threads", type=int, default=None, metavar="N", help="encoding threads (default: all cores)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "uint16", "uint32"],
        help="token dtype (default: auto = uint16 when the vocab fits)",
    )
    p.add_argument(
        "--part",
        default=None,
        metavar="I/N",
        help="encode only the I-th (0-based) of N byte ranges of the inputs, cut at document boundaries, "
        "into PREFIX.part-I-of-N.bin/.json (for N machines or jobs; `ferrolm shards PREFIX` checks the set)",
    )
    add_text_column_option(p)
    p.add_argument(
        "--format",
        default="auto",
        choices=["auto", "text", "jsonl"],
        dest="input_format",
        help="input format (default: auto: by name and content; Parquet is always recognised)",
    )
    p.add_argument(
        "--errors",
        default="strict",
        choices=["strict", "replace"],
        help="invalid UTF-8: strict = error with file and byte offset (default), replace = U+FFFD",
    )
    p.add_argument(
        "--chunk-size",
        type=float,
        default=None,
        metavar="MB",
        help="size of the chunks encoded as one task, in MB (default: 1; does not change the output)",
    )
    p.add_argument(
        "--commit-interval",
        type=float,
        default=None,
        metavar="S",
        help="seconds between progress-journal commits (default: 5; 0 = after every chunk)",
    )
    p.add_argument(
        "--no-hash",
        action="store_true",
        help="do not compute the inputs' sha256 for the sidecar (saves its CPU time; records null)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--ray",
        action="store_true",
        help="encode --parts parts as Ray tasks (joins the cluster RAY_ADDRESS names, else starts a local one) "
        'and write PREFIX.manifest.json last; needs pip install "ferrolm[ray]"',
    )
    p.add_argument(
        "--parts", type=int, default=None, metavar="N", help="with --ray: number of parts (default: the cluster's CPUs)"
    )
    p.set_defaults(run=_run_encode)


MAX_CHUNK_MB = 4096  # a chunk is held in memory per task in flight


def _run_encode(args) -> int:
    import time

    from ferrolm.bpe import shards
    from ferrolm.bpe.tokenizer import Tokenizer

    # The core takes whole bytes (a usize): refuse what would not fit before it is asked.
    if args.chunk_size is not None and not 0 < args.chunk_size <= MAX_CHUNK_MB:
        raise ValueError(f"--chunk-size must be more than 0 and at most {MAX_CHUNK_MB} MB, got {args.chunk_size:g}")
    if args.commit_interval is not None and not 0 <= args.commit_interval < float("inf"):
        raise ValueError(f"--commit-interval must be a number of seconds >= 0, got {args.commit_interval:g}")
    tok = Tokenizer.load(args.tokenizer)
    if args.ray or args.parts is not None:
        return _run_encode_ray(args, tok)
    t0 = time.perf_counter()
    try:
        sc = shards.encode(
            tok,
            args.input,
            args.out,
            threads=args.threads,
            dtype=args.dtype,
            part=args.part,
            column=args.column,
            input_format=args.input_format,
            errors=args.errors,
            chunk_size=int(args.chunk_size * 1_000_000) if args.chunk_size else None,
            commit_interval=args.commit_interval
            if args.commit_interval is not None
            else shards.DEFAULT_COMMIT_INTERVAL,
            progress=False if args.no_progress else None,
            hash_inputs=not args.no_hash,
            force=args.force,
        )
    except KeyboardInterrupt:
        print(
            "ferrolm encode: interrupted; rerun the same command to continue from the last completed chunk",
            file=sys.stderr,
        )
        raise
    elapsed = time.perf_counter() - t0
    bin_path, json_path = shards.output_paths(args.out, shards.parse_part(args.part))
    if sc.get("restart_reason"):
        print(f"note: started over: {sc['restart_reason']}", file=sys.stderr)
    if sc.get("resumed_tokens"):
        print(f"resumed after {sc['resumed_tokens']:,} tokens already written", file=sys.stderr)
    print(
        f"wrote {bin_path} ({sc['num_tokens']:,} {sc['dtype']} tokens, {sc['num_documents']:,} documents) and {json_path}"
    )
    # Rates over the text this run encoded (decompressed, the JSON Lines and Parquet
    # documents' own text), not the bytes on disk, which compression and markup skew.
    text_bytes, tokens = sc["text_bytes"], sc["num_tokens"] - sc["resumed_tokens"]
    if tokens:
        print(
            f"{text_bytes / 1e6:,.1f} MB of text in {elapsed:.2f} s: {text_bytes / 1e6 / max(elapsed, 1e-9):,.1f} MB/s, "
            f"{tokens / 1e6 / max(elapsed, 1e-9):,.2f}M tokens/s, {text_bytes / tokens:.2f} bytes/token"
        )
    return 0


def _run_encode_ray(args, tok) -> int:
    import time

    if not args.ray:
        raise ValueError("--parts goes with --ray (for one part of a split without Ray, use --part I/N)")
    if args.part is not None:
        raise ValueError("--part and --ray do not go together: --ray runs every part (set their number with --parts)")
    import ferrolm.ray

    t0 = time.perf_counter()
    m = ferrolm.ray.encode(
        tok,
        args.input,
        args.out,
        parts=args.parts,
        column=args.column,
        dtype=args.dtype,
        input_format=args.input_format,
        errors=args.errors,
        threads_per_part=args.threads or 1,
        chunk_size=int(args.chunk_size * 1_000_000) if args.chunk_size else None,
        hash_inputs=not args.no_hash,
        progress=not args.no_progress,
        force=args.force,
    )
    elapsed = time.perf_counter() - t0
    in_bytes = m["total_input_bytes"]
    where = f"{ferrolm.ray.manifest_path(args.out)}: {m['num_tokens']:,} {m['dtype']} tokens, {m['num_documents']:,} documents"
    if m["skipped_parts"] == len(m["parts"]):  # nothing encoded: no rate to report
        print(f"all {len(m['parts'])} parts already complete; wrote {where}")
        return 0
    print(f"wrote {len(m['parts'])} parts ({m['skipped_parts']} already complete) and {where}")
    print(
        f"{in_bytes / 1e6:,.1f} MB in {elapsed:.2f} s: {in_bytes / 1e6 / max(elapsed, 1e-9):,.1f} MB/s, "
        f"{m['num_tokens'] / 1e6 / max(elapsed, 1e-9):,.2f}M tokens/s"
    )
    return 0


def _add_decode(sub) -> None:
    p = sub.add_parser(
        "decode",
        help="print the text of (a slice of) a token shard",
        description="Decode token ids from a shard back to text and print them, to eyeball a shard. "
        "The dtype comes from the sidecar PREFIX.json (or --dtype when there is none); the tokenizer's "
        "fingerprint must match the sidecar's.",
    )
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="tokenizer directory")
    p.add_argument("--input", required=True, metavar="PREFIX.bin", help="shard data file (or its prefix)")
    p.add_argument("--offset", type=int, default=0, metavar="K", help="first token to decode (default: 0)")
    p.add_argument("--count", type=int, default=None, metavar="M", help="number of tokens (default: to the end)")
    p.add_argument("--dtype", default=None, choices=["uint16", "uint32"], help="dtype when the .bin has no sidecar")
    p.set_defaults(run=_run_decode)


def _run_decode(args) -> int:
    import codecs
    import json
    import os

    import numpy as np

    from ferrolm.bpe.tokenizer import Tokenizer

    path = args.input if args.input.endswith(".bin") else args.input + ".bin"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"shard data file not found: {path}")
    tok = Tokenizer.load(args.tokenizer)
    sidecar_path = path[:-4] + ".json"
    dtype = args.dtype
    if os.path.isfile(sidecar_path):
        with open(sidecar_path, encoding="utf-8") as f:
            sidecar = json.load(f)
        if dtype is not None and dtype != sidecar.get("dtype"):
            raise ValueError(f"--dtype {dtype} contradicts the sidecar's dtype {sidecar.get('dtype')}")
        dtype = sidecar.get("dtype")
        fp = sidecar.get("tokenizer_fingerprint")
        if fp and fp != tok.fingerprint:
            raise ValueError(
                f"the tokenizer in {args.tokenizer} (fingerprint {tok.fingerprint[:12]}) is not the one "
                f"this shard was encoded with ({fp[:12]})"
            )
    elif dtype is None:
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(
            f"{path}: {size:,} bytes is not a whole number of {dtype} tokens ({itemsize} bytes each): "
            "the file is cut short or not a shard"
        )
    data = (
        np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
        if os.path.getsize(path)
        else np.zeros(0, dtype)
    )
    if args.offset < 0 or args.offset > len(data):
        raise ValueError(f"--offset {args.offset} is outside the shard's {len(data):,} tokens")
    if args.count is not None and args.count < 0:
        raise ValueError("--count must be >= 0")
    end = len(data) if args.count is None else min(len(data), args.offset + args.count)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = sys.stdout
    block = 1 << 20
    for start in range(args.offset, end, block):
        ids = np.asarray(data[start : min(end, start + block)])
        bad = ids[ids >= tok.vocab_size]
        if bad.size:
            raise ValueError(
                f"{path}: token id {int(bad[0])} is not in the tokenizer's vocabulary (size {tok.vocab_size})"
            )
        out.write(decoder.decode(tok.decode_bytes(ids.tolist())))
    out.write(decoder.decode(b"", final=True))
    if end > args.offset:
        out.write("\n")
    out.flush()
    return 0


def _add_shards(sub) -> None:
    p = sub.add_parser(
        "shards",
        help="list token shards and check them (counts, dtypes, fingerprints, parts)",
        description="List shards (a prefix, a PREFIX.json/.bin, a manifest, or several) with their token and "
        "document counts, and validate them: data sizes match the sidecars, all parts of an N-way --part split "
        "are present and tile the inputs, dtype/vocab/eos/fingerprint agree. Exit status 1 when a problem is found.",
    )
    p.add_argument("src", nargs="+", metavar="SHARD", help="shard prefix, sidecar, .bin or manifest")
    p.add_argument(
        "--tokenizer", default=None, metavar="DIR", help="also check the shards were made with this tokenizer"
    )
    p.add_argument("--deep", action="store_true", help="also read every token id and check it is in the vocabulary")
    p.set_defaults(run=_run_shards)


def _run_shards(args) -> int:
    from ferrolm.bpe import shards

    try:
        records = shards.list_shards(args.src)
    except (shards.ShardError, FileNotFoundError) as e:
        print(f"ferrolm shards: {e}", file=sys.stderr)
        return 1
    print(shards.format_listing(records))
    problems = shards.validate_shards(args.src, tokenizer=args.tokenizer, deep=args.deep)
    if problems:
        print(f"\n{len(problems)} problem(s):", file=sys.stderr)
        for msg in problems:
            print(f"  - {msg}", file=sys.stderr)
        return 1
    unread = "" if args.deep else "; token ids not read (--deep checks each is below vocab_size)"
    print(f"ok: {len(records)} shard file(s) consistent{unread}")
    return 0


COMMANDS.extend([_add_train_tokenizer, _add_encode, _add_decode, _add_shards])


# ---------------------------------------------------------------------------------------
# export, eval (ferrolm.lm.export, ferrolm.lm.evaluate)
# ---------------------------------------------------------------------------------------


def add_export_command(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a checkpoint as a Hugging Face model folder (or a safetensors file)",
        description="Write a folder that transformers loads with no ferrolm code: config.json (LlamaForCausalLM), "
        "model.safetensors, generation_config.json and the tokenizer files (AutoModelForCausalLM and "
        "AutoTokenizer .from_pretrained(DIR)). --format safetensors writes the weights alone under ferrolm's "
        "names, with the model config in the metadata (`ferrolm generate --checkpoint FILE` reads it). "
        "--format gguf writes one GGUF file for llama.cpp and the tools built on it, tokenizer included "
        '(needs the gguf extra: pip install "ferrolm[gguf]").',
    )
    p.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    p.add_argument("--out", required=True, metavar="DIR|FILE", help="output folder (or .safetensors / .gguf file)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help=TOKENIZER_HELP)
    p.add_argument(
        "--format", default="hf", choices=["hf", "safetensors", "gguf"], help="hf (default), safetensors, gguf"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights dtype (hf; gguf: no bf16)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an --out that is not an earlier export (of this model, for hf); never the export's input",
    )
    p.set_defaults(run=_run_export)


def _run_export(args) -> int:
    from ferrolm.lm.export import export_hf, export_safetensors

    if args.format == "safetensors":
        out = export_safetensors(args.checkpoint, args.out, force=args.force)
    elif args.format == "gguf":
        from ferrolm.lm.gguf_export import export_gguf

        out = export_gguf(args.checkpoint, args.out, args.tokenizer, dtype=args.dtype, force=args.force)
    else:
        out = export_hf(args.checkpoint, args.out, args.tokenizer, dtype=args.dtype, force=args.force)
    print(out)
    return 0


def add_eval_command(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="score a checkpoint on token shards (loss, perplexity, bits per byte) or on lm-eval tasks",
        description="Run the model over the shards in consecutive context-length windows and report the mean loss "
        "(nats/token), perplexity, bits per byte (total nats / ln 2 / UTF-8 bytes of the text; special tokens "
        "count 0 bytes; needs the tokenizer) and tokens/s.",
    )
    p.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    p.add_argument("--data", nargs="+", metavar="SHARD", help="shard prefix(es), as for training")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help=TOKENIZER_HELP)
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
    p.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:1, mps ...")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
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
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
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
    p.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:1, mps ...")
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
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens per sample (default 200)")
    p.add_argument("--seed", type=int, default=1337, help="seed of training and sampling (default 1337)")
    p.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the cpu-small training config, e.g. --set model.num_layers=2 (repeatable)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
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
    p.add_argument("--out", default="data", metavar="DIR", help="directory for the files (default ./data)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_download)


def _run_download(args) -> int:
    from ferrolm.app.download import download_dataset

    paths = download_dataset(args.dataset, args.out, progress=not args.no_progress)
    for path in paths:
        print(path)
    print(f"train on it: ferrolm demo --data {paths[0]}", file=sys.stderr)
    return 0


COMMANDS.extend([add_demo_command, add_download_command])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        _report("interrupted")
        return 130
    except BrokenPipeError:  # the reader of the output went away (`| head`): nothing more to say
        silence(sys.stdout)
        silence(sys.stderr)
        return 1
    except (FileNotFoundError, ValueError, OSError, ImportError) as e:
        _report(f"ferrolm {args.command}: error: {e}")
        return 2


def _report(line: str) -> None:
    """``line`` on stderr, or on stdout when stderr's reader is gone, or nowhere."""
    say_where_possible(line, ForgivingStream(sys.stderr), ForgivingStream(sys.stdout))


if __name__ == "__main__":
    raise SystemExit(main())

"""The `ferrolm` command: one subcommand per job.

Each subcommand is a pair of functions: `add_*` declares its arguments (the ones several
commands share come from `ferrolm.app.args`), `_run_*` calls the library and prints. Heavy
imports (torch) happen inside the subcommand that needs them, one group per command, so
`ferrolm --help` is instant and the tokenizer commands never load torch.
"""

from __future__ import annotations

import argparse
import sys

import ferrolm
from ferrolm._util import ForgivingStream, fix_surrogates, say_where_possible, silence
from ferrolm.app.args import (  # noqa: F401 - int_at_least, positive_number: also for importers of this module
    add_device,
    add_force,
    add_inputs,
    add_model,
    add_output,
    add_overrides,
    add_progress,
    add_sampling,
    add_split,
    add_threads,
    add_tokenizer,
    int_at_least,
    positive_number,
)


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


# ---------------------------------------------------------------------------------------
# train, plot: the LM training loop (ferrolm.lm.train) and its loss curves
# ---------------------------------------------------------------------------------------


def add_train_command(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a Transformer LM on token shards",
        description="Train ferrolm's Transformer LM on shards written by `ferrolm encode`. "
        f"Config: a TOML file or a preset ({', '.join(_preset_names())}), any field overridable with --set section.field=value. "
        "Multi-process: torchrun --nproc_per_node N -m ferrolm train ...",
    )
    p.add_argument("--config", "-c", metavar="FILE|PRESET", help="TOML config file or preset name")
    add_overrides(p, "override a config field, e.g. --set optimizer.lr=3e-4 (repeatable)")
    p.add_argument(
        "--resume", metavar="RUN_DIR|CKPT", help="continue a run (its config.toml is used; --set still applies)"
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.set_defaults(run=_run_train)


def _preset_names() -> list:
    from ferrolm.lm.config import preset_names

    return preset_names()


def _run_train(args) -> int:
    import os

    from ferrolm.lm.config import resume_config, to_toml
    from ferrolm.lm.train import train

    if args.config is None and args.resume is None and not args.print_config:
        raise ValueError(f"give --config FILE|PRESET (presets: {', '.join(_preset_names())}) or --resume RUN_DIR")
    cfg = resume_config(args.config, args.overrides, args.resume)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    summary = train(cfg, resume=args.resume)
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
    add_output(
        p,
        metavar="PNG",
        help="output path (default: RUN_DIR/loss_<x>.png)",
        force_help="replace an --out file that is not a plot of ferrolm's",
    )
    p.add_argument("--label", action="append", default=None, help="legend label per run (repeatable, in order)")
    p.add_argument("--title", help="figure title")
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


def add_generate_command(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a trained model",
        description="Sample from a checkpoint written by `ferrolm train`, printing the text as it is "
        "generated. Each sample echoes the prompt and stops at the tokenizer's end-of-text token "
        "or after --max-new-tokens tokens.",
    )
    add_model(p)
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
    add_sampling(p)
    p.add_argument(
        "--num-samples", type=int, default=1, metavar="M", help="samples to draw, one after the other (default 1)"
    )
    add_device(p)
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
    add_model(p, tokenizer_help="tokenizer folder (default: the run's, or the export's)")
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
    add_threads(p, "torch threads (default: torch's choice)")
    p.add_argument(
        "--stream-interval",
        type=float,
        default=STREAM_INTERVAL,
        metavar="SECONDS",
        help=f"a stream's new tokens go out together at most this often (default {STREAM_INTERVAL:g}; the first at once; 0: "
        "every token as it comes, which on a CPU slows decoding: each hand-over takes a core from the model)",
    )
    add_device(p)
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
# Corpus commands: train-tokenizer, encode, decode, shards (ferrolm.bpe.pipeline, shards)
# ---------------------------------------------------------------------------------------

INPUTS_HELP = (
    "read as `ferrolm encode` reads them: text whose documents are separated by a special token, .gz/.zst "
    "compressed text, JSON Lines, Parquet; globs ('data/*.parquet') and folders are expanded, sorted"
)


def _add_train_tokenizer(sub) -> None:
    p = sub.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE tokenizer on text files",
        description="Train a byte-level BPE tokenizer (Rust trainer, all cores) and save it as a tokenizer "
        "directory (vocab.json, merges.txt, the Hugging Face files, ferrolm_tokenizer.json). Prints a summary at the end: time, peak memory, "
        "number of merges, the longest tokens and the compression (bytes per token) on a sample of the input.",
    )
    add_inputs(p, required=False, help=f"training files, {INPUTS_HELP}")
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
    add_force(p, "let --counts-out replace a file that is not a counts file of ferrolm's (never an input)")
    add_split(
        p,
        part_help="with --counts-out: count only the I-th (0-based) of N byte ranges of the inputs, cut after a "
        "special token (one job of a Slurm array, say); train later from all N counts files with --counts",
        ray_help='count --parts parts of --input as Ray tasks, then train here; needs pip install "ferrolm[ray]"',
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
    add_threads(p)
    add_output(p, metavar="DIR", help="output tokenizer directory")
    p.add_argument(
        "--sample-bytes",
        type=int,
        default=1 << 20,
        metavar="B",
        help="bytes of the first input used to measure compression (default: 1 MiB)",
    )
    add_progress(p, "no progress bars")
    p.set_defaults(run=_run_train_tokenizer)


def _run_train_tokenizer(args) -> int:
    from ferrolm.bpe import pipeline

    split = dict(input=args.input, counts=args.counts, ray=args.ray, parts=args.parts)
    if pipeline.is_split(**split, counts_out=args.counts_out, part=args.part) and args.counts_out is not None:
        h = pipeline.count_pretokens(
            args.input,
            args.counts_out,
            args.special_tokens,
            part=args.part,
            pattern=args.pattern,
            threads=args.threads,
            column=args.column,
            progress=not args.no_progress,
            force=args.force,
        )
        part = f" of part {h['part'][0]}/{h['part'][1]}" if h["part"] else ""
        print(f"wrote {args.counts_out}: {h['unique_pretokens']:,} distinct pre-tokens{part} in {h['seconds']:.1f} s")
        return 0
    done = pipeline.train_tokenizer(
        args.out,
        args.vocab_size,
        **split,
        special_tokens=args.special_tokens,
        pattern=args.pattern,
        threads=args.threads,
        column=args.column,
        progress=not args.no_progress,
    )
    tok, peak = done.tokenizer, pipeline.peak_rss_mb()
    print(f"saved {done.path} (vocab_size {tok.vocab_size}, fingerprint {tok.fingerprint[:12]})")
    print(f"time          {done.seconds:.1f} s")
    print(f"peak memory   {peak:,.0f} MB (VmHWM)" if peak is not None else "peak memory   unknown")
    print(f"merges        {len(tok.merges):,}")
    if done.sample_path is None:  # trained from counts: no text at hand to measure
        return 0
    print(f"special       {', '.join(done.special_tokens) or '(none)'}")
    _print_compression(tok, done.sample_path, args.sample_bytes, args.column)
    print("longest tokens:")
    for b in done.longest_tokens():
        print(f"  {len(b):3d} bytes  {b.decode('utf-8', 'replace')!r}")
    return 0


def _print_compression(tok, path: str, limit: int, column: str) -> None:
    """The compression line of the summary. The tokenizer is saved by now: a sample that
    cannot be read or measured costs the line (with a note why), never the exit status."""
    from ferrolm.bpe.pipeline import compression

    try:
        nbytes, n_ids = compression(tok, path, limit, column)
    except Exception as e:  # noqa: BLE001 - whatever it is, the saved tokenizer stands
        print(f"note: compression not measured: {e}", file=sys.stderr)
        return
    if n_ids:
        print(f"compression   {nbytes / n_ids:.2f} bytes/token on the first {nbytes:,} bytes of {path}")


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
    add_tokenizer(p, required=True, help="tokenizer directory (from train-tokenizer or Tokenizer.save)")
    add_inputs(
        p, help="input files, globs ('data/*.parquet') or folders, encoded in this order (each glob and folder sorted)"
    )
    add_output(
        p,
        required=True,
        metavar="PREFIX",
        help="output prefix: writes PREFIX.bin and PREFIX.json",
        force_help="replace a PREFIX.bin or PREFIX.json that is not a shard of ferrolm's (never an input)",
    )
    add_threads(p, "encoding threads (default: all cores)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "uint16", "uint32"],
        help="token dtype (default: auto = uint16 when the vocab fits)",
    )
    add_split(
        p,
        part_help="encode only the I-th (0-based) of N byte ranges of the inputs, cut at document boundaries, "
        "into PREFIX.part-I-of-N.bin/.json (for N machines or jobs; `ferrolm shards PREFIX` checks the set)",
        ray_help="encode --parts parts as Ray tasks (joins the cluster RAY_ADDRESS names, else starts a local one) "
        'and write PREFIX.manifest.json last; needs pip install "ferrolm[ray]"',
    )
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
    add_progress(p, "no progress bar")
    p.set_defaults(run=_run_encode)


def _run_encode(args) -> int:
    from ferrolm.bpe import pipeline, shards

    try:
        record, elapsed = pipeline.encode_corpus(
            args.tokenizer,
            args.input,
            args.out,
            chunk_mb=args.chunk_size,
            commit_interval=args.commit_interval,
            ray=args.ray,
            parts=args.parts,
            part=args.part,
            threads=args.threads,
            hash_inputs=not args.no_hash,
            progress=False if args.no_progress else None,
            column=args.column,
            dtype=args.dtype,
            input_format=args.input_format,
            errors=args.errors,
            force=args.force,
        )
    except KeyboardInterrupt:
        if not args.ray:
            print(
                "ferrolm encode: interrupted; rerun the same command to continue from the last completed chunk",
                file=sys.stderr,
            )
        raise
    if args.ray:
        return _print_encoded_parts(args.out, record, elapsed)
    bin_path, json_path = shards.output_paths(args.out, shards.parse_part(args.part))
    if record.get("restart_reason"):
        print(f"note: started over: {record['restart_reason']}", file=sys.stderr)
    if record.get("resumed_tokens"):
        print(f"resumed after {record['resumed_tokens']:,} tokens already written", file=sys.stderr)
    sc = record
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


def _print_encoded_parts(out, m: dict, elapsed: float) -> int:
    import ferrolm.ray

    in_bytes = m["total_input_bytes"]
    where = (
        f"{ferrolm.ray.manifest_path(out)}: {m['num_tokens']:,} {m['dtype']} tokens, {m['num_documents']:,} documents"
    )
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
    add_tokenizer(p, required=True, help="tokenizer directory")
    p.add_argument("--input", required=True, metavar="PREFIX.bin", help="shard data file (or its prefix)")
    p.add_argument("--offset", type=int, default=0, metavar="K", help="first token to decode (default: 0)")
    p.add_argument("--count", type=int, default=None, metavar="M", help="number of tokens (default: to the end)")
    p.add_argument("--dtype", default=None, choices=["uint16", "uint32"], help="dtype when the .bin has no sidecar")
    p.set_defaults(run=_run_decode)


def _run_decode(args) -> int:
    from ferrolm.bpe.pipeline import shard_text

    n, pieces = shard_text(args.tokenizer, args.input, args.offset, args.count, args.dtype)
    for text in pieces:
        sys.stdout.write(text)
    if n:
        sys.stdout.write("\n")
    sys.stdout.flush()
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
    add_tokenizer(p, help="also check the shards were made with this tokenizer")
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
        choices=["float32", "bfloat16", "float16"],
        help="weights dtype (hf; gguf: no bf16)",
    )
    p.set_defaults(run=_run_export)


def _run_export(args) -> int:
    from ferrolm.lm.export import export

    print(export(args.checkpoint, args.out, args.tokenizer, format=args.format, dtype=args.dtype, force=args.force))
    return 0


def add_eval_command(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="score a checkpoint on token shards (loss, perplexity, bits per byte) or on lm-eval tasks",
        description="Run the model over the shards in consecutive context-length windows and report the mean loss "
        "(nats/token), perplexity, bits per byte (total nats / ln 2 / UTF-8 bytes of the text; special tokens "
        "count 0 bytes; needs the tokenizer) and tokens/s.",
    )
    add_model(p)
    p.add_argument("--data", nargs="+", metavar="SHARD", help="shard prefix(es), as for training")
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

"""The `ferrolm` command: one subcommand per job (train, plot, generate and serve here; the
corpus commands in `corpus_commands`, export, eval, demo and download in `model_commands`,
chat in `chat_command`).

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
from ferrolm.app import chat_command, corpus_commands, model_commands
from ferrolm.app.args import (
    add_device,
    add_model,
    add_output,
    add_overrides,
    add_sampling,
    add_threads,
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
    p.add_argument(
        "--init-from",
        metavar="PATH",
        help="start a new run from these weights instead of a random init (run.init_from): a ferrolm run folder, "
        "checkpoint or .safetensors file, an exported Hugging Face folder, or a local Llama, Qwen3 or nanochat "
        "folder saved by transformers; the model shape and tokenizer are the source's, the optimizer and schedule "
        "start at step 0",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.set_defaults(run=_run_train)


def _preset_names() -> list:
    from ferrolm.lm.config import preset_names

    return preset_names()


def _run_train(args) -> int:
    import os

    from ferrolm.lm.config import resume_config, to_toml
    from ferrolm.lm.train import start_weights, train

    if args.config is None and args.resume is None and args.init_from is None and not args.print_config:
        raise ValueError(
            f"give --config FILE|PRESET (presets: {', '.join(_preset_names())}), --init-from PATH or --resume RUN_DIR"
        )
    cfg = resume_config(args.config, args.overrides, args.resume)
    if args.init_from is not None:
        cfg.set("run.init_from", args.init_from, source="--init-from")
    if args.print_config:
        if cfg.run.init_from and args.resume is None:
            start_weights(cfg)  # the [model] section the run will have: the source's
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
    from ferrolm.lm.generate import check_sampling_args, generate_text, resolve_device

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
    sampling = (args.max_new_tokens, args.temperature, args.top_k, args.top_p, eos, generator)
    for i in range(args.num_samples):
        if len(rows) > 1:
            texts = generate_text(model, rows, piece_of, *sampling, stop=args.stop)
            for r, (prompt, text) in enumerate(zip(prompts, texts)):
                sample = f", sample {i + 1}/{args.num_samples}" if args.num_samples > 1 else ""
                emit(f"--- prompt {r + 1}/{len(rows)}{sample} ---\n{prompt}{text}\n")
            continue
        if args.num_samples > 1:
            emit(f"--- sample {i + 1}/{args.num_samples} ---\n")
        emit(prompts[0])
        generate_text(model, rows[0], piece_of, *sampling, stop=args.stop, on_piece=lambda _, text: emit(text))
        emit("\n")
    return 0


COMMANDS.append(add_generate_command)


def add_serve_command(sub) -> None:
    from ferrolm.app.serve import (  # the standard library only: no torch, no starlette
        API_KEY_ENV,
        MAX_QUEUE,
        PREFILL_CHUNK,
        SHUTDOWN_GRACE,
        STREAM_INTERVAL,
        WRITE_TIMEOUT,
    )

    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI HTTP API (needs the serve extra)",
        description="Serve a checkpoint (or a folder written by `ferrolm export`) with OpenAI's API: POST "
        "/v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, /health and /metrics. Concurrent "
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
        "--prefill-chunk",
        type=int,
        default=PREFILL_CHUNK,
        metavar="N",
        help=f"prompt tokens prefilled per step of the running streams (default {PREFILL_CHUNK}; 0: each prompt whole)",
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
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"the /v1 routes want the header Authorization: Bearer KEY (default: ${API_KEY_ENV}; none: open)",
    )
    p.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="let browser pages on these origins call the API (CORS): comma-separated, or * for any",
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
        prefill_chunk=args.prefill_chunk,
        write_timeout=args.write_timeout,
        shutdown_grace=args.shutdown_grace,
        api_key=args.api_key,
        allowed_origins=args.allowed_origins,
    )


COMMANDS.append(add_serve_command)
COMMANDS.extend(corpus_commands.COMMANDS)
COMMANDS.extend(model_commands.COMMANDS)
COMMANDS.extend(chat_command.COMMANDS)


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

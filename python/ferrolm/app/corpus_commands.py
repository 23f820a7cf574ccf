"""The corpus commands of `ferrolm`: train-tokenizer, encode, decode, shards.

Argument parsing and printing only: the work is `ferrolm.bpe.pipeline`'s and
`ferrolm.bpe.shards`'. Nothing here imports torch.
"""

from __future__ import annotations

import sys

from ferrolm.app.args import (
    add_force,
    add_inputs,
    add_output,
    add_progress,
    add_split,
    add_threads,
    add_tokenizer,
)

COMMANDS: list = []


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

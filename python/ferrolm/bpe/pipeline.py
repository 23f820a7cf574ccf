"""The corpus jobs of the `ferrolm` command, callable from Python: train a tokenizer (in one
run, from counts files, or counted on Ray), count one part's pre-tokens, encode a corpus (in
parts on Ray too) and read a shard back as text.

    from ferrolm.bpe import pipeline
    done = pipeline.train_tokenizer("tok/", 32_000, input=["owt.txt"])
    header = pipeline.count_pretokens(["owt.txt"], "c/owt.3.counts", part="3/16")
    done = pipeline.train_tokenizer("tok/", 32_000, counts=[f"c/owt.{i}.counts" for i in range(16)])

Imports no torch. Errors name the command's options (``--vocab-size``), as the command
reports them.
"""

from __future__ import annotations

import codecs
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ferrolm._util import fix_surrogates

PathInput = Union[str, "os.PathLike[str]"]
DEFAULT_SPECIALS = ("<|endoftext|>",)
MAX_CHUNK_MB = 4096  # a chunk is held in memory per task in flight


@dataclass
class TrainedTokenizer:
    """What ``train_tokenizer`` made: the tokenizer, where it is saved, how long it took."""

    tokenizer: Any
    path: Path
    seconds: float
    special_tokens: list
    #: The first input, whose start measures the compression (None when trained from counts or on Ray).
    sample_path: str | None = None

    def longest_tokens(self, n: int = 10) -> list[bytes]:
        """The ``n`` longest ordinary tokens, longest first."""
        specials = set(self.special_tokens)
        ordinary = (b for b in self.tokenizer.vocab.values() if b.decode("utf-8", "replace") not in specials)
        return sorted(ordinary, key=lambda b: (-len(b), b))[:n]


def peak_rss_mb() -> float | None:
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


# --------------------------------------------------------------------------- training


def is_split(
    *, input=None, counts=None, counts_out=None, part=None, ray: bool = False, parts: int | None = None
) -> bool:
    """Whether these options ask for a phase of split training (counts out, counts in, or
    Ray); ValueError for options that do not go together."""
    if part is not None and counts_out is None:
        raise ValueError("--part goes with --counts-out (count one part; train later from all parts with --counts)")
    if parts is not None and not ray:
        raise ValueError("--parts goes with --ray")
    chosen = [name for name, on in (("--counts", counts), ("--counts-out", counts_out), ("--ray", ray)) if on]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} do not go together")
    if counts is not None and input is not None:
        raise ValueError("give --input (text to count) or --counts (counts files), not both")
    return bool(chosen)


def count_pretokens(
    input,
    counts_out: PathInput,
    special_tokens: Sequence[str] | None = None,
    *,
    part: str | None = None,
    pattern: str = "gpt2",
    threads: int | None = None,
    column: str = "text",
    progress: bool = True,
    force: bool = False,
) -> dict:
    """Count the pre-tokens of ``input`` (or of its ``part`` "I/N") into ``counts_out``;
    return the file's header, with the ``seconds`` it took."""
    from ferrolm.bpe import counts

    if input is None:
        raise ValueError("--counts-out needs --input")
    t0 = time.perf_counter()
    specials = list(special_tokens) if special_tokens is not None else list(DEFAULT_SPECIALS)
    header = counts.count(
        input,
        counts_out,
        specials,
        part=part,
        pattern=pattern,
        num_threads=threads,
        column=column,
        progress=progress,
        force=force,
    )
    return {**header, "seconds": time.perf_counter() - t0}


def train_tokenizer(
    out: PathInput | None,
    vocab_size: int | None,
    *,
    input=None,
    counts: Sequence[PathInput] | None = None,
    special_tokens: Sequence[str] | None = None,
    pattern: str = "gpt2",
    threads: int | None = None,
    column: str = "text",
    ray: bool = False,
    parts: int | None = None,
    progress: bool = True,
) -> TrainedTokenizer:
    """Train a tokenizer and save it to the folder ``out``: on ``input`` in one run, from
    ``counts`` files (special tokens and pattern default to theirs), or with ``ray`` counting
    ``parts`` parts of ``input`` as Ray tasks (into ``out.counts``, which a rerun reuses)."""
    if is_split(input=input, counts=counts, ray=ray, parts=parts):
        return _train_split(
            out, vocab_size, input, counts, special_tokens, pattern, threads, column, ray, parts, progress
        )
    return _train_one_run(out, vocab_size, input, special_tokens, pattern, threads, column, progress)


def _require(**values) -> None:
    for flag, value in values.items():
        if value is None:
            raise ValueError(f"--{flag.replace('_', '-')} is required")


def _train_one_run(out, vocab_size, input, special_tokens, pattern, threads, column, progress) -> TrainedTokenizer:
    from ferrolm.bpe import inputs
    from ferrolm.bpe.tokenizer import Tokenizer

    _require(input=input, vocab_size=vocab_size, out=out)
    paths = inputs.expand([input] if isinstance(input, (str, os.PathLike)) else list(input))  # folders, globs
    for path in paths:  # what exists but is no regular file, the core refuses by name
        if not os.path.exists(path):
            raise FileNotFoundError(f"input file not found: {path}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    specials = list(special_tokens) if special_tokens is not None else list(DEFAULT_SPECIALS)
    for s in specials:  # refused by the save at the end: say so before the training
        if len(s.encode("utf-8")) == 1:
            raise ValueError(
                f"--special-token {s!r} is a single byte: a tokenizer directory cannot hold it beside that byte's own token"
            )
    t0 = time.perf_counter()
    tok = Tokenizer.train(
        paths if len(paths) > 1 else paths[0],
        vocab_size,
        specials,
        pattern=pattern,
        num_threads=threads,
        progress=progress,
        column=column,
    )
    elapsed = time.perf_counter() - t0
    return TrainedTokenizer(tok, tok.save(out), elapsed, specials, sample_path=paths[0])


def _train_split(out, vocab_size, input, counts_in, special_tokens, pattern, threads, column, ray, parts, progress):
    from ferrolm.bpe import counts
    from ferrolm.bpe.tokenizer import Tokenizer

    t0 = time.perf_counter()
    _require(vocab_size=vocab_size, out=out)
    specials = list(special_tokens) if special_tokens is not None else list(DEFAULT_SPECIALS)
    if ray:
        if input is None:
            raise ValueError("--ray needs --input")
        from ferrolm.bpe import ray as ray_driver

        vocab, merges, specials, pattern = ray_driver.train_tokenizer(
            input,
            vocab_size,
            specials,
            pattern=pattern,
            parts=parts,
            work_dir=os.fspath(out).rstrip("/") + ".counts",
            num_threads=threads,
            column=column,
            progress=progress,
        )
    else:
        headers = [counts.read_header(p) for p in counts_in]
        specials = list(special_tokens) if special_tokens is not None else headers[0].get("special_tokens", [])
        pattern = pattern if pattern != "gpt2" else headers[0].get("pattern")  # gpt2: the default, not a choice
        vocab, merges = counts.train_from_counts(
            counts_in, vocab_size, specials, pattern=pattern, num_threads=threads, progress=progress
        )
    tok = Tokenizer(vocab, merges, specials, pattern)
    path = tok.save(out)
    return TrainedTokenizer(tok, path, time.perf_counter() - t0, specials)


# --------------------------------------------------------------------------- compression sample


def read_sample(path: str, limit: int, column: str = "text") -> str:
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


def compression(tok, path: str, limit: int, column: str = "text") -> tuple[int, int]:
    """``(bytes, tokens)`` of the first ``limit`` bytes of text in ``path``."""
    sample = read_sample(path, limit, column)
    return len(sample.encode("utf-8")), len(tok.encode(sample)) if sample else 0


# --------------------------------------------------------------------------- encode


def encode_corpus(
    tokenizer,
    inputs,
    out: PathInput,
    *,
    chunk_mb: float | None = None,
    commit_interval: float | None = None,
    ray: bool = False,
    parts: int | None = None,
    part: str | None = None,
    threads: int | None = None,
    hash_inputs: bool = True,
    progress: bool | None = None,
    **options,
) -> tuple[dict, float]:
    """Encode ``inputs`` into the shard ``out`` (``shards.encode``), or into its ``parts`` as
    Ray tasks with ``ray`` (``ferrolm.ray.encode``); return the sidecar (or the manifest)
    and the seconds it took. ``options``: those of ``shards.encode``."""
    from ferrolm.bpe import shards

    # The core takes whole bytes (a usize): refuse what would not fit before it is asked.
    if chunk_mb is not None and not 0 < chunk_mb <= MAX_CHUNK_MB:
        raise ValueError(f"--chunk-size must be more than 0 and at most {MAX_CHUNK_MB} MB, got {chunk_mb:g}")
    if commit_interval is not None and not 0 <= commit_interval < float("inf"):
        raise ValueError(f"--commit-interval must be a number of seconds >= 0, got {commit_interval:g}")
    tok = shards._load_tokenizer(tokenizer)
    chunk_size = int(chunk_mb * 1_000_000) if chunk_mb else None
    t0 = time.perf_counter()
    if ray or parts is not None:
        if not ray:
            raise ValueError("--parts goes with --ray (for one part of a split without Ray, use --part I/N)")
        if part is not None:
            raise ValueError(
                "--part and --ray do not go together: --ray runs every part (set their number with --parts)"
            )
        from ferrolm.bpe import ray as ray_driver

        record = ray_driver.encode(
            tok,
            inputs,
            out,
            parts=parts,
            threads_per_part=threads or 1,
            chunk_size=chunk_size,
            hash_inputs=hash_inputs,
            progress=progress is not False,
            **options,
        )
    else:
        interval = commit_interval if commit_interval is not None else shards.DEFAULT_COMMIT_INTERVAL
        record = shards.encode(
            tok,
            inputs,
            out,
            part=part,
            threads=threads,
            chunk_size=chunk_size,
            commit_interval=interval,
            hash_inputs=hash_inputs,
            progress=progress,
            **options,
        )
    return record, time.perf_counter() - t0


# --------------------------------------------------------------------------- decode


def shard_text(
    tokenizer, shard: PathInput, offset: int = 0, count: int | None = None, dtype: str | None = None
) -> tuple[int, Iterator[str]]:
    """The number of tokens ``offset`` to ``offset + count`` of the shard ``shard`` (its
    ``.bin`` or prefix; to the end when ``count`` is None) and their text, in pieces. The dtype comes from the sidecar (``dtype`` when there
    is none); the tokenizer's fingerprint must match the sidecar's."""
    import numpy as np

    from ferrolm.bpe import shards

    path = os.fspath(shard)
    path = path if path.endswith(".bin") else path + ".bin"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"shard data file not found: {path}")
    tok = shards._load_tokenizer(tokenizer)
    dtype = _shard_dtype(tok, tokenizer, path, dtype)
    size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(
            f"{path}: {size:,} bytes is not a whole number of {dtype} tokens ({itemsize} bytes each): "
            "the file is cut short or not a shard"
        )
    data = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r") if size else np.zeros(0, dtype)
    if offset < 0 or offset > len(data):
        raise ValueError(f"--offset {offset} is outside the shard's {len(data):,} tokens")
    if count is not None and count < 0:
        raise ValueError("--count must be >= 0")
    end = len(data) if count is None else min(len(data), offset + count)
    return end - offset, _decoded(tok, path, data, offset, end)


def _decoded(tok, path: str, data, start: int, end: int) -> Iterator[str]:
    import numpy as np

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    block = 1 << 20
    for at in range(start, end, block):
        ids = np.asarray(data[at : min(end, at + block)])
        bad = ids[ids >= tok.vocab_size]
        if bad.size:
            raise ValueError(
                f"{path}: token id {int(bad[0])} is not in the tokenizer's vocabulary (size {tok.vocab_size})"
            )
        yield decoder.decode(tok.decode_bytes(ids.tolist()))
    yield decoder.decode(b"", final=True)


def _shard_dtype(tok, given, path: str, dtype: str | None) -> str:
    """The shard's dtype from its sidecar (checking ``dtype`` and the tokenizer against it)."""
    sidecar_path = path[:-4] + ".json"
    if not os.path.isfile(sidecar_path):
        return dtype or ("uint16" if tok.vocab_size <= 1 << 16 else "uint32")
    with open(sidecar_path, encoding="utf-8") as f:
        sidecar = json.load(f)
    if dtype is not None and dtype != sidecar.get("dtype"):
        raise ValueError(f"--dtype {dtype} contradicts the sidecar's dtype {sidecar.get('dtype')}")
    fp = sidecar.get("tokenizer_fingerprint")
    if fp and fp != tok.fingerprint:
        raise ValueError(
            f"the tokenizer in {given} (fingerprint {tok.fingerprint[:12]}) is not the one "
            f"this shard was encoded with ({fp[:12]})"
        )
    return sidecar.get("dtype")

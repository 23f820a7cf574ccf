"""Train a byte-level BPE tokenizer with the Rust core.

``train`` reads files in chunks (never a whole file at once), pre-tokenizes and counts
in parallel, then learns the merges; it returns ``(vocab, merges)`` with ids as
docs/DESIGN.md fixes them: 0-255 the single bytes, then one id per merge in merge order,
then the special tokens. Among pairs of equal count the lexicographically greatest
``(bytes, bytes)`` is merged first. The result does not depend on ``num_threads``.

The GIL is released while the core works; Ctrl-C stops training with
KeyboardInterrupt within a fraction of a second.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Callable, Union

from ferrolm import _core
from ferrolm._util import check_special_tokens
from ferrolm.bpe import inputs as _inputs
from ferrolm.bpe import patterns

__all__ = ["train", "train_bpe"]

PathLike = Union[str, "os.PathLike[str]"]

# The largest vocab_size: ids are 32-bit and 2**32 - 1 is not an id. A request above what
# the corpus allows is not an error: training stops when no pair is left.
MAX_VOCAB_SIZE = 2**32 - 1

# Bytes the core reads from a file at a time (None: the core's default, 8 MiB). Tests
# set it small to exercise chunk boundaries.
_CHUNK_SIZE: int | None = None


def _feed_documents(trainer, batches, report) -> None:
    """Feed ``(data, offsets)`` batches of documents to the core, each document a text of its own."""
    for data, offsets in batches:
        trainer.feed_documents(data, offsets, report)


def _as_paths(input) -> list[str] | None:
    """The list of file paths `input` names, or None when it is an iterable of texts.

    A str or os.PathLike is one path, glob or folder; a list or tuple is a list of them;
    any other iterable (a generator, an iterator, ...) yields the documents themselves.
    """
    if isinstance(input, (str, os.PathLike)):
        return _inputs.expand([os.fspath(input)])
    if isinstance(input, (bytes, bytearray)):
        raise TypeError("input must be a path, a list of paths or an iterable of str, not bytes")
    if isinstance(input, (list, tuple)):
        paths = []
        for p in input:
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"a list input must hold file paths (str or os.PathLike), got {type(p).__name__}")
            paths.append(os.fspath(p))
        return _inputs.expand(paths) if paths else paths
    if not hasattr(input, "__iter__"):
        raise TypeError(f"input must be a path, a list of paths or an iterable of str, got {type(input).__name__}")
    return None


class _Progress:
    """tqdm bars fed by the core's (done, total) reports; a no-op when disabled."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def stage(self, desc: str, unit: str, total: int | None = None) -> Callable[[int, int], None] | None:
        """A new bar; returns the callback the core calls with (done, total)."""
        if not self.enabled:
            return None
        from tqdm.auto import tqdm

        self.close()
        scale = unit == "B"
        self.bar = bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000)

        def report(done: int, total_now: int) -> None:
            if total_now and bar.total != total_now:
                bar.total = total_now
            bar.n = done
            bar.refresh()

        return report

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def train(
    input: PathLike | Sequence[PathLike] | Iterable[str],
    vocab_size: int,
    special_tokens: Iterable[str] | None = ("<|endoftext|>",),
    *,
    pattern: str = "gpt2",
    num_threads: int | None = None,
    progress: bool = True,
    errors: str = "strict",
    stats: dict | None = None,
    column: str = "text",
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train byte-level BPE on `input` and return ``(vocab, merges)``.

    input: a path, glob or folder, a list (or tuple) of them, or any other iterable of
        str (e.g. ``iter(documents)``, a ``datasets`` column). Each file is its own text
        (no pre-token spans two files); each item of an iterable is a document of its own,
        as if the items were separated by a special token. A list of str is read as paths.
        Files are read as ``ferrolm encode`` reads them, with the same document boundaries:
        plain text (documents separated by a special token), ``.gz``/``.zst`` compressed
        text, JSON Lines (the ``column`` field of each record is a document) and Parquet
        (the ``column`` of each row); a UTF-8 byte-order mark at the start is skipped. Only
        regular files: a pipe or a device is refused by name.
    vocab_size: total size, 256 bytes + merges + special tokens, at most 2**32 - 1.
        Training stops early if no pair is left to merge (memory is sized by what the
        corpus allows, not by the request).
    special_tokens: split the text and are never merged across; added after the merges.
    pattern: "gpt2" (default), "cl100k", "o200k" or a custom regex (Python `regex` syntax).
    num_threads: worker threads (default: all cores); the result does not depend on it.
    progress: show tqdm progress bars (counting, then merging).
    errors: "strict" (invalid UTF-8 raises ValueError naming the file and byte offset)
        or "replace" (invalid bytes become U+FFFD, as bytes.decode(errors="replace")).
    stats: if a dict is given, it receives seconds per stage and sizes (for profiling).
    column: the text column of Parquet inputs, or field of JSON Lines records.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    specials = check_special_tokens(special_tokens)
    if vocab_size < 256 + len(specials):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: it must be at least {256 + len(specials)} (256 bytes + {len(specials)} special tokens)"
        )
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too large: token ids are 32-bit, so it can be at most {MAX_VOCAB_SIZE} "
            "(any smaller request is fine: training stops when the corpus has no pair left to merge)"
        )
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ValueError(f"num_threads must be None or a positive int, got {num_threads!r}")
    if errors not in ("strict", "replace"):
        raise ValueError(f'errors must be "strict" or "replace", got {errors!r}')
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
    patterns.resolve(pattern)  # a clear error for an empty, misspelt or invalid pattern

    paths = _as_paths(input)
    if paths is not None and not paths:
        raise ValueError("the corpus is empty: no input files given")
    trainer = _core.BpeTrainer(specials, pattern, num_threads, errors, _CHUNK_SIZE)
    bars = _Progress(progress)
    try:
        if paths is not None:
            _count_files(trainer, paths, input, column, bars.stage("counting", "B"))
        else:
            _feed_documents(trainer, _inputs.text_batches(input), bars.stage("counting", "B"))  # type: ignore[arg-type]
        num_merges = vocab_size - 256 - len(specials)
        merges, vocab = trainer.learn(num_merges, bars.stage("merging", "merge", num_merges))
    finally:
        bars.close()
    if stats is not None:
        stats.update(trainer.stats())

    # vocab: the 256 bytes, then one token per merge (built by the core).
    for s in specials:
        vocab[len(vocab)] = s.encode("utf-8")
    return vocab, merges


def _count_files(trainer, paths: list[str], input, column: str, report) -> None:
    """The files through the core's input reader, the one ``ferrolm encode`` reads with."""
    try:
        trainer.count_files(paths, column, report)
    except FileNotFoundError as e:
        if isinstance(input, (list, tuple)):
            e.strerror = (
                f"{e.strerror} (a list is read as file paths; to train on strings pass an iterator, e.g. iter(texts))"
            )
        raise


def train_bpe(
    input_path: PathLike | Sequence[PathLike] | Iterable[str],
    vocab_size: int,
    special_tokens: Iterable[str] | None = ("<|endoftext|>",),
    **kwargs,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """``train`` without progress bars by default: returns ``(vocab, merges)``."""
    kwargs.setdefault("progress", False)
    return train(input_path, vocab_size, special_tokens, **kwargs)

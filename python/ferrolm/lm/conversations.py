"""Conversations as training data: read, checked, and rendered into three flat arrays.

A conversation is one JSON Lines row (``{"messages": [{"role", "content"}, ...]}`` or the
bare list) or one Parquet row with a ``messages`` column, read from the files, globs and
folders that ``ferrolm.bpe.inputs.expand`` names (``.gz``/``.zst`` JSON Lines too), or from
any iterable of conversations. Each row is checked with ``ferrolm.lm.chat.check_conversation``
and rendered with ``ferrolm.lm.chat.render``; a malformed row (bad JSON, a missing role, roles
out of order, content that is not a string, an empty conversation) is counted and named by
file and row, never silently dropped, and the data is refused when the bad rows exceed a
share of all rows (``max_bad_share``; 0: any bad row refuses).

The rendered data is held as ``ids`` (uint32), ``mask`` (uint8: 1 where the loss counts)
and ``offsets`` (int64: conversation i is ``ids[offsets[i]:offsets[i + 1]]``), in memory:
about 5 bytes per token and no Python object per conversation. Rendering is the Rust
encoder's work and takes seconds per million tokens, so a cache on disk would cost an
invalidation scheme (by tokenizer and input identity) for little gain.

A conversation longer than a training row is cropped to the row (its tail dropped),
counted and reported.
"""

from __future__ import annotations

import io
import json
import os
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrolm.bpe import inputs
from ferrolm.lm.chat import ConversationError, render

__all__ = [
    "ConversationData",
    "ConversationDataError",
    "read_conversations",
    "is_conversation_source",
    "LISTED_BAD_ROWS",
]

#: Bad rows named in a report; the count covers all of them.
LISTED_BAD_ROWS = 10
#: File names read as conversations (the rest of a run's data are token shards; a .json is a
#: shard sidecar or manifest unless data.format says "conversations").
_SUFFIXES = (".jsonl", ".ndjson", ".parquet", ".pq")
_COMPRESSED = (".gz", ".zst", ".zstd")


class ConversationDataError(ValueError):
    """Conversation data that cannot be trained on: too many malformed rows, or none usable."""


@dataclass
class ConversationData:
    """Rendered conversations: ``ids``, ``mask`` and ``offsets`` (see the module), with the
    counts of what was read: ``kept`` conversations, ``bad`` rows (the first
    ``LISTED_BAD_ROWS`` in ``bad_rows`` as "file:row: reason"), ``cropped`` conversations."""

    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    sources: list[str]
    eos_id: int
    vocab_size: int
    fingerprint: str
    bad: int = 0
    cropped: int = 0
    bad_rows: list[str] = field(default_factory=list)

    @property
    def kept(self) -> int:
        return len(self.offsets) - 1

    @property
    def paths(self) -> list[str]:
        return self.sources

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def report(self, name: str) -> dict[str, int]:
        """The counts as metrics, each key prefixed by ``name`` (train / val)."""
        return {
            f"{name}_conversations": self.kept,
            f"{name}_bad_rows": self.bad,
            f"{name}_cropped": self.cropped,
            f"{name}_tokens": len(self),
        }

    def summary(self, name: str) -> str:
        """One line for the run's log, and the bad rows listed below it when there are any."""
        line = f"{name}: {self.kept:,} conversations, {len(self):,} tokens"
        if self.cropped:
            line += f"; {self.cropped:,} longer than a row, cropped to it"
        if self.bad:
            line += f"; {self.bad:,} malformed row(s) skipped:\n" + _listing(self.bad, self.bad_rows)
        return line


def _listing(bad: int, rows: list[str]) -> str:
    more = f"\n  ... and {bad - len(rows):,} more" if bad > len(rows) else ""
    return "\n".join(f"  {r}" for r in rows) + more


def is_conversation_source(source: Any) -> bool:
    """Whether ``source`` names conversation files (JSON Lines or Parquet, by their names)
    or is an iterable of conversations, rather than token shards."""
    if _is_paths(source) and isinstance(source, (list, tuple)):
        return all(is_conversation_source(s) for s in source)
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source).lower()
        for ext in _COMPRESSED:
            name = name.removesuffix(ext)
        if name.endswith(_SUFFIXES):
            return True
        return os.path.isdir(source) and any(is_conversation_source(p) for p in inputs.expand(source)[:1])
    return isinstance(source, Iterable)


# --------------------------------------------------------------------------- reading


def _open_text(path: str):
    lower = path.lower()
    if lower.endswith(".gz"):
        import gzip

        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="")
    if lower.endswith((".zst", ".zstd")):
        try:
            import zstandard
        except ImportError:
            raise ImportError(
                f'{path}: reading .zst files needs the zstandard package: pip install "ferrolm[zstd]"'
            ) from None
        return io.TextIOWrapper(zstandard.open(path, "rb"), encoding="utf-8", errors="replace", newline="")
    return open(path, encoding="utf-8", errors="replace", newline="")


def _jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row number from 1, the parsed object or a ConversationError) for each non-blank line."""
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                yield number, ConversationError(f"not valid JSON ({e.msg} at column {e.colno})")


def _parquet_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row number from 1, messages) of a Parquet file's ``messages`` column, a batch at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading conversations from Parquet needs pyarrow: pip install pyarrow") from None
    pf = pq.ParquetFile(path)
    if "messages" not in pf.schema_arrow.names:
        raise ConversationDataError(f"{path}: has no 'messages' column (columns: {', '.join(pf.schema_arrow.names)})")
    number = 0
    for batch in pf.iter_batches(columns=["messages"], batch_size=1024):
        for messages in batch.column(0).to_pylist():
            number += 1
            yield number, messages


def _rows(source: Any) -> Iterator[tuple[str, int, Any]]:
    """(where, row number, conversation or error) of every row of ``source``."""
    if _is_paths(source):
        for path in inputs.expand(source):
            reader = _parquet_rows if inputs.is_parquet(path) else _jsonl_rows
            if not os.path.isfile(path):
                raise FileNotFoundError(f"conversation file not found: {path}")
            for number, row in reader(path):
                yield path, number, row
        return
    for number, row in enumerate(source, 1):
        yield "conversations", number, row


def _is_paths(source: Any) -> bool:
    """A path, or a list of them (not a list of conversations)."""
    if isinstance(source, (str, os.PathLike)):
        return True
    return isinstance(source, (list, tuple)) and bool(source) and all(isinstance(s, (str, os.PathLike)) for s in source)


def _messages(row: Any) -> Any:
    if isinstance(row, Mapping):
        if "messages" not in row:
            raise ConversationError("the row has no 'messages' list")
        return row["messages"]
    return row


def _sources(source: Any) -> list[str]:
    return inputs.expand(source) if _is_paths(source) else ["conversations"]


def read_conversations(
    source: Any, tokenizer: Any, *, row_len: int, max_bad_share: float = 0.01, name: str = "data"
) -> ConversationData:
    """Read, check and render every conversation of ``source`` with ``tokenizer`` (which
    has the chat tokens); crop each to ``row_len`` tokens. ``name`` (e.g. "data.train")
    names the data in errors. ConversationDataError when the malformed rows are more than
    ``max_bad_share`` of all rows, or no conversation is left."""
    if not 0 <= max_bad_share <= 1:
        raise ValueError(f"max_bad_share must be in [0, 1], got {max_bad_share}")
    ids, mask, offsets = array("I"), array("B"), array("q", [0])
    bad, cropped, listed = 0, 0, []
    for where, number, row in _rows(source):
        try:
            if isinstance(row, ConversationError):
                raise row
            conv_ids, conv_mask = render(tokenizer, _messages(row))
        except ConversationError as e:
            bad += 1
            if len(listed) < LISTED_BAD_ROWS:
                listed.append(f"{where}:{number}: {e}")
            continue
        if len(conv_ids) > row_len:
            cropped += 1
            conv_ids, conv_mask = conv_ids[:row_len], conv_mask[:row_len]
        ids.extend(conv_ids)
        mask.extend(conv_mask)
        offsets.append(len(ids))
    total = bad + len(offsets) - 1
    if bad and bad > max_bad_share * total:
        raise ConversationDataError(
            f"{name}: {bad:,} of {total:,} rows are not usable conversations; data.max_bad_share = "
            f"{max_bad_share:g} allows {int(max_bad_share * total):,}:\n{_listing(bad, listed)}"
        )
    if total == bad:
        raise ConversationDataError(f"{name}: holds no conversation ({_sources(source)[0]} ...)")
    return ConversationData(
        ids=np.frombuffer(ids, dtype=np.uint32),
        mask=np.frombuffer(mask, dtype=np.uint8),
        offsets=np.frombuffer(offsets, dtype=np.int64),
        sources=_sources(source),
        eos_id=tokenizer.special_token_ids["<|endoftext|>"],
        vocab_size=tokenizer.vocab_size,
        fingerprint=tokenizer.fingerprint,
        bad=bad,
        cropped=cropped,
        bad_rows=listed,
    )

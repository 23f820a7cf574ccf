"""Type stubs for ferrolm's compiled core (rust/python.rs). Each section names its owner."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Sequence

# ---- package ---------------------------------------------------------------------------

def version() -> str:
    """The version of the compiled core."""

# ---- pre-tokenizer (rust/pretokenize.rs) ------------------------------------------------

def pretokenize(text: str, pattern: str = "gpt2") -> list[str]:
    """Pre-tokenize ``text`` with a named ("gpt2", "cl100k", "o200k") or custom pattern."""

def pattern_source(name: str) -> str:
    """The regex source of a built-in pattern name."""

def _char_classes(text: str) -> list[int]:
    """Bit flags of the pre-tokenizer's Unicode classes, one per char (for tests)."""

# ---- encoder (rust/encode.rs) ------------------------------------------------------------

class Encoder:
    """ferrolm's compiled byte-level BPE encoder; ``ferrolm.Tokenizer`` wraps it.

    ``vocab`` maps id -> token bytes (ids below 2^32 - 1), ``merges`` lists (left, right) in
    rank order, special tokens are looked up by their UTF-8 bytes and appended after the
    largest id when absent. Raises ValueError (malformed vocab/merges/specials/pattern) or
    TypeError (wrong types).
    """

    def __init__(self, vocab: dict[int, bytes], merges: Iterable[tuple[bytes, bytes]], special_tokens: Iterable[str], pattern: str = "gpt2") -> None: ...
    @property
    def vocab_size(self) -> int:
        """One more than the largest id (special tokens included)."""
    @property
    def num_merges(self) -> int: ...
    @property
    def pattern(self) -> str:
        """The pre-tokenizer's regex source."""
    @property
    def special_tokens(self) -> list[tuple[str, int]]:
        """(token, id) in the order given."""
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Ids of ``text``. UnicodeEncodeError for lone surrogates (the Tokenizer repairs them)."""
    def encode_to_buffer(self, text: str, allow_special: bool = True, itemsize: int = 4, num_threads: int | None = None) -> bytearray:
        """Ids as little-endian uint16 (itemsize 2) or uint32 (4); large texts in parallel."""
    def encode_file(self, path: str | os.PathLike[str], allow_special: bool = True, itemsize: int = 4, num_threads: int | None = None) -> bytearray:
        """A whole UTF-8 file (invalid bytes read as U+FFFD), as encode_to_buffer."""
    def encode_batch(self, texts: Iterable[str], allow_special: bool = True, num_threads: int | None = None) -> list[list[int]]:
        """Each text's ids, in parallel over texts (None: all cores; 1: this thread)."""
    def encode_batch_to_buffer(self, texts: Iterable[str], allow_special: bool = True, itemsize: int = 4, num_threads: int | None = None) -> tuple[bytearray, bytearray]:
        """Flat little-endian ids and len(texts) + 1 little-endian uint64 offsets."""
    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Concatenated token bytes; ValueError for an id not in the vocabulary."""
    def decode_bytes_u32le(self, data: bytes) -> bytes:
        """decode_bytes of ids given as little-endian uint32 bytes."""
    def token_bytes(self, id: int) -> bytes | None: ...
    def stream(self, allow_special: bool = True) -> StreamEncoder:
        """Incremental encoding: ids equal those of encoding the concatenated chunks."""

class StreamEncoder:
    def feed(self, chunk: str) -> list[int]:
        """Add a chunk; returns the ids that can no longer change."""
    def finish(self) -> list[int]:
        """The remaining ids; the stream is then empty (and reusable)."""
    @property
    def buffered(self) -> int:
        """Bytes buffered and not yet encoded."""

# ---- shard writer (rust/shards.rs) --------------------------------------------------------

def encode_shard(
    encoder: Encoder,
    inputs: Sequence[str | os.PathLike[str]],
    out_bin: str | os.PathLike[str],
    *,
    dtype: str,
    eos: tuple[str, int] | None = None,
    jsonl_field: str = "text",
    input_format: str | None = None,
    errors: str = "strict",
    chunk_size: int = ...,
    threads: int = 0,
    window: int = 0,
    part: tuple[int, int] | None = None,
    newline_cuts: bool = True,
    params: str = "",
    commit_interval: float = 5.0,
    progress: Callable[[int, int, int, int], Any] | None = None,
    progress_interval: float = 0.1,
    hash: bool = True,
) -> dict[str, Any]:
    """Encode input files into ``out_bin + ".partial"`` (resumable); returns a result dict."""

def shard_part_range(
    inputs: Sequence[str | os.PathLike[str]],
    i: int,
    n: int,
    *,
    eos: str | None = None,
    input_format: str | None = None,
    newline_cuts: bool = True,
) -> tuple[int, int]:
    """The byte range of the concatenated inputs that part ``i`` of ``n`` covers."""

# ---- BPE trainer (rust/train.rs) ----------------------------------------------------------

class BpeTrainer:
    def __init__(self, special_tokens: Sequence[str], pattern: str = "gpt2", num_threads: int | None = None, errors: str = "strict", chunk_size: int | None = None) -> None: ...
    def count_files(self, paths: Sequence[str | os.PathLike[str]], progress: Callable[[int, int], Any] | None = None) -> None: ...
    def feed_text(self, text: str, progress: Callable[[int, int], Any] | None = None) -> None: ...
    def finish_text(self, progress: Callable[[int, int], Any] | None = None) -> None: ...
    def learn(self, num_merges: int, progress: Callable[[int, int], Any] | None = None) -> list[tuple[bytes, bytes]]: ...
    def stats(self) -> dict[str, Any]: ...

"""Type stubs for ferrolm's compiled core (rust/python.rs).

The core is an implementation detail behind `ferrolm.Tokenizer`, `ferrolm.bpe_trainer`
and `ferrolm.shards`; these stubs let editors and mypy check those modules.
"""

import os
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import numpy as np

Progress = Optional[Callable[..., Any]]

def version() -> str: ...
def unicode_version() -> str: ...
def pretokenize(text: str, pattern: str = "gpt2") -> list[str]: ...
def pattern_source(name: str) -> str: ...
def _char_classes(text: str) -> bytes: ...
def read_vocab_json(text: str, special_tokens: Sequence[str]) -> Optional[dict[int, bytes]]:
    """vocab.json's text as {id: token bytes}; None when ferrolm.tokenizer_files must read it."""

def read_merges_txt(text: str) -> Optional[list[tuple[bytes, bytes]]]:
    """merges.txt's text as [(left, right)]; None when ferrolm.tokenizer_files must read it."""

class BpeTrainer:
    def __new__(
        cls,
        special_tokens: Sequence[str],
        pattern: str = "gpt2",
        num_threads: Optional[int] = None,
        errors: str = "strict",
        chunk_size: Optional[int] = None,
    ) -> BpeTrainer: ...
    def count_files(self, paths: Sequence[str], progress: Progress = None) -> None: ...
    def count_part(
        self, paths: Sequence[str], i: int, n: int, field: str = "text", progress: Progress = None
    ) -> list[tuple[str, int, int]]: ...
    def feed_text(self, text: str, progress: Progress = None) -> None: ...
    def feed_documents(self, data: Any, offsets: Any, progress: Progress = None) -> None: ...
    def finish_text(self, progress: Progress = None) -> None: ...
    def learn(
        self, num_merges: int, progress: Progress = None
    ) -> tuple[list[tuple[bytes, bytes]], dict[int, bytes]]: ...
    def stats(self) -> dict[str, Any]: ...

def count_part_ranges(
    paths: Sequence[str], special_tokens: Sequence[str], i: int, n: int, field: str = "text"
) -> list[tuple[str, int, int]]:
    """The (path, start, end) byte ranges that BpeTrainer.count_part(paths, i, n) counts."""

class Encoder:
    def __new__(
        cls,
        vocab: dict[int, bytes],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Sequence[str],
        pattern: str = "gpt2",
    ) -> Encoder: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def num_merges(self) -> int: ...
    @property
    def pattern(self) -> str: ...
    @property
    def special_tokens(self) -> list[tuple[str, int]]:
        """(token, id) in the order given."""
    def vocab(self) -> dict[int, bytes]:
        """{id: token bytes}, special tokens included, in id order (a new dict)."""
    def merges(self) -> list[tuple[bytes, bytes]]:
        """The merges in rank order, as given (a new list)."""
    def fingerprint(self, special_tokens: Sequence[str], pattern: str) -> str:
        """ferrolm.tokenizer_files.fingerprint of this vocab and these merges."""
    def tokens_not_made_by_merges(self) -> list[int]:
        """Ids of the tokens (special tokens included) that merging their own bytes does not
        make, in id order: plain BPE, without the whole-piece lookup, never outputs them."""
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Ids of ``text``. UnicodeEncodeError for lone surrogates (the Tokenizer repairs them)."""
    def encode_to_array(
        self, text: str, allow_special: bool = True, itemsize: int = 4, num_threads: int | None = None
    ) -> np.ndarray:
        """Ids as a numpy array of uint16 (itemsize 2) or uint32 (4); large texts in parallel."""
    def encode_file(
        self,
        path: str | os.PathLike[str],
        allow_special: bool = True,
        itemsize: int = 4,
        num_threads: int | None = None,
    ) -> np.ndarray:
        """A whole UTF-8 file (invalid bytes read as U+FFFD), as encode_to_array."""
    def encode_batch(
        self, texts: Iterable[str], allow_special: bool = True, num_threads: int | None = None
    ) -> list[list[int]]:
        """Each text's ids, in parallel over texts (None: all cores; 1: this thread)."""
    def encode_batch_to_arrays(
        self, texts: Iterable[str], allow_special: bool = True, itemsize: int = 4, num_threads: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Flat ids (uint16 or uint32) and len(texts) + 1 int64 offsets, as numpy arrays."""
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

class ParquetDocs:
    """The documents of a Parquet file's text column, a batch of about ``batch_bytes`` at a time."""

    def __new__(cls, path: str, column: str = "text", batch_bytes: int = 1 << 20) -> ParquetDocs: ...
    @property
    def num_rows(self) -> int: ...
    def next_batch(self) -> Optional[tuple[Any, Any]]:
        """``(data, offsets)``: uint8 UTF-8 text and int64 n + 1 offsets; None at the end."""

def encode_shard(
    encoder: Encoder,
    inputs: Sequence[str],
    out_bin: str,
    *,
    dtype: str,
    eos: Optional[tuple[str, int]] = None,
    jsonl_field: str = "text",
    input_format: Optional[str] = None,
    errors: str = "strict",
    chunk_size: int = ...,
    threads: int = 0,
    window: int = 0,
    part: Optional[tuple[int, int]] = None,
    newline_cuts: bool = True,
    params: str = ...,
    commit_interval: float = 5.0,
    progress: Progress = None,
    progress_interval: float = 0.1,
    hash: bool = True,
    docs: Any = None,  # open(i) -> int | None, next_batch() -> (uint8 array, int64 offsets) | None
) -> dict[str, Any]: ...
def shard_part_range(
    inputs: Sequence[str],
    i: int,
    n: int,
    *,
    eos: Optional[int] = None,
    input_format: Optional[str] = None,
    newline_cuts: bool = True,
) -> tuple[int, int]: ...

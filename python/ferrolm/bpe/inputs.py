"""Inputs as people hold them: globs and folders of files, Parquet files, iterables of str.

* ``expand(specs)``: paths, globs (``data/*.parquet``, ``**`` recursive) and folders (every
  file below, hidden ones skipped) to a list of files, each glob and folder sorted.
* Parquet: the core reads a text column a batch of rows at a time, as UTF-8 data plus int64
  offsets, so no Python code runs per document and memory stays flat. The trainer and the
  shard writer read Parquet inputs themselves, through the core's one input reader;
  ``parquet_batches`` hands the batches to Python (a sample for a summary).
* ``text_batches``: an iterable of str in the same form (a loop per document is inherent).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from ferrolm._util import fix_surrogates

if TYPE_CHECKING:
    import numpy as np

PARQUET_MAGIC = b"PAR1"
#: Characters per batch taken from an iterable of str.
TEXT_BATCH_CHARS = 1 << 20
_GLOB_CHARS = frozenset("*?[")


def expand(specs: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The files that paths, globs and folders name, in order (each glob or folder sorted)."""
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    out: list[str] = []
    for spec in specs:
        s = os.fspath(spec)
        if _GLOB_CHARS & set(s) and not os.path.exists(s):
            found = sorted(p for p in glob.glob(s, recursive=True) if os.path.isfile(p))
            if not found:
                raise FileNotFoundError(f"no file matches {s!r}")
            out.extend(found)
        elif os.path.isdir(s):
            found = sorted(_files_below(s))
            if not found:
                raise FileNotFoundError(f"folder {s} holds no files")
            out.extend(found)
        else:
            out.append(s)
    return out


def _files_below(folder: str) -> Iterator[str]:
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if not name.startswith("."):
                yield os.path.join(root, name)


def is_parquet(path: str) -> bool:
    """A Parquet file, by name or by its magic number."""
    if path.lower().endswith((".parquet", ".pq")):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == PARQUET_MAGIC
    except OSError:
        return False


def parquet_batches(path: str, column: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The documents of ``column`` in ``path``, in row order, about 1 MB of text at a time
    (decoded by the core's Parquet reader while the GIL is released)."""
    from ferrolm._core import ParquetDocs

    docs = ParquetDocs(os.fspath(path), column)
    while (batch := docs.next_batch()) is not None:
        yield batch


def text_batches(texts: Iterable[str], batch_chars: int = TEXT_BATCH_CHARS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """An iterable of str as ``(data, offsets)`` batches (lone surrogates become U+FFFD)."""
    batch: list[bytes] = []
    size = 0
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"an iterable of documents must yield str, got {type(text).__name__}")
        try:
            b = text.encode("utf-8")
        except UnicodeEncodeError:
            b = fix_surrogates(text).encode("utf-8")
        batch.append(b)
        size += len(b)
        if size >= batch_chars:
            yield _join(batch)
            batch, size = [], 0
    if batch:
        yield _join(batch)


def _join(docs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return np.frombuffer(b"".join(docs), dtype=np.uint8), offsets


class DocReader:
    """The core's reader of documents from Python (``open(i)``, ``next_batch()``): one
    iterable of str, input ``""``."""

    def __init__(self, texts: Iterable[str]):
        self.texts: Iterable[str] | None = texts
        self._batches: Iterator[tuple[np.ndarray, np.ndarray]] = iter(())

    def open(self, i: int) -> None:
        if self.texts is None:
            raise ValueError("an iterable of documents can be read only once")
        self._batches, self.texts = text_batches(self.texts), None

    def next_batch(self) -> tuple[np.ndarray, np.ndarray] | None:
        return next(self._batches, None)

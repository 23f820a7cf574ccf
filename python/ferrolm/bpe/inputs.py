"""Inputs as people hold them: globs and folders of files, Parquet files, iterables of str.

* ``expand(specs)``: paths, globs (``data/*.parquet``, ``**`` recursive) and folders (every
  file below, hidden ones skipped) to a list of files, each glob and folder sorted.
* Parquet: the core reads a text column a batch of rows at a time, as UTF-8 data plus int64
  offsets, so no Python code runs per document and memory stays flat. The trainer and the
  shard writer read Parquet inputs themselves, through the core's one input reader;
  ``parquet_batches`` hands the batches to Python (a sample for a summary).
* ``text_batches``: an iterable of str in the same form (a loop per document is inherent).
* ``identity``: which version of an input file a part, a counts file or a rerun was made
  from (size, modification time and a hash of sampled windows: cheap at any size).
"""

from __future__ import annotations

import glob
import hashlib
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from ferrolm._util import fix_surrogates

if TYPE_CHECKING:
    import numpy as np

PARQUET_MAGIC = b"PAR1"
#: Characters per batch taken from an iterable of str.
TEXT_BATCH_CHARS = 1 << 20
_GLOB_CHARS = frozenset("*?[")
#: Bytes in each window that ``identity`` hashes, and the windows spread between the first
#: and the last: about 1 MiB read per file, whatever its size.
SAMPLE_WINDOW = 1 << 16
SAMPLE_SPREAD = 16


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


# --------------------------------------------------------------------------- identity


def sample_offsets(size: int) -> list[int]:
    """Where the windows that ``identity`` hashes start in a file of ``size`` bytes: all of
    a file of up to ``SAMPLE_SPREAD + 2`` windows, else the first window, the last, and
    ``SAMPLE_SPREAD`` spread evenly between them."""
    w = SAMPLE_WINDOW
    if size <= (SAMPLE_SPREAD + 2) * w:
        return list(range(0, size, w))
    last = size - w
    return [0, *(last * j // (SAMPLE_SPREAD + 1) for j in range(1, SAMPLE_SPREAD + 1)), last]


def identity(path: str | os.PathLike) -> list:
    """``[absolute path, size, mtime_ns, sha256 of the sampled windows]``: what tells one
    version of an input file from another without reading it whole. An edit that changes
    the size or the modification time, or any byte inside a window, gives another identity;
    an edit outside the windows that keeps size and modification time does not."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        # Opening a FIFO would wait for a writer: the reader refuses such inputs by name.
        return [os.path.abspath(path), st.st_size, st.st_mtime_ns, None]
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        h = hashlib.sha256()
        for at in sample_offsets(st.st_size):
            f.seek(at)
            h.update(f.read(SAMPLE_WINDOW))
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns, h.hexdigest()]


def identity_change(recorded: Sequence, now: Sequence) -> str | None:
    """What differs between two identities of one file (``None`` when nothing does). A
    record of ``[path, size]`` alone, as older counts files hold, is compared by size only."""
    if recorded[1] != now[1]:
        return f"size {recorded[1]:,} then {now[1]:,} bytes"
    if len(recorded) < 4 or len(now) < 4:
        return None
    if recorded[2] != now[2]:
        return "modification time"
    if recorded[3] != now[3]:
        return "sampled bytes"
    return None

"""Inputs as people hold them: globs and folders of files, Parquet files, iterables of str.

* ``expand(specs)``: paths, globs (``data/*.parquet``, ``**`` recursive) and folders (every
  file below, hidden ones skipped) to a list of files, each glob and folder sorted.
* Parquet: pyarrow (the ``ferrolm[parquet]`` extra) decodes one batch of rows at a time and
  its text column goes to the Rust core as two numpy views of Arrow's buffers (UTF-8 data
  and int64 offsets), so no Python code runs per document and memory stays flat.
* ``TextBatches``: an iterable of str in the same form (a loop per document is inherent).
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
#: Text per batch read from a Parquet file, about one encoder chunk (the core then encodes
#: the batch's buffer without copying it). pyarrow's cost per batch is flat from a few
#: hundred rows up; batches of tens of MB cost more (fresh pages faulted in for every
#: buffer, batches that span row groups concatenated) and hold back the first encode.
PARQUET_BATCH_BYTES = 1 << 20
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


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            "reading Parquet needs pyarrow: pip install 'ferrolm[parquet]' (or pip install pyarrow)"
        ) from None
    return pa, pq


def arrow_text(column, where: str):
    """A string column (chunked, dictionary-encoded, string or large_string) as one
    string or large_string array without nulls (a null is no document)."""
    pa, _ = _pyarrow()
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{where} is of type {column.type}, not a string column")
    return column.drop_null() if column.null_count else column


def arrow_buffers(arr) -> tuple[np.ndarray, np.ndarray]:
    """``(data, offsets)``: a numpy view of a string array's UTF-8 data (no copy) and its
    offsets as int64."""
    import numpy as np

    _, offsets, data = arr.buffers()
    width = np.int64 if arr.type.id == _pyarrow()[0].large_string().id else np.int32
    offs = np.frombuffer(offsets, dtype=width)[arr.offset : arr.offset + len(arr) + 1].astype(np.int64, copy=False)
    text = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    return text, offs


def parquet_batches(path: str, column: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The documents of ``column`` in ``path``, in row order, a batch of rows at a time."""
    _, pq = _pyarrow()
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if column not in names:
        shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
        raise ValueError(f"{path} has no column {column!r} (its columns: {shown}); choose one with --column")
    # One decoding thread: the core's threads are busy encoding.
    for batch in pf.iter_batches(batch_size=_batch_rows(pf), columns=[column], use_threads=False):
        arr = arrow_text(batch.column(0), f"column {column!r} of {path}")
        if len(arr):
            yield arrow_buffers(arr)


def prefetched(batches: Iterator, depth: int = 1) -> Iterator:
    """``batches`` produced on a thread of their own, ``depth`` ahead: pyarrow decodes
    without the GIL, so the next batch is read while the core encodes this one."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for b in batches:
                if not put(b):
                    return
            put(done)
        except BaseException as e:  # handed to the consumer, raised there
            put(e)

    threading.Thread(target=produce, daemon=True, name="ferrolm-parquet").start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def _batch_rows(pf) -> int:
    """Rows per batch for about PARQUET_BATCH_BYTES of (uncompressed) data."""
    md = pf.metadata
    if not md.num_rows or not md.num_row_groups:
        return 1024
    per_row = max(1, sum(md.row_group(g).total_byte_size for g in range(md.num_row_groups)) // md.num_rows)
    return max(64, PARQUET_BATCH_BYTES // per_row)


def parquet_rows(path: str) -> int:
    _, pq = _pyarrow()
    return pq.ParquetFile(path).metadata.num_rows


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
    """The core's reader of document inputs (``open(i)``, ``next_batch()``): Parquet files
    by index, or one iterable of str (input ``""``)."""

    def __init__(self, paths: Sequence[str], column: str, texts: Iterable[str] | None = None):
        self.paths = list(paths)
        self.column = column
        self.texts = texts
        self._batches: Iterator[tuple[np.ndarray, np.ndarray]] = iter(())

    def open(self, i: int) -> int | None:
        path = self.paths[i]
        if path == "":
            if self.texts is None:
                raise ValueError("an iterable of documents can be read only once")
            self._batches, self.texts = text_batches(self.texts), None
            return None
        self._batches = prefetched(parquet_batches(path, self.column))
        return parquet_rows(path)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray] | None:
        return next(self._batches, None)

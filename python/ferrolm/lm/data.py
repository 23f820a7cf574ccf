"""Token data for training: random windows over a flat token array, and shard files.

`get_batch` draws `batch_size` windows of `context_length + 1` tokens from a 1-D token
array (numpy, np.memmap or torch) at uniformly random start positions and returns
(inputs, targets), targets being inputs shifted by one.

`TokenShards` opens the ``.bin`` + ``.json`` shard pairs written by ``ferrolm encode``
(the format is described in its docstring) with ``np.memmap``: nothing is read into RAM
until a window is drawn.

Training draws its rows from one of two sources, both with a state a checkpoint saves so
that a resumed run sees exactly the rows an uninterrupted one would have:
`RandomWindows` (windows at uniform random starts: get_batch's), `DocumentRows` (each
row begins at a document start, documents packed best-fit) and `ConversationRows` (whole
conversations packed best-fit, with a loss mask). `BatchPrefetcher` prepares the next
batch of any of them on a background thread.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from ferrolm.bpe.shards import FORMAT, MANIFEST_FORMAT, ShardError, find_parts, manifest_parts, read_json_object
from ferrolm.lm.device import unavailable
from ferrolm.lm.functional import IGNORE_INDEX

__all__ = [
    "get_batch",
    "TokenShards",
    "ShardError",
    "tokenizer_fingerprint",
    "RandomWindows",
    "DocumentRows",
    "ConversationRows",
    "packed_rows",
    "masked_targets",
    "BatchPrefetcher",
]

PathLike = Union[str, "os.PathLike[str]"]

SUPPORTED_FORMAT_VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


# ---------------------------------------------------------------------------------------
# get_batch
# ---------------------------------------------------------------------------------------


def _check_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)  # raises RuntimeError on a malformed device string
    problem = unavailable(dev)
    if problem:
        raise RuntimeError(f"device {str(device)!r} requested but {problem}")
    return dev


def _gather_windows(tokens, starts: np.ndarray, width: int) -> np.ndarray:
    """(len(starts), width) int64 array of tokens[s : s + width] for each start s."""
    if isinstance(tokens, torch.Tensor):
        idx = torch.from_numpy(starts)[:, None] + torch.arange(width)
        return tokens.detach().cpu()[idx].to(torch.int64).numpy()
    if isinstance(tokens, TokenShards):
        return tokens._windows(starts, width)
    arr = np.asarray(tokens)
    if len(starts) and starts.max() + width <= len(arr) and len(arr) > 0:
        # One fancy-index gather touches only the pages of the windows (memmap-friendly).
        idx = starts[:, None] + np.arange(width, dtype=np.int64)
        return arr[idx].astype(np.int64)
    return (
        np.stack([np.asarray(arr[s : s + width], dtype=np.int64) for s in starts])
        if len(starts)
        else np.zeros((0, width), np.int64)
    )


def _to_device(windows: np.ndarray, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.from_numpy(windows)
    x, y = both[:, :-1], both[:, 1:]
    if dev.type == "cuda":
        # Pinned host memory lets the copy overlap with compute.
        x = x.contiguous().pin_memory().to(dev, non_blocking=True)
        y = y.contiguous().pin_memory().to(dev, non_blocking=True)
        return x, y
    return x.contiguous().to(dev), y.contiguous().to(dev)


def sample_starts(
    n_tokens: int, batch_size: int, context_length: int, generator: torch.Generator | None = None
) -> np.ndarray:
    """`batch_size` start positions drawn uniformly from [0, n_tokens - context_length - 1]."""
    if context_length < 1:
        raise ValueError(f"context_length must be >= 1, got {context_length}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    high = n_tokens - context_length  # exclusive upper bound for torch.randint
    if high < 1:
        raise ValueError(
            f"need at least context_length + 1 = {context_length + 1} tokens to draw a window, have {n_tokens}"
        )
    return torch.randint(0, high, (batch_size,), generator=generator).numpy().astype(np.int64)


def get_batch(
    tokens,
    batch_size: int,
    context_length: int,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training windows from a 1-D token array.

    Start positions are uniform over [0, len(tokens) - context_length - 1]; returns
    (inputs, targets), both int64 of shape (batch_size, context_length) on `device`, with
    targets[i, j] == inputs[i, j + 1] (the next token). `generator` (a torch.Generator)
    makes the draw reproducible. An unknown or unavailable device raises RuntimeError.
    """
    dev = _check_device(device)
    starts = sample_starts(len(tokens), batch_size, context_length, generator)
    return _to_device(_gather_windows(tokens, starts, context_length + 1), dev)


# ---------------------------------------------------------------------------------------
# Tokenizer fingerprints
# ---------------------------------------------------------------------------------------


def _is_legacy_record(path: Path) -> bool:
    """Whether ``path`` is a ferrolm 0.1.0 folder's record (not an HF tokenizer.json)."""
    try:
        with open(path, encoding="utf-8") as f:
            return '"ferrolm-tokenizer"' in f.read(4096)
    except (OSError, UnicodeDecodeError):
        return False


def tokenizer_fingerprint(tokenizer) -> str:
    """The fingerprint string of `tokenizer`.

    Accepts a fingerprint string, a tokenizer directory (its record is read), a path
    to a record, or an object with a ``fingerprint`` attribute or method.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        s = os.fspath(tokenizer)
        if re.fullmatch(r"[0-9a-fA-F]{64}", s):
            return s.lower()
        p = Path(s)
        if p.is_dir():
            from ferrolm.bpe import files

            if not (p / files.RECORD_FILE).is_file() and not _is_legacy_record(p / files.LEGACY_RECORD_FILE):
                from ferrolm.bpe.tokenizer import Tokenizer

                return Tokenizer.load(p).fingerprint  # a folder of an HF tokenizer.json
            p = p / (files.RECORD_FILE if (p / files.RECORD_FILE).is_file() else files.LEGACY_RECORD_FILE)
        if p.is_file():
            from ferrolm.bpe.files import read_config

            fp = read_config(p).get("fingerprint")
            if not isinstance(fp, str):
                raise ShardError(f"{p}: has no fingerprint")
            return fp
        raise FileNotFoundError(
            f"tokenizer not found: {s} (expected a tokenizer directory, its tokenizer.json, or a 64-hex fingerprint)"
        )
    fp = getattr(tokenizer, "fingerprint", None)
    if callable(fp):
        fp = fp()
    if isinstance(fp, str):
        return fp
    raise TypeError(f"cannot get a tokenizer fingerprint from {type(tokenizer).__name__}")


# ---------------------------------------------------------------------------------------
# TokenShards
# ---------------------------------------------------------------------------------------


class _Part:
    __slots__ = ("prefix", "meta", "tokens")

    def __init__(self, prefix: Path, meta: dict, tokens: np.ndarray):
        self.prefix = prefix
        self.meta = meta
        self.tokens = tokens


def _strip_suffix(path: Path) -> Path:
    if path.suffix in (".bin", ".json"):
        return path.with_suffix("")
    return path


def _open_part(prefix: Path, meta: dict | None = None) -> _Part:
    json_path = prefix.with_name(prefix.name + ".json")
    bin_path = prefix.with_name(prefix.name + ".bin")
    if meta is None:
        meta = read_json_object(json_path)
    if meta.get("format") != FORMAT:
        raise ShardError(f'{json_path}: not a ferrolm shard sidecar (missing "format": "{FORMAT}")')
    version = meta.get("format_version")
    if not isinstance(version, int) or version > SUPPORTED_FORMAT_VERSION:
        raise ShardError(
            f"{json_path}: format_version {version!r} is not supported (this ferrolm reads <= {SUPPORTED_FORMAT_VERSION})"
        )
    dtype_name = meta.get("dtype")
    if dtype_name not in _DTYPES:
        raise ShardError(f"{json_path}: dtype must be 'uint16' or 'uint32', got {dtype_name!r}")
    dtype = _DTYPES[dtype_name]
    for key in ("num_tokens", "vocab_size"):
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ShardError(f"{json_path}: {key} must be a non-negative integer, got {v!r}")
    if dtype_name == "uint16" and meta["vocab_size"] > 65536:
        raise ShardError(f"{json_path}: vocab_size {meta['vocab_size']} does not fit dtype uint16")
    eos = meta.get("eos_id")
    if eos is not None and (not isinstance(eos, int) or not 0 <= eos < max(meta["vocab_size"], 1)):
        raise ShardError(f"{json_path}: eos_id {eos!r} is not an id below vocab_size {meta['vocab_size']}")
    if not isinstance(meta.get("tokenizer_fingerprint"), str):
        raise ShardError(f"{json_path}: tokenizer_fingerprint is missing")
    try:
        size = bin_path.stat().st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"shard data not found: {bin_path} (its sidecar {json_path.name} exists)") from None
    expected = meta["num_tokens"] * dtype.itemsize
    if size != expected:
        raise ShardError(
            f"{bin_path}: size {size} bytes, but {json_path.name} says num_tokens {meta['num_tokens']} x {dtype.itemsize} bytes = {expected} (truncated or still being written?)"
        )
    if meta["num_tokens"] == 0:
        tokens = np.zeros(0, dtype=dtype)
    else:
        tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(meta["num_tokens"],))
    return _Part(prefix, meta, tokens)


def _open_raw(bin_path: Path, dtype: str) -> _Part:
    """A token file without a sidecar (nanoGPT's train.bin): little-endian ids of `dtype`;
    vocab size, eos and tokenizer are unknown (None)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'uint16' or 'uint32', got {dtype!r}")
    itemsize = _DTYPES[dtype].itemsize
    size = bin_path.stat().st_size
    if size % itemsize:
        raise ShardError(f"{bin_path}: {size} bytes is not a whole number of {dtype} tokens")
    n = size // itemsize
    tokens = np.memmap(bin_path, dtype=_DTYPES[dtype], mode="r", shape=(n,)) if n else np.zeros(0, _DTYPES[dtype])
    meta = {"dtype": dtype, "num_tokens": n, "vocab_size": None, "eos_id": None, "tokenizer_fingerprint": None}
    return _Part(bin_path.with_suffix(""), meta, tokens)


def _resolve(src, dtype: str | None = None) -> list[_Part]:
    if isinstance(src, (list, tuple)):
        if not src:
            raise ShardError("an empty list of shards was given")
        out: list[_Part] = []
        for s in src:
            out.extend(_resolve(s, dtype))
        return out
    if not isinstance(src, (str, os.PathLike)):
        raise TypeError(f"shard source must be a path or a list of paths, got {type(src).__name__}")
    path = Path(src)
    if path.suffix == ".json" and path.is_file():
        record = read_json_object(path)
        if record.get("format") == MANIFEST_FORMAT:
            return _resolve(manifest_parts(path, record))
        return [_open_part(path.with_suffix(""), record)]
    prefix = _strip_suffix(path)
    if prefix.with_name(prefix.name + ".json").is_file():
        part = _open_part(prefix)
        if dtype is not None and part.meta["dtype"] != dtype:
            raise ShardError(f"{prefix}.json says dtype {part.meta['dtype']}, not the {dtype} given")
        return [part]
    parts = find_parts(prefix)
    if parts:
        return [_open_part(p) for p in parts]
    raw = prefix.with_name(prefix.name + ".bin")
    if raw.is_file():
        if dtype is None:
            raise ShardError(
                f"{raw} has no sidecar {raw.with_suffix('.json').name}; for a raw token file (as nanoGPT's "
                "train.bin) give its dtype: TokenShards(path, dtype='uint16'), or data.dtype = \"uint16\" in the config"
            )
        return [_open_raw(raw, dtype)]
    raise FileNotFoundError(
        f"no shards found at {src}: expected {prefix.name}.bin + {prefix.name}.json, {prefix.name}.part-I-of-N.*, or a manifest .json"
    )


class TokenShards:
    """A read-only view of one or more token shards as a single flat token sequence.

    `src` is a shard prefix P (P.bin + P.json, or all parts P.part-I-of-N), a path to a
    P.json or P.bin, a manifest .json, or a list of these; parts are concatenated in order.
    If `tokenizer` (a Tokenizer, a tokenizer directory, or a fingerprint string) is given,
    its fingerprint must equal the shards'. The .bin files are memory-mapped, never loaded.
    A .bin without a sidecar (nanoGPT's train.bin) opens when its `dtype` is given
    ("uint16" or "uint32"); its vocab_size, eos_id and fingerprint are then None.

    ``len(shards)`` is the number of tokens; ``shards[i]`` an int and ``shards[a:b]`` an
    int64 numpy array (slices may cross part boundaries).
    """

    def __init__(self, src, tokenizer=None, dtype: str | None = None):
        self._parts = _resolve(src, dtype or None)
        first = self._parts[0].meta
        where0 = self._parts[0].prefix
        for part in self._parts[1:]:
            for key in ("dtype", "vocab_size", "eos_id", "tokenizer_fingerprint"):
                if part.meta.get(key) != first.get(key):
                    raise ShardError(
                        f"shards disagree on {key}: {where0}.json has {first.get(key)!r}, {part.prefix}.json has {part.meta.get(key)!r}"
                    )
        self.dtype: str = first["dtype"]
        self.vocab_size: int | None = first["vocab_size"]
        self.eos_id: int | None = first.get("eos_id")
        self.fingerprint: str | None = first["tokenizer_fingerprint"]
        self.num_documents: int = sum(int(p.meta.get("num_documents") or 0) for p in self._parts)
        sizes = np.array([len(p.tokens) for p in self._parts], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(sizes)])
        if tokenizer is not None:
            self.check_tokenizer(tokenizer)

    # -- identity ------------------------------------------------------------------------
    @property
    def paths(self) -> list[str]:
        """The shard prefixes, in order."""
        return [str(p.prefix) for p in self._parts]

    @property
    def metadata(self) -> list[dict]:
        return [dict(p.meta) for p in self._parts]

    def check_tokenizer(self, tokenizer) -> None:
        """Raise ShardError unless `tokenizer`'s fingerprint equals the shards' (raw token
        files record none: nothing to check)."""
        if self.fingerprint is None:
            return
        fp = tokenizer_fingerprint(tokenizer)
        if fp != self.fingerprint:
            raise ShardError(
                f"tokenizer mismatch: shards {self.paths[0]} were encoded with tokenizer {self.fingerprint[:16]}..., "
                f"but the given tokenizer is {fp[:16]}...; re-encode the corpus with this tokenizer"
            )

    def __repr__(self) -> str:
        return f"TokenShards({len(self)} tokens in {len(self._parts)} part(s), dtype={self.dtype}, vocab_size={self.vocab_size})"

    # -- sequence protocol ----------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._range(start, stop)
            idx = np.arange(start, stop, step, dtype=np.int64)
            if len(idx) == 0:
                return np.zeros(0, dtype=np.int64)
            lo = int(idx.min())
            return self._range(lo, int(idx.max()) + 1)[idx - lo]
        if isinstance(key, (int, np.integer)):
            i = int(key)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"token index {key} out of range for {n} tokens")
            p = int(np.searchsorted(self._offsets, i, side="right")) - 1
            return int(self._parts[p].tokens[i - self._offsets[p]])
        raise TypeError(f"TokenShards indices must be integers or slices, not {type(key).__name__}")

    def _range(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        p = int(np.searchsorted(self._offsets, start, side="right")) - 1
        pieces = []
        while start < stop:
            base = int(self._offsets[p])
            end = min(stop, int(self._offsets[p + 1]))
            pieces.append(np.asarray(self._parts[p].tokens[start - base : end - base], dtype=np.int64))
            start = end
            p += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        if len(self._parts) == 1:
            windows = _gather_windows(self._parts[0].tokens, starts, width)
        elif len(starts):
            windows = np.stack([self._range(int(s), int(s) + width) for s in starts])
        else:
            windows = np.zeros((0, width), np.int64)
        # A corrupt shard would otherwise fail deep in the model (an IndexError on the CPU,
        # a device-side assert on CUDA); one max over the batch costs microseconds.
        if windows.size and self.vocab_size is not None and windows.max() >= self.vocab_size:
            self._bad_id(starts, windows)
        return windows

    def _bad_id(self, starts: np.ndarray, windows: np.ndarray):
        row, col = np.unravel_index(int(np.argmax(windows)), windows.shape)
        pos = int(starts[row]) + int(col)
        p = int(np.searchsorted(self._offsets, pos, side="right")) - 1
        raise ShardError(
            f"{self._parts[p].prefix}.bin holds token id {int(windows[row, col])} at token {pos - int(self._offsets[p]):,}, "
            f"not below the vocab_size {self.vocab_size} of its sidecar: the shard is corrupt "
            f"(`ferrolm shards --deep` lists such ids)"
        )

    # -- sampling -------------------------------------------------------------------------
    def get_batch(
        self,
        batch_size: int,
        context_length: int,
        device: str | torch.device = "cpu",
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random (inputs, targets) windows over all parts; see `ferrolm.lm.data.get_batch`."""
        return get_batch(self, batch_size, context_length, device, generator)

    def windows_at(
        self, starts: Sequence[int] | np.ndarray, context_length: int, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for the windows starting at the given positions (fixed eval sets)."""
        dev = _check_device(device)
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) and (starts.min() < 0 or starts.max() + context_length + 1 > len(self)):
            raise IndexError(f"window start out of range for {len(self)} tokens and context {context_length}")
        return _to_device(self._windows(starts, context_length + 1), dev)


# ---------------------------------------------------------------------------------------
# Row sources: random windows and document-aligned rows
# ---------------------------------------------------------------------------------------


class RandomWindows:
    """``batch_size`` windows of ``context_length + 1`` tokens at uniform random starts
    (get_batch's draw); the state is the generator's."""

    def __init__(self, tokens, batch_size: int, context_length: int, generator: torch.Generator):
        self.tokens, self.batch_size, self.context_length = tokens, batch_size, context_length
        self.generator = generator

    def next_rows(self, n: int | None = None) -> np.ndarray:
        """The next ``n`` rows (default ``batch_size``)."""
        starts = sample_starts(len(self.tokens), n or self.batch_size, self.context_length, self.generator)
        return _gather_windows(self.tokens, starts, self.context_length + 1)

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


class DocumentRows:
    """Rows of ``context_length + 1`` tokens that each begin at a document start, with
    documents packed best-fit.

    A document is the span from an end-of-text token up to the next one (shards put eos
    after each document, so the eos before a document opens it and a row's first token
    is an eos: the model always sees where a document begins). Documents are read in
    stream order, from a start drawn from ``generator`` (then moved to the next eos),
    wrapping around at the end; the span before the stream's first eos is not used.
    Each row is filled from a buffer of ``buffer_size`` documents: repeatedly the longest
    document that fits in what is left of the row (the oldest among equals), and when
    none fits, the shortest, cropped to fill the row. A document longer than a row is
    cropped to one row when it enters the buffer; a cropped tail is dropped.

    Deterministic from the generator's seed; ``state()`` (an int64 tensor of fixed length
    for a given buffer size: the stream position, pass count, and the buffer) and
    ``set_state`` replay the exact rows.
    """

    _SCAN = 1 << 16  # tokens read at a time when looking for the next eos

    def __init__(
        self,
        tokens,
        eos_id: int,
        batch_size: int,
        context_length: int,
        generator: torch.Generator,
        buffer_size: int = 1000,
    ):
        if buffer_size < 1 or batch_size < 1 or context_length < 1:
            raise ValueError("batch_size, context_length and buffer_size must be >= 1")
        self.tokens, self.eos_id = tokens, int(eos_id)
        self.batch_size, self.row_len, self.buffer_size = batch_size, context_length + 1, buffer_size
        self._n = len(tokens)
        begin = int(torch.randint(0, max(self._n, 1), (1,), generator=generator))
        first = self._find_eos(begin)
        if first is None:
            first = self._find_eos(0)
        if first is None:
            raise ShardError(
                f"data.batching = 'documents' needs documents separated by the end-of-text id {eos_id}, "
                "and the training shards hold none"
            )
        self.cursor = first  # the eos that opens the next document not yet in the buffer
        self.passes = 0  # times the stream wrapped around
        self.serial = 0  # documents read so far: the age order among equal lengths
        self.buffer: list[tuple[int, int, int]] = []  # sorted (length, serial, start)

    def _find_eos(self, pos: int) -> int | None:
        """The first eos position >= pos, or None before the end of the stream."""
        while pos < self._n:
            chunk = np.asarray(self.tokens[pos : min(pos + self._SCAN, self._n)])
            hits = np.flatnonzero(chunk == self.eos_id)
            if len(hits):
                return pos + int(hits[0])
            pos += len(chunk)
        return None

    def _read_document(self) -> None:
        start = self.cursor
        nxt = self._find_eos(start + 1)
        if nxt is None:  # the last document: the stream wraps around
            end, nxt = self._n, self._find_eos(0)
            self.passes += 1
        else:
            end = nxt
        self.cursor = nxt
        length = min(end - start, self.row_len)
        if length >= 2:  # an eos alone carries nothing to learn
            bisect.insort(self.buffer, (length, self.serial, start))
        self.serial += 1

    def _take(self, room: int) -> tuple[int, int]:
        """(start, tokens taken) of the document chosen for ``room`` free tokens."""
        passes = self.passes
        while len(self.buffer) < self.buffer_size:
            self._read_document()
            if not self.buffer and self.passes > passes + 1:
                raise ShardError(
                    "data.batching = 'documents': the training shards hold no document of 2 tokens or more"
                )
        i = bisect.bisect_right(self.buffer, (room, float("inf"))) - 1
        if i < 0:  # nothing fits: the shortest, cropped
            length, _, start = self.buffer.pop(0)
            return start, room
        i = bisect.bisect_left(self.buffer, (self.buffer[i][0], -1))  # the oldest of that length
        length, _, start = self.buffer.pop(i)
        return start, length

    def next_rows(self, n: int | None = None) -> np.ndarray:
        """The next ``n`` rows (default ``batch_size``)."""
        rows = np.empty((n or self.batch_size, self.row_len), dtype=np.int64)
        for r in range(rows.shape[0]):
            filled = 0
            while filled < self.row_len:
                start, take = self._take(self.row_len - filled)
                rows[r, filled : filled + take] = self.tokens[start : start + take]
                filled += take
        vocab_size = getattr(self.tokens, "vocab_size", None)
        if vocab_size is not None and rows.max() >= vocab_size:  # as TokenShards' windows check
            raise ShardError(
                f"the training shards hold token id {int(rows.max())}, not below their vocab_size {vocab_size}: "
                "a shard is corrupt (`ferrolm shards --deep` lists such ids)"
            )
        return rows

    def state(self) -> torch.Tensor:
        return _packer_state([self.cursor, self.passes, self.serial], self.buffer, self.buffer_size)

    def set_state(self, state: torch.Tensor) -> None:
        why = "a document loader state for a buffer of {} documents (saved with another data.batching or data.doc_buffer?)"
        (self.cursor, self.passes, self.serial), self.buffer = _packer_unstate(state, 3, self.buffer_size, why)


def _packer_state(head: list[int], buffer: list[tuple], buffer_size: int) -> torch.Tensor:
    """A best-fit packer's state as one int64 tensor: ``head``, the buffer's length, then
    ``buffer_size`` slots of 3 ints (unused ones -1), so its size never changes."""
    body = np.full((buffer_size, 3), -1, dtype=np.int64)
    if buffer:
        body[: len(buffer)] = np.asarray(buffer, dtype=np.int64)
    front = np.asarray([*head, len(buffer)], dtype=np.int64)
    return torch.from_numpy(np.concatenate([front, body.reshape(-1)]))


def _packer_unstate(state: torch.Tensor, head: int, buffer_size: int, what: str) -> tuple[list[int], list[tuple]]:
    """(head values, buffer) of a ``_packer_state`` tensor; ValueError "not WHAT" when it is
    not one of this shape (``what`` formatted with ``buffer_size``)."""
    values = state.tolist()
    if state.dtype != torch.int64 or len(values) != head + 1 + 3 * buffer_size:
        raise ValueError("not " + what.format(buffer_size))
    count = values[head]
    body = values[head + 1 : head + 1 + 3 * count]
    return values[:head], [tuple(body[i : i + 3]) for i in range(0, len(body), 3)]


class ConversationRows:
    """Rows of ``context_length + 1`` tokens packed best-fit from whole conversations, with
    their loss masks (a ``ConversationData``'s, cropped to a row when it was read).

    Conversations are read in a shuffled order, a new permutation each pass over the data
    (drawn from a seed taken once from ``generator``). Each row is filled from a buffer of
    ``buffer_size`` conversations, as ``DocumentRows`` fills it: repeatedly the longest that
    fits in what is left of the row (the oldest among equals); when none fits, the rest of
    the row is padding, the end-of-text id with mask 0. A conversation is never split, so a
    row's first token is a conversation's opening end-of-text, and under ``model.doc_mask``
    each padding token is a document of its own.

    ``next_rows()`` gives (ids, mask), both (batch_size, context_length + 1). ``state()`` (an
    int64 tensor of fixed length for a given buffer size: seed, pass, position, the buffer)
    and ``set_state`` replay the exact rows. ``real`` and ``total`` count the tokens handed
    out that are conversation and all of them (the padding share is 1 - real / total).
    """

    def __init__(self, data, batch_size: int, context_length: int, generator: torch.Generator, buffer_size: int = 1000):
        if buffer_size < 1 or batch_size < 1 or context_length < 1:
            raise ValueError("batch_size, context_length and buffer_size must be >= 1")
        if data.kept < 1:
            raise ValueError("no conversation to pack")
        self.data, self.batch_size, self.row_len, self.buffer_size = data, batch_size, context_length + 1, buffer_size
        self._lengths = np.minimum(data.lengths(), self.row_len)
        self.seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        self.passes, self.position, self.serial = 0, 0, 0
        self.buffer: list[tuple[int, int, int]] = []  # sorted (length, serial, conversation index)
        self._order: tuple[int, np.ndarray] | None = None
        self.real = self.total = 0

    def _permutation(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.passes:
            g = torch.Generator()
            g.manual_seed((self.seed + self.passes) % 2**63)
            self._order = (self.passes, torch.randperm(self.data.kept, generator=g).numpy())
        return self._order[1]

    def _read(self) -> None:
        index = int(self._permutation()[self.position])
        bisect.insort(self.buffer, (int(self._lengths[index]), self.serial, index))
        self.serial += 1
        self.position += 1
        if self.position == self.data.kept:
            self.passes, self.position = self.passes + 1, 0

    def _take(self, room: int) -> Optional[tuple[int, int]]:
        """(conversation index, length) of the longest buffered one that fits ``room``, or None."""
        while len(self.buffer) < self.buffer_size:
            self._read()
        i = bisect.bisect_right(self.buffer, (room, float("inf"))) - 1
        if i < 0:
            return None
        i = bisect.bisect_left(self.buffer, (self.buffer[i][0], -1))  # the oldest of that length
        length, _, index = self.buffer.pop(i)
        return index, length

    def next_rows(self, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` rows (default ``batch_size``) and their loss masks."""
        ids = np.full((n or self.batch_size, self.row_len), self.data.eos_id, dtype=np.int64)
        mask = np.zeros(ids.shape, dtype=np.uint8)
        start = self.data.offsets
        for r in range(ids.shape[0]):
            filled = 0
            while filled < self.row_len and (took := self._take(self.row_len - filled)) is not None:
                index, length = took
                at = int(start[index])
                ids[r, filled : filled + length] = self.data.ids[at : at + length]
                mask[r, filled : filled + length] = self.data.mask[at : at + length]
                filled += length
            self.real += filled
        self.total += ids.size
        return ids, mask

    def state(self) -> torch.Tensor:
        return _packer_state([self.seed, self.passes, self.position, self.serial], self.buffer, self.buffer_size)

    def set_state(self, state: torch.Tensor) -> None:
        why = "a conversation loader state for a buffer of {} conversations (saved with other data or another data.doc_buffer?)"
        head, self.buffer = _packer_unstate(state, 4, self.buffer_size, why)
        self.seed, self.passes, self.position, self.serial = head


def packed_rows(data, context_length: int, max_rows: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of fixed rows of ``context_length + 1`` tokens holding the conversations
    of ``data`` in order, each row filled until the next one does not fit, then padded
    (end-of-text, mask 0): every conversation once, the same rows each time (validation)."""
    row_len = context_length + 1
    rows: list[tuple[int, int]] = []  # (first conversation, end) per row
    first, filled = 0, 0
    lengths = np.minimum(data.lengths(), row_len)
    for i, n in enumerate(lengths.tolist()):
        if filled + n > row_len:
            rows.append((first, i))
            first, filled = i, 0
        filled += n
    rows.append((first, len(lengths)))
    rows = rows[:max_rows] if max_rows else rows
    ids = np.full((len(rows), row_len), data.eos_id, dtype=np.int64)
    mask = np.zeros((len(rows), row_len), dtype=np.uint8)
    for r, (a, b) in enumerate(rows):
        at = 0
        for i in range(a, b):
            lo, n = int(data.offsets[i]), int(lengths[i])
            ids[r, at : at + n] = data.ids[lo : lo + n]
            mask[r, at : at + n] = data.mask[lo : lo + n]
            at += n
    return ids, mask


def masked_targets(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of rows with a loss mask: targets shifted by one, each target whose
    mask is 0 replaced by ``functional.IGNORE_INDEX`` (the loss leaves it out)."""
    return ids[:, :-1].contiguous(), ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)  # new tensors: ids kept


# ---------------------------------------------------------------------------------------
# Batches prepared ahead of the step
# ---------------------------------------------------------------------------------------


class BatchPrefetcher:
    """The batches of a row source (default: ``RandomWindows(tokens, ..., generator)``, i.e.
    get_batch's draws), in order, each gathered on a background thread while the step
    before it runs.

    On CUDA the rows are gathered into pinned host memory there too, so the step itself
    only queues a non-blocking copy. One batch is drawn ahead, so ``loader_state()`` is
    the source's state *before* the next batch not yet handed out: what a checkpoint
    saves for a resume that replays exactly the batches this run would have seen.

    ``plan``, when given, maps a batch's index (counted from ``first``, the index of the
    first batch this prefetcher hands out) to its number of rows: a batch-size schedule,
    known before the batch is drawn.
    """

    def __init__(
        self,
        tokens,
        batch_size: int,
        context_length: int,
        device,
        generator: torch.Generator | None = None,
        *,
        rows: RandomWindows | DocumentRows | ConversationRows | None = None,
        plan: Callable[[int], int] | None = None,
        first: int = 0,
    ):
        if rows is None:
            if generator is None:
                raise ValueError("BatchPrefetcher needs a generator or a row source")
            rows = RandomWindows(tokens, batch_size, context_length, generator)
        self.rows = rows
        self.device = _check_device(device)
        self.plan, self.index = plan, first
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrolm-batches")
        self._next = self._pool.submit(self._load, self.index)

    def _load(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        state = self.rows.state()
        rows = self.rows.next_rows() if self.plan is None else self.rows.next_rows(self.plan(index))
        if isinstance(rows, tuple):  # conversations: (ids, loss mask)
            x, y = masked_targets(torch.from_numpy(rows[0]), torch.from_numpy(rows[1]))
            count = int(rows[1][:, 1:].sum())
        else:
            both = torch.from_numpy(rows)
            x, y = both[:, :-1].contiguous(), both[:, 1:].contiguous()
            count = y.numel()
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return state, x, y, count

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) on the device; starts preparing the one after."""
        return self.next_counted()[:2]

    def next_counted(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The next (inputs, targets, number of targets the loss counts) (``next``'s batch,
        and its count taken on the host: no device sync)."""
        _, x, y, count = self._next.result()
        self.index += 1
        self._next = self._pool.submit(self._load, self.index)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True), count

    def loader_state(self) -> torch.Tensor:
        return self._next.result()[0]

    generator_state = loader_state  # the name from when random windows were the only source

    def close(self) -> None:
        self._pool.shutdown(wait=True)

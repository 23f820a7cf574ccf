"""ferrolm's Tokenizer: byte-level BPE backed by the Rust core (``ferrolm._core.Encoder``).

Semantics are those of docs/DESIGN.md and of ``ferrolm.bpe.reference.Tokenizer`` (the pure-Python
ground truth); with GPT-2's vocab and merges the ids equal tiktoken's.

    tok = Tokenizer.from_files("vocab.json", "merges.txt", special_tokens=["<|endoftext|>"])
    ids = tok.encode("Hello world<|endoftext|>")
    tok.decode(ids)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from ferrolm import _core
from ferrolm._util import atomic_write_bytes, check_special_tokens, fix_surrogates, is_high_surrogate
from ferrolm.bpe import files as tf
from ferrolm.bpe import hf, patterns
from ferrolm.bpe.fileformat import EOT

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

PathInput = Union[str, "os.PathLike[str]"]


# encode_iterable feeds the core at most this many chars at a time, so that the ids of one
# feed (a list of 8-byte slots) stay small however large the chunks are.
_FEED_MAX = 1 << 16


def _split_chunk(chunk: str) -> Iterator[str]:
    """``chunk`` in parts of about _FEED_MAX chars, never cut after a high surrogate (a
    surrogate pair stays in one part, so repairing parts equals repairing the whole)."""
    start, n = 0, len(chunk)
    while start < n:
        end = min(start + _FEED_MAX, n)
        if end < n and is_high_surrogate(chunk[end - 1]):
            end += 1
        yield chunk[start:end]
        start = end


def _check_no_repeated_merges(merges: list) -> None:
    """A merge listed twice has no single rank (the encoder would use its first, HF's
    tokenizers reading the saved tokenizer.json its last): refuse it."""
    pairs = [(bytes(a), bytes(b)) for a, b in merges]
    if len(set(pairs)) != len(pairs):
        first: dict[tuple[bytes, bytes], int] = {}
        for k, pair in enumerate(pairs):
            if first.setdefault(pair, k) != k:
                raise ValueError(f"merges[{k}] {pair!r} repeats merges[{first[pair]}]: each merge is listed once")


def _numpy():
    import numpy

    return numpy


class Tokenizer:
    """Encode and decode with a byte-level BPE vocabulary, its merges and special tokens.

    ``vocab`` maps id -> token bytes, ``merges`` lists (left, right) pairs in rank order.
    A Tokenizer built from a given vocab (e.g. GPT-2's) uses that vocab's own ids; special
    tokens are looked up by their UTF-8 bytes and appended after the largest id when absent.
    ``pattern`` is "gpt2", "cl100k", "o200k" or a regex (Python ``regex`` syntax).
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Sequence[str] | None = None,
        pattern: str = "gpt2",
    ):
        if not isinstance(vocab, dict):
            raise TypeError(f"vocab must be a dict[int, bytes], got {type(vocab).__name__}")
        if isinstance(merges, (str, bytes, dict)):
            raise TypeError(f"merges must be a list of (bytes, bytes) tuples, got {type(merges).__name__}")
        merges = list(merges)
        specials = check_special_tokens(special_tokens)
        source = patterns.resolve(pattern)
        self._core = _core.Encoder(vocab, merges, specials, source)
        _check_no_repeated_merges(merges)
        # The vocab and merges are not kept in Python (GPT-2's take ~20 MB as Python
        # objects): `_vocab` and `_merges` rebuild them from the compiled core when used.
        self._special_tokens = specials
        self._special_ids: dict[str, int] = dict(self._core.special_tokens)
        self._pattern = source
        self._fingerprint: str | None = None
        # Bytes per id of the numpy calls' default dtype: uint16 when the vocab fits.
        self._default_itemsize = 2 if self._core.vocab_size <= 1 << 16 else 4
        # What `vocab` and `merges` hand out: built on first access, then kept.
        self._vocab_dict: dict[int, bytes] | None = None
        self._merges_list: list[tuple[bytes, bytes]] | None = None

    @property
    def _vocab(self) -> dict[int, bytes]:
        """id -> token bytes (special tokens included), a new dict built by the core."""
        return self._core.vocab()

    @property
    def _merges(self) -> list[tuple[bytes, bytes]]:
        """The merges in rank order, a new list built by the core."""
        return self._core.merges()

    # ---- construction from and to files -------------------------------------------

    @classmethod
    def from_files(
        cls,
        vocab_path: PathInput,
        merges_path: PathInput,
        special_tokens: Sequence[str] | None = None,
        pattern: str = "gpt2",
    ) -> Tokenizer:
        """Load GPT-2-style vocab.json and merges.txt (byte-to-unicode form).

        A merge listed twice in merges.txt is refused (HF tokenizers' ``BPE.from_file``
        accepts it and ranks it at its last line). A pre-token that is itself a token
        encodes as that token, as in tiktoken (HF's ``ignore_merges``)."""
        specials = check_special_tokens(special_tokens)
        vocab = tf.read_vocab(vocab_path, specials, fast=True)
        merges = tf.read_merges(merges_path, fast=True)
        return cls(vocab, merges, specials, pattern)

    def save(self, directory: PathInput, *, model_max_length: int | None = None) -> Path:
        """Write the tokenizer directory (vocab.json, merges.txt, the HF files and ferrolm's
        record) whole or not at all. ``model_max_length``: what transformers records as the
        longest input (default 1024; an exported model gives its context length)."""
        return tf.save_dir(
            directory,
            self._vocab,
            self._merges,
            self._special_tokens,
            self._pattern,
            self.fingerprint,
            special_ids=self._special_id_pairs(),
            model_max_length=model_max_length,
        )

    def _special_id_pairs(self) -> list[tuple[str, int]]:
        return [(s, self._special_ids[s]) for s in self._special_tokens]

    @classmethod
    def load(cls, directory: PathInput) -> Tokenizer:
        """Load a directory written by :meth:`save` (or by ferrolm 0.1.0), checking its
        checksums and fingerprint; a folder holding only an HF tokenizer.json, or the path
        of such a file, loads as :meth:`from_hf` does."""
        if Path(directory).is_file():  # an HF tokenizer.json given by its path
            return cls.from_hf(directory)
        loaded = tf.load_dir(directory, fast=True)
        tok = cls(loaded.vocab, loaded.merges, loaded.special_tokens, loaded.pattern)
        tf.check_fingerprint(loaded, tok.fingerprint)
        return tok

    @classmethod
    def from_hf(cls, path: PathInput, *, assume_normalized: bool = False) -> Tokenizer:
        """Load a byte-level BPE HF ``tokenizer.json`` (a file, or a folder holding one):
        GPT-2's, or the Split-regex + ByteLevel kind of Llama-3 and Qwen2, with their added
        tokens as special tokens. What ferrolm does not model (Unigram, WordPiece,
        normalizers, ...) raises a TokenizerFileError that names it; ``assume_normalized=True``
        accepts a normalizer (Qwen2's NFC) for text that is already normalized. Ids equal
        HF tokenizers' on every file both accept: a merge listed twice ranks at its last
        line, and ``ignore_merges: false`` (the default) is plain BPE, the tokens no merge
        makes from their own bytes left out of the vocab (BPE never outputs them)."""
        vocab, merges, specials, pattern = hf.read_hf_tokenizer(path, assume_normalized=assume_normalized)
        return cls(vocab, merges, specials, pattern)

    @classmethod
    def train(
        cls,
        input: Any,
        vocab_size: int,
        special_tokens: Sequence[str] | None = (EOT,),
        *,
        pattern: str = "gpt2",
        num_threads: int | None = None,
        progress: bool = True,
        column: str = "text",
    ) -> Tokenizer:
        """Train a byte-level BPE tokenizer with ferrolm's Rust trainer.

        ``input`` is a path, glob or folder, a list of them, or an iterable of str (each item
        a document); ``vocab_size`` counts the 256 bytes, the merges and the special tokens.
        Files are read as ``ferrolm encode`` reads them (text, ``.gz``/``.zst``, JSON Lines,
        Parquet); JSON Lines and Parquet inputs give the documents of their ``column``
        (a record's field; a Parquet column, ``meta.text`` inside a struct).
        """
        from ferrolm.bpe import trainer as bpe_trainer

        specials = check_special_tokens(special_tokens)
        vocab, merges = bpe_trainer.train(
            input, vocab_size, specials, pattern=pattern, num_threads=num_threads, progress=progress, column=column
        )
        return cls(vocab, merges, specials, pattern)

    def truncate(self, vocab_size: int) -> Tokenizer:
        """A tokenizer with only the first merges: ``vocab_size`` counts bytes, merges and specials.

        Tokens keep their ids when the kept bytes and merge results are exactly ids
        0..n-1 (a trained tokenizer, GPT-2); otherwise bytes are renumbered 0-255 by byte value
        and merge results follow in merge order. Special tokens come after them.
        """
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
            raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
        n_merges = vocab_size - 256 - len(self._special_tokens)
        if n_merges < 0 or n_merges > self._core.num_merges:
            raise ValueError(
                f"vocab_size {vocab_size} is out of range: it must be between {256 + len(self._special_tokens)} "
                f"and {256 + len(self._special_tokens) + self._core.num_merges} (256 bytes + merges + {len(self._special_tokens)} special tokens)"
            )
        merges = self._merges[:n_merges]
        id_of: dict[bytes, int] = {}
        own = self._vocab
        for i in sorted(own):
            id_of.setdefault(own[i], i)
        kept = [bytes([b]) for b in range(256)] + [a + b for a, b in merges]
        old_ids = [id_of[t] for t in kept]
        if sorted(old_ids) == list(range(len(kept))):
            vocab = {i: t for i, t in zip(old_ids, kept)}
        else:
            vocab, seen = {}, set()
            for t in kept:
                if t not in seen:
                    seen.add(t)
                    vocab[len(vocab)] = t
        return Tokenizer(vocab, merges, self._special_tokens, self._pattern)

    def __reduce__(self):
        return (Tokenizer, (self._vocab, self._merges, self._special_tokens, self._pattern))

    # ---- properties ---------------------------------------------------------------

    @property
    def vocab(self) -> dict[int, bytes]:
        """id -> token bytes, special tokens included.

        Built from the compiled core on first access and kept, so looking tokens up in it
        in a loop is cheap (GPT-2's takes ~3 ms to build and ~5 MB). Treat it as
        read-only: the tokenizer neither reads nor updates it."""
        if self._vocab_dict is None:
            self._vocab_dict = self._vocab
        return self._vocab_dict

    @property
    def merges(self) -> list[tuple[bytes, bytes]]:
        """The merges in rank order; built on first access and kept, like `vocab`."""
        if self._merges_list is None:
            self._merges_list = self._merges
        return self._merges_list

    @property
    def special_tokens(self) -> list[str]:
        return list(self._special_tokens)

    @property
    def special_token_ids(self) -> dict[str, int]:
        return dict(self._special_ids)

    @property
    def pattern(self) -> str:
        """The pre-tokenization regex source."""
        return self._pattern

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (the number of tokens for a dense vocab)."""
        return self._core.vocab_size

    @property
    def fingerprint(self) -> str:
        """sha256 over vocab, merges, special tokens and pattern (recorded by shards and checkpoints)."""
        if self._fingerprint is None:
            # tf.fingerprint defines it; the core hashes the same text ~10x faster.
            self._fingerprint = self._core.fingerprint(list(self._special_tokens), patterns.resolve(self._pattern))
        return self._fingerprint

    @property
    def eos_id(self) -> int | None:
        """The id of "<|endoftext|>" when it is a special token, else None."""
        return self._special_ids.get(EOT)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={self._core.num_merges}, "
            f"special_tokens={self._special_tokens!r}, pattern={patterns.name_of(self._pattern)!r})"
        )

    # ---- encoding -----------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens in it are their ids (and split the text)."""
        try:
            return self._core.encode(text, True)
        except UnicodeEncodeError:
            return self._core.encode(fix_surrogates(text), True)

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of ``text`` with special tokens treated as ordinary text."""
        try:
            return self._core.encode(text, False)
        except UnicodeEncodeError:
            return self._core.encode(fix_surrogates(text), False)

    def encode_batch(self, texts: Iterable[str], num_threads: int | None = None) -> list[list[int]]:
        """Encode each text, in parallel over texts (all cores by default, the GIL released)."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("encode_batch expects a list of str; use encode() for a single str")
        if not isinstance(texts, (list, tuple)):
            texts = list(texts)
        threads = _check_threads(num_threads)
        try:
            return self._core.encode_batch(texts, True, threads)
        except UnicodeEncodeError:
            return self._core.encode_batch(
                [fix_surrogates(t) if isinstance(t, str) else t for t in texts], True, threads
            )

    def encode_batch_to_numpy(
        self, texts: Iterable[str], dtype: Any = None, num_threads: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encode each text (in parallel) into one flat numpy array of ids and an array of
        ``len(texts) + 1`` offsets (int64): text ``i`` has ``ids[offsets[i]:offsets[i + 1]]``.
        No Python int is made per id."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("encode_batch_to_numpy expects a list of str; use encode_to_numpy() for a single str")
        if not isinstance(texts, (list, tuple)):
            texts = list(texts)
        itemsize = self._itemsize(dtype)
        threads = _check_threads(num_threads)
        try:
            return self._core.encode_batch_to_arrays(texts, True, itemsize, threads)
        except UnicodeEncodeError:
            fixed = [fix_surrogates(t) if isinstance(t, str) else t for t in texts]
            return self._core.encode_batch_to_arrays(fixed, True, itemsize, threads)

    def encode_to_numpy(self, text: str, dtype: Any = None, num_threads: int | None = None) -> np.ndarray:
        """Token ids of ``text`` as a numpy array (uint16 or uint32; by default uint16 when the
        vocab fits), with no Python list in between. Large texts are encoded in parallel
        (``num_threads``: None = all cores, 1 = this thread); the ids do not depend on it."""
        # The common case (default dtype, no or a valid thread count) without calls: this
        # runs once per document when documents are encoded one at a time.
        itemsize = self._default_itemsize if dtype is None else self._itemsize(dtype)
        if num_threads is not None and (num_threads.__class__ is not int or num_threads < 1):
            _check_threads(num_threads)
        try:
            return self._core.encode_to_array(text, True, itemsize, num_threads)
        except UnicodeEncodeError:
            return self._core.encode_to_array(fix_surrogates(text), True, itemsize, num_threads)

    def encode_file(self, path: PathInput, dtype: Any = None, num_threads: int | None = None) -> np.ndarray:
        """Encode a whole UTF-8 text file (invalid bytes read as U+FFFD) into a numpy array,
        in parallel; the same ids as ``encode_to_numpy(open(path, encoding="utf-8",
        errors="replace", newline="").read())`` (``newline=""``: line ends are kept as they
        are in the file, ``\\r\\n`` included).

        A file of 4 MiB or more is mapped into memory rather than copied: do not truncate or
        overwrite it while it is being encoded (as with any memory map, the process could
        crash). Appending to it is harmless: text added after the call began is not read."""
        itemsize = self._itemsize(dtype)
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such file: {path}")
        if not os.path.isfile(path):
            raise ValueError(f"{path} is not a regular file (encode_file maps or reads a file of known size)")
        return self._core.encode_file(path, True, itemsize, _check_threads(num_threads))

    def _itemsize(self, dtype: Any) -> int:
        """Bytes per id of ``dtype`` (None: the default), which must be uint16 or uint32."""
        if dtype is None:
            return self._default_itemsize
        np = _numpy()
        dt = np.dtype(dtype)
        if dt == np.dtype(np.uint16):
            if self.vocab_size > 1 << 16:
                raise ValueError(f"vocab_size {self.vocab_size} does not fit in uint16; use dtype=np.uint32")
            return 2
        if dt == np.dtype(np.uint32):
            return 4
        raise ValueError(f"dtype must be numpy.uint16 or numpy.uint32, got {dt}")

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Lazily encode a stream of str chunks (e.g. an open text file), yielding ids.

        The ids are exactly those of ``encode("".join(iterable))``; memory is bounded by the
        chunk size and the longest pre-token, not by the length of the stream.
        """
        if isinstance(iterable, (str, bytes)):
            raise TypeError("encode_iterable expects an iterable of str chunks; use encode() for a single str")
        return self._iter_ids(iter(iterable))

    def _iter_ids(self, chunks: Iterator[str]) -> Iterator[int]:
        stream = self._core.stream(True)
        carry = ""  # a high surrogate at the end of a chunk may pair with the next chunk
        for chunk in chunks:
            if carry:
                if not isinstance(chunk, str):
                    raise TypeError(f"encode_iterable() expects str chunks, got {type(chunk).__name__}")
                chunk, carry = carry + chunk, ""
            if chunk and isinstance(chunk, str) and is_high_surrogate(chunk[-1]):
                chunk, carry = chunk[:-1], chunk[-1]
            for part in _split_chunk(chunk) if isinstance(chunk, str) and len(chunk) > _FEED_MAX else (chunk,):
                try:
                    ids = stream.feed(part)
                except UnicodeEncodeError:
                    ids = stream.feed(fix_surrogates(part))
                yield from ids
        if carry:
            yield from stream.feed(fix_surrogates(carry))
        yield from stream.finish()

    # ---- decoding -----------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The concatenated bytes of ``ids``; ValueError for an id not in the vocabulary."""
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
        if hasattr(ids, "__array__") and hasattr(ids, "dtype"):
            np = _numpy()
            arr = np.asarray(ids)
            if arr.dtype.kind not in "iu":
                raise TypeError(f"ids must be integers, got an array of {arr.dtype}")
            arr = arr.reshape(-1)
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32 - 1):
                bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
                raise ValueError(f"token id {bad} is not in the vocabulary (vocab_size {self.vocab_size})")
            return self._core.decode_bytes_u32le(arr.astype("<u4").tobytes())
        if not isinstance(ids, list):
            ids = list(ids)
        try:
            return self._core.decode_bytes(ids)
        except OverflowError:
            bad = next(i for i in ids if not (-(2**63) <= int(i) < 2**63))
            raise ValueError(f"token id {bad} is not in the vocabulary (vocab_size {self.vocab_size})") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Join the tokens' bytes and decode them as UTF-8, invalid sequences as U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, id: int) -> bytes:
        b = self._core.token_bytes(id)
        if b is None:
            raise ValueError(f"token id {id} is not in the vocabulary (vocab_size {self.vocab_size})")
        return b

    # ---- conversions --------------------------------------------------------------

    @classmethod
    def from_tiktoken(cls, encoding: Any) -> Tokenizer:
        """Build from a ``tiktoken.Encoding``: same ids, same pattern, same special tokens.

        tiktoken keeps only token ranks; the merges are recovered by splitting each token
        the way tiktoken's own BPE would build it from lower-ranked tokens.
        """
        try:
            ranks = encoding._mergeable_ranks
            specials = encoding._special_tokens
            pat = encoding._pat_str
        except AttributeError:
            raise TypeError(f"expected a tiktoken.Encoding, got {type(encoding).__name__}") from None
        return cls._from_ranks(dict(ranks), dict(specials), pat)

    @classmethod
    def from_tiktoken_file(
        cls, path: PathInput, special_tokens: Sequence[str] | dict[str, int] | None = None, pattern: str = "gpt2"
    ) -> Tokenizer:
        """Load a ``.tiktoken`` rank file (base64 token, space, rank per line).

        The file carries neither pattern nor special tokens: give them. ``special_tokens`` is
        a list (ids after the largest rank, in order) or a dict {token: id}.
        """
        ranks = tf.read_tiktoken_ranks(path)
        if isinstance(special_tokens, dict):
            specials = dict(special_tokens)
        else:
            names = check_special_tokens(special_tokens)
            top = max(ranks.values(), default=-1)
            specials = {s: top + 1 + k for k, s in enumerate(names)}
        return cls._from_ranks(ranks, specials, pattern)

    @classmethod
    def _from_ranks(cls, ranks: dict[bytes, int], specials: dict[str, int], pattern: str) -> Tokenizer:
        vocab = {rank: token for token, rank in ranks.items()}
        if len(vocab) != len(ranks):
            raise ValueError("two tokens share a rank")
        for s, i in specials.items():
            if i in vocab and vocab[i] != s.encode("utf-8"):
                raise ValueError(f"special token {s!r} has id {i}, which is also the rank of {vocab[i]!r}")
            vocab[i] = s.encode("utf-8")
        merges = _merges_from_ranks(ranks)
        return cls(vocab, merges, list(specials), pattern)

    def to_tiktoken(self, name: str = "ferrolm") -> Any:
        """A ``tiktoken.Encoding`` with the same ids (needs ids in merge order, as trained and GPT-2 vocabs have)."""
        try:
            import tiktoken
        except ImportError:
            raise ImportError('to_tiktoken needs the tiktoken package: pip install "ferrolm[tiktoken]"') from None

        return tiktoken.Encoding(
            name, pat_str=self._pattern, mergeable_ranks=self._tiktoken_ranks(), special_tokens=dict(self._special_ids)
        )

    def save_tiktoken(self, path: PathInput) -> Path:
        """Write the ``.tiktoken`` rank file (ordinary tokens by id; special tokens and the
        pattern are not part of that format: pass them to :meth:`from_tiktoken_file`)."""
        ranks = self._tiktoken_ranks()
        tf.write_tiktoken_ranks(path, sorted(ranks.items(), key=lambda kv: kv[1]))
        return Path(path)

    def _tiktoken_ranks(self) -> dict[bytes, int]:
        special = set(self._special_ids.values())
        ranks: dict[bytes, int] = {}
        vocab = self._vocab
        for i in sorted(vocab):
            if i in special:
                continue
            t = vocab[i]
            if t in ranks:
                raise ValueError(
                    f"ids {ranks[t]} and {i} carry the same bytes {t!r}: tiktoken cannot represent this vocab"
                )
            ranks[t] = i
        # tiktoken merges by rank of the merged token: that must be the merge order.
        last = -1
        for k, (a, b) in enumerate(self._merges):
            r = ranks.get(a + b)
            if r is None or r <= last or ranks.get(a, r) >= r or ranks.get(b, r) >= r:
                raise ValueError(
                    f"merge {k} {(a, b)!r}: token ids are not in merge order, so tiktoken would encode differently"
                )
            last = r
        return ranks

    def to_hf_json(self) -> dict:
        """The HF tokenizers ``tokenizer.json`` content (a dict) of this tokenizer."""
        return hf.hf_tokenizer_json(self._vocab, self._merges, self._special_id_pairs(), self._pattern)

    def save_hf(self, path: PathInput, *, model_max_length: int | None = None) -> Path:
        """Write an HF ``tokenizer.json`` (ByteLevel BPE) that ``tokenizers.Tokenizer.from_file``
        loads and that encodes like this tokenizer. ``path`` is a file, or a directory to
        write it into with tokenizer_config.json and special_tokens_map.json (what
        ``AutoTokenizer.from_pretrained`` reads; a chat tokenizer's chat_template.jinja too):
        the same bytes :meth:`save` writes. A
        directory holding ferrolm's record is saved whole, so its checksums stay true."""
        path = Path(path)
        if (path / tf.RECORD_FILE).is_file():
            return self.save(path, model_max_length=model_max_length) / tf.HF_FILE
        files = hf.hf_files(self._vocab, self._merges, self._special_id_pairs(), self._pattern, model_max_length)
        if not path.is_dir():
            atomic_write_bytes(path, files[tf.HF_FILE])
            return path
        for name, data in files.items():
            atomic_write_bytes(path / name, data)
        return path / tf.HF_FILE


def _check_threads(num_threads: int | None) -> int | None:
    if num_threads is None:
        return None
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
    return num_threads


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover BPE merges from tiktoken ranks: each multi-byte token, in rank order, is the
    merge of the two parts tiktoken's BPE leaves when only lower ranks may merge."""
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) == 2:
            merges.append((rank, parts[0], parts[1]))
    merges.sort()
    return [(a, b) for _, a, b in merges]


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts

"""The pure-Python reference byte-level BPE: a trainer and a Tokenizer.

This module is the ground truth the Rust core is tested against and the baseline its
benchmarks are measured against, so it is written to be read. The semantics are those of
docs/DESIGN.md:

* Ids 0-255 are the single bytes, each merge adds the next id, special tokens come last.
* Special tokens split the text first and are hard boundaries: no pre-token and no merge
  crosses them. The remaining text is cut into pre-tokens by a regex pattern (GPT-2's by
  default; "cl100k", "o200k" or any custom regex), matched by Python's ``regex`` module.
  The built-in patterns use the Rust core's Unicode classes (``core_classes``), so the
  pieces do not depend on the installed ``regex``'s Unicode version; custom patterns use
  ``regex``'s own tables.
* Training repeatedly merges the most frequent adjacent pair, ties broken by the
  lexicographically greatest pair of byte strings.
* Encoding matches special tokens longest first, then applies merges by rank inside each
  pre-token. Decoding joins the bytes and decodes UTF-8 with replacement.

Details this module settles (the Rust side follows them):

* Input of ``train_bpe``: a path (str or os.PathLike), a list/tuple of paths, or any other
  iterable of str (e.g. ``iter(documents)``). A list of str is read as *paths*; to train on
  in-memory strings pass an iterator. Files are read as UTF-8 (invalid UTF-8 is an error that
  names the file and byte offset). Each file is its own text: no pre-token spans two files.
  Each item of an iterable of str is a document of its own: no pre-token spans two (as if
  they were separated by a special token).
* Lone surrogates (possible in a Python str, not in UTF-8): like tiktoken, the text is first
  passed through UTF-16 with ``surrogatepass`` / ``replace``, so a valid surrogate pair
  becomes its character and a lone surrogate becomes U+FFFD.
* If a merge produces bytes that an earlier merge already produced, the pair is still a merge
  and still takes an id (vocab_size counts it), but inside words it is the same token as the
  earlier one: training works on byte strings, as the tie-break rule does.
* Streaming (``encode_iterable`` and reading files in blocks) emits only pre-tokens that no
  later text can change: it holds back the last two pre-tokens of the buffered text, any
  suffix that may start a special token, and a trailing high surrogate. This is exact for the
  built-in patterns (their matches look at most a few characters past their end, inside the
  next two pre-tokens); a custom pattern with lookbehind or long lookahead could differ.
"""

from __future__ import annotations

import codecs
import heapq
import operator
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Union

import regex

from ferrolm._util import check_special_tokens, fix_surrogates
from ferrolm.bpe import files as tokenizer_files
from ferrolm.bpe import patterns
from ferrolm.bpe.core_classes import with_core_classes

__all__ = ["train_bpe", "Tokenizer"]

PathInput = Union[str, "os.PathLike[str]"]

# Bytes read from a file per block while streaming (about 4 MB).
_FILE_BLOCK_BYTES = 1 << 22
# Characters buffered by encode_iterable before pre-tokenizing them.
_STREAM_MIN_CHARS = 1 << 16
# Pre-tokens held back at the end of the buffer: the last two may still change.
_HOLD_PRETOKENS = 2
# Entries in the pre-token -> ids cache before it is cleared (bounds streaming memory).
_CACHE_MAX = 1 << 17


# --------------------------------------------------------------------------------------
# Text preparation shared by the trainer and the Tokenizer
# --------------------------------------------------------------------------------------


def _special_regex(specials: Sequence[str]):
    """A regex matching any special token, longest first (so one containing another wins)."""
    if not specials:
        return None
    ordered = sorted(specials, key=len, reverse=True)
    return regex.compile("|".join(regex.escape(s) for s in ordered))


def _compile_pattern(pattern: str):
    source = patterns.resolve(pattern)
    if patterns.name_of(source) != source:
        # A built-in: with the core's Unicode classes, not the installed regex's own.
        source = with_core_classes(source)
    try:
        compiled = regex.compile(source)
    except regex.error as e:
        raise ValueError(f"invalid pre-tokenization pattern {source!r}: {e}") from None
    if compiled.groups:
        # findall would return the groups, not the whole match.
        return compiled, lambda text: [m.group() for m in compiled.finditer(text)]
    return compiled, compiled.findall


class _PreTokenStream:
    """Cuts a stream of text chunks into special tokens and pre-tokens.

    The result is exactly that of pre-tokenizing the concatenated text at once, while only a
    bounded tail of the text is buffered. ``feed`` and ``finish`` return a list of items:
    a str is a special token, a list of str is a run of pre-tokens.
    """

    def __init__(self, pattern: str, special_tokens: Sequence[str]):
        self._regex, self._findall = _compile_pattern(pattern)
        self._special_re = _special_regex(special_tokens)
        # Every proper prefix of a special token: a buffer ending in one must wait.
        self._special_prefixes = {s[:k] for s in special_tokens for k in range(1, len(s))}
        self._longest_prefix = max((len(p) for p in self._special_prefixes), default=0)
        self._pending: list[str] = []
        self._pending_chars = 0
        self._tail_chars = 0

    def feed(self, chunk: str, min_chars: int = 0) -> list:
        if not isinstance(chunk, str):
            raise TypeError(f"expected str chunks of text, got {type(chunk).__name__}")
        self._pending.append(chunk)
        self._pending_chars += len(chunk)
        # Re-scan the held tail only once enough new text has arrived (amortised linear time).
        if self._pending_chars < max(min_chars, 2 * self._tail_chars):
            return []
        return self._process(final=False)

    def finish(self) -> list:
        return self._process(final=True)

    def _process(self, final: bool) -> list:
        buf = "".join(self._pending)
        raw_tail = ""
        if not final and buf and "\ud800" <= buf[-1] <= "\udbff":
            # A high surrogate at the end may pair with a low one in the next chunk.
            buf, raw_tail = buf[:-1], buf[-1]
        text = fix_surrogates(buf)
        # `hold`: where the longest suffix that may still grow into a special token starts.
        # No special token found before it can change; everything from it on must wait.
        hold = len(text)
        if not final:
            for k in range(min(self._longest_prefix, len(text)), 0, -1):
                if text[len(text) - k :] in self._special_prefixes:
                    hold = len(text) - k
                    break
        items: list = []
        pos = 0
        if self._special_re is not None:
            for m in self._special_re.finditer(text):
                if m.start() >= hold:
                    break
                if m.start() > pos:
                    items.append(self._findall(text[pos : m.start()]))
                items.append(m.group())
                pos = m.end()
        keep = text[max(pos, hold) :]
        if pos < hold:
            # Plain text up to `hold`: its last pre-tokens may change with the next chunk.
            pieces = self._findall(text[pos:hold])
            if not final:
                pieces, held = self._hold_back(text[pos:hold], pieces)
                keep = held + keep
            if pieces:
                items.append(pieces)
        tail = keep + raw_tail
        self._pending = [tail] if tail else []
        self._pending_chars = self._tail_chars = len(tail)
        return items

    def _hold_back(self, text: str, pieces: list[str]) -> tuple[list[str], str]:
        """Split off the last pre-tokens of `text` (and what follows them): they may still change."""
        if len(pieces) <= _HOLD_PRETOKENS:
            return [], text
        if sum(map(len, pieces)) == len(text):
            # The matches tile the text (true of the built-in patterns): no second scan needed.
            cut = len(text) - sum(len(p) for p in pieces[-_HOLD_PRETOKENS:])
        else:
            starts = [m.start() for m in self._regex.finditer(text)]
            cut = starts[-_HOLD_PRETOKENS]
        return pieces[:-_HOLD_PRETOKENS], text[cut:]


def _read_file_chunks(path: PathInput) -> Iterator[str]:
    """Yield the text of a UTF-8 file in blocks, never splitting a character."""
    path = Path(path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"input path is a directory, not a text file: {path}") from None
    with f:
        while True:
            block = f.read(_FILE_BLOCK_BYTES)
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                # The decoder may carry up to 3 bytes from the previous block.
                carried = e.object[: len(e.object) - len(block)] if len(e.object) > len(block) else b""
                at = offset - len(carried) + e.start
                raise ValueError(f"{path}: not valid UTF-8 at byte {at}: {e.reason}") from None
            offset += len(block)
            if text:
                yield text
            if not block:
                return


def _input_texts(input_path) -> Iterator[Iterable[str]]:
    """Each independent text of the training input, as an iterable of str chunks."""
    if isinstance(input_path, (str, os.PathLike)):
        yield _read_file_chunks(input_path)
        return
    if isinstance(input_path, bytes):
        raise TypeError("input must be a path (str or os.PathLike), a list of paths, or an iterable of str; got bytes")
    if isinstance(input_path, (list, tuple)):
        for item in input_path:
            if not isinstance(item, (str, os.PathLike)):
                raise TypeError(f"a list input is a list of file paths; got an item of type {type(item).__name__}")
        for item in input_path:
            if not Path(item).exists():
                raise FileNotFoundError(
                    f"input file not found: {item} (a list is read as file paths; pass iter(texts) to train on strings)"
                )
        for item in input_path:
            yield _read_file_chunks(item)
        return
    try:
        docs = iter(input_path)
    except TypeError:
        raise TypeError(
            f"input must be a path, a list of paths, or an iterable of str; got {type(input_path).__name__}"
        ) from None
    for doc in docs:
        yield (doc,)


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def count_pretokens(input_path, special_tokens: Sequence[str] = (), pattern: str = "gpt2") -> Counter:
    """How often each pre-token (a str) occurs in the input; special tokens are not counted."""
    specials = check_special_tokens(special_tokens)
    counts: Counter = Counter()
    for chunks in _input_texts(input_path):
        stream = _PreTokenStream(pattern, specials)
        for chunk in chunks:
            for item in stream.feed(chunk):
                if isinstance(item, list):
                    counts.update(item)
        for item in stream.finish():
            if isinstance(item, list):
                counts.update(item)
    counts.pop("", None)  # a custom pattern may match the empty string
    return counts


def _reversed_order_key(token: bytes) -> str:
    """A str whose order is the reverse of the byte strings' order.

    Each byte b becomes chr(255 - b) and a terminator chr(256), larger than any of those,
    ends the key; so a proper prefix (which is smaller as bytes) gets the larger key. Keys
    never contain one another, so the concatenated keys of a pair also order pairs in
    reverse. The heap pops the smallest entry: with this key, the greatest pair.
    """
    return "".join(chr(255 - b) for b in token) + chr(256)


def train_bpe(
    input_path, vocab_size: int, special_tokens: Sequence[str], pattern: str = "gpt2"
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE; returns ``(vocab, merges)``.

    vocab maps id -> bytes: ids 0-255 are the bytes, then one id per merge in order, then
    the special tokens. merges lists the merged pairs in order. Training stops when the vocab
    reaches ``vocab_size`` or no pair is left.
    """
    specials = check_special_tokens(special_tokens)
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    minimum = 256 + len(specials)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the 256 byte tokens plus {len(specials)} special token(s): it must be at least {minimum}"
        )
    num_merges = vocab_size - minimum

    counts = count_pretokens(input_path, specials, pattern)
    merges = _merge_loop(counts, num_merges)

    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in merges:
        vocab[len(vocab)] = a + b
    for s in specials:
        vocab[len(vocab)] = s.encode("utf-8")
    return vocab, merges


def _merge_loop(counts: Counter, num_merges: int) -> list[tuple[bytes, bytes]]:
    """The BPE merge loop over pre-token counts, with incremental pair counts.

    State:
      words[w]      a pre-token as a list of token ids (only those with 2+ tokens matter)
      freqs[w]      how often it occurs
      pair_count    (id, id) -> occurrences, weighted by word frequency
      where[pair]   indices of the words that contained the pair when it was counted (may
                    hold stale entries; a word without the pair is skipped when merging)
      heap          (-count, reversed key, pair): the top valid entry is the pair to merge.
                    Entries go stale when counts change. A pair's count only rises when it
                    contains the new token, and then a fresh entry is pushed; when a popped
                    entry's count is higher than the pair's current count, it is re-pushed
                    with the current count, so the top valid entry is always the true max.
    """
    token_bytes: list[bytes] = [bytes([i]) for i in range(256)]
    order_key: list[str] = [_reversed_order_key(t) for t in token_bytes]
    id_of: dict[bytes, int] = {t: i for i, t in enumerate(token_bytes)}

    words: list[list[int]] = []
    freqs: list[int] = []
    for piece, freq in counts.items():
        ids = list(piece.encode("utf-8"))
        if len(ids) > 1:
            words.append(ids)
            freqs.append(freq)

    pair_count: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for w, ids in enumerate(words):
        freq = freqs[w]
        for pair in zip(ids, ids[1:]):
            pair_count[pair] = pair_count.get(pair, 0) + freq
            if pair in where:
                where[pair].add(w)
            else:
                where[pair] = {w}

    heap = [(-c, order_key[a] + order_key[b], (a, b)) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < num_merges and heap:
        neg, key, pair = heapq.heappop(heap)
        current = pair_count.get(pair, 0)
        if current != -neg:
            if 0 < current < -neg:
                heapq.heappush(heap, (-current, key, pair))
            continue

        a, b = pair
        merged = token_bytes[a] + token_bytes[b]
        merges.append((token_bytes[a], token_bytes[b]))
        # Bytes already made by an earlier merge are the same token (see the module doc).
        new = id_of.get(merged)
        if new is None:
            new = len(token_bytes)
            id_of[merged] = new
            token_bytes.append(merged)
            order_key.append(_reversed_order_key(merged))

        risen: set[tuple[int, int]] = set()
        for w in where.pop(pair):
            _merge_in_word(words[w], w, freqs[w], pair, new, pair_count, where, risen)
        pair_count.pop(pair, None)
        for p in risen:
            c = pair_count[p]
            if c > 0:
                heapq.heappush(heap, (-c, order_key[p[0]] + order_key[p[1]], p))
    return merges


def _merge_in_word(
    ids: list[int], w: int, freq: int, pair, new: int, pair_count: dict, where: dict, risen: set
) -> None:
    """Replace each occurrence of ``pair`` in word ``w`` (its ``ids``, occurring ``freq``
    times) by ``new``, left to right, and update the counts of the pairs around it; a pair
    whose count rose goes into ``risen``. Doing it in place, one occurrence at a time, keeps
    runs such as "a b a b" exact: the second merge sees the first one's result on its left."""
    a, b = pair
    i = 0
    while True:
        try:
            i = ids.index(a, i)
        except ValueError:
            break
        if i + 1 >= len(ids):
            break
        if ids[i + 1] != b:
            i += 1
            continue
        if i > 0:
            left = ids[i - 1]
            pair_count[left, a] -= freq
            p = (left, new)
            pair_count[p] = pair_count.get(p, 0) + freq
            risen.add(p)
            where.setdefault(p, set()).add(w)
        if i + 2 < len(ids):
            right = ids[i + 2]
            pair_count[b, right] -= freq
            p = (new, right)
            pair_count[p] = pair_count.get(p, 0) + freq
            risen.add(p)
            where.setdefault(p, set()).add(w)
        ids[i : i + 2] = [new]
        i += 1


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


class Tokenizer:
    """Encode and decode with a byte-level BPE vocabulary and its merges.

    A Tokenizer built from a given vocab (e.g. GPT-2's) uses that vocab's own ids. Special
    tokens are looked up by their UTF-8 bytes in the vocab and get new ids (after the
    largest id) when absent.
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
        self._vocab: dict[int, bytes] = {}
        for i, t in vocab.items():
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise ValueError(f"vocab ids must be non-negative ints, got {i!r}")
            if not isinstance(t, bytes):
                raise TypeError(f"vocab[{i}] must be bytes, got {type(t).__name__}")
            self._vocab[i] = t
        # bytes -> id; the smallest id wins when bytes repeat.
        self._id_of: dict[bytes, int] = {}
        for i in sorted(self._vocab):
            self._id_of.setdefault(self._vocab[i], i)

        self._merges: list[tuple[bytes, bytes]] = []
        self._rank: dict[tuple[bytes, bytes], int] = {}
        for n, merge in enumerate(merges):
            if not (isinstance(merge, tuple) and len(merge) == 2 and all(isinstance(x, bytes) for x in merge)):
                raise TypeError(f"merge {n} must be a tuple of two bytes, got {merge!r}")
            a, b = merge
            for part in (a, b, a + b):
                if part not in self._id_of:
                    raise ValueError(f"merge {n} {merge!r}: {part!r} is not in the vocab")
            self._merges.append(merge)
            self._rank.setdefault(merge, n)

        self._special_tokens = check_special_tokens(special_tokens)
        self._special_ids: dict[str, int] = {}
        for s in self._special_tokens:
            b = s.encode("utf-8")
            i = self._id_of.get(b)
            if i is None:
                i = max(self._vocab, default=-1) + 1
                self._vocab[i] = b
                self._id_of[b] = i
            self._special_ids[s] = i

        self._pattern = patterns.resolve(pattern)
        self._regex, self._findall = _compile_pattern(pattern)
        self._special_re = _special_regex(self._special_tokens)
        self._cache: dict[str, list[int]] = {}

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        input,
        vocab_size: int,
        special_tokens: Sequence[str] = ("<|endoftext|>",),
        *,
        pattern: str = "gpt2",
        num_threads: int | None = None,
        progress: bool = False,
    ) -> Tokenizer:
        """Train on `input` (see train_bpe) and return the Tokenizer.

        Same signature as the Rust-backed ``ferrolm.Tokenizer.train``; the reference runs in
        one thread and prints no progress, so `num_threads` and `progress` are ignored.
        """
        specials = check_special_tokens(special_tokens)
        vocab, merges = train_bpe(input, vocab_size, specials, pattern)
        return cls(vocab, merges, specials, pattern)

    @classmethod
    def from_files(
        cls,
        vocab_path: PathInput,
        merges_path: PathInput,
        special_tokens: Sequence[str] | None = None,
        pattern: str = "gpt2",
    ) -> Tokenizer:
        """Load GPT-2-style vocab.json and merges.txt (byte-to-unicode form)."""
        specials = check_special_tokens(special_tokens)
        vocab = tokenizer_files.read_vocab(vocab_path, specials)
        merges = tokenizer_files.read_merges(merges_path)
        return cls(vocab, merges, specials, pattern)

    def save(self, directory: PathInput) -> Path:
        """Write the tokenizer directory (the same files as ``ferrolm.Tokenizer.save``)."""
        return tokenizer_files.save_dir(directory, self._vocab, self._merges, self._special_tokens, self._pattern)

    @classmethod
    def load(cls, directory: PathInput) -> Tokenizer:
        loaded = tokenizer_files.load_dir(directory)
        tok = cls(loaded.vocab, loaded.merges, loaded.special_tokens, loaded.pattern)
        fp = tokenizer_files.fingerprint(tok._vocab, tok._merges, tok._special_tokens, tok._pattern)
        tokenizer_files.check_fingerprint(loaded, fp)
        return tok

    # ---- properties -------------------------------------------------------------------

    @property
    def vocab(self) -> dict[int, bytes]:
        return dict(self._vocab)

    @property
    def merges(self) -> list[tuple[bytes, bytes]]:
        return list(self._merges)

    @property
    def special_tokens(self) -> list[str]:
        return list(self._special_tokens)

    @property
    def pattern(self) -> str:
        return self._pattern

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def fingerprint(self) -> str:
        return tokenizer_files.fingerprint(self._vocab, self._merges, self._special_tokens, self._pattern)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={len(self._vocab)}, merges={len(self._merges)}, special_tokens={self._special_tokens!r}, pattern={patterns.name_of(self._pattern)!r})"

    # ---- encoding ---------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        text = fix_surrogates(text)
        ids: list[int] = []
        pos = 0
        if self._special_re is not None:
            for m in self._special_re.finditer(text):
                self._encode_pieces(self._findall(text[pos : m.start()]), ids)
                ids.append(self._special_ids[m.group()])
                pos = m.end()
        self._encode_pieces(self._findall(text[pos:]), ids)
        return ids

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """Encode each text (one thread in the reference; `num_threads` is ignored)."""
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a list of str; use encode() for a single str")
        return [self.encode(t) for t in texts]

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Lazily encode a stream of str chunks (e.g. an open text file).

        The ids are exactly those of ``encode("".join(iterable))``; memory is bounded by the
        chunk size and the longest pre-token, not by the length of the stream.
        """
        if isinstance(iterable, str):
            raise TypeError("encode_iterable expects an iterable of str chunks; use encode() for a single str")
        stream = _PreTokenStream(self._pattern, self._special_tokens)
        for chunk in iterable:
            yield from self._encode_items(stream.feed(chunk, _STREAM_MIN_CHARS))
        yield from self._encode_items(stream.finish())

    def _encode_items(self, items: list) -> list[int]:
        ids: list[int] = []
        for item in items:
            if isinstance(item, str):
                ids.append(self._special_ids[item])
            else:
                self._encode_pieces(item, ids)
        return ids

    def _encode_pieces(self, pieces: list[str], out: list[int]) -> None:
        cache = self._cache
        for piece in pieces:
            ids = cache.get(piece)
            if ids is None:
                if not piece:
                    continue
                ids = self._encode_piece(piece)
                if len(cache) >= _CACHE_MAX:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)

    def _encode_piece(self, piece: str) -> list[int]:
        """Apply the merges to one pre-token: the lowest-ranked pair first, all its occurrences
        left to right (as training did), until no adjacent pair has a rank."""
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        rank = self._rank
        none = len(self._merges)  # the "rank" of a pair that is not a merge
        # ranks[i] is the rank of (parts[i], parts[i + 1]); kept in step with parts.
        ranks = [rank.get(pair, none) for pair in zip(parts, parts[1:])]
        while ranks:
            best = min(ranks)
            if best == none:
                break
            i = ranks.index(best)
            while True:
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
                del ranks[i]
                if i > 0:
                    ranks[i - 1] = rank.get((parts[i - 1], parts[i]), none)
                if i < len(ranks):
                    ranks[i] = rank.get((parts[i], parts[i + 1]), none)
                # The pairs next to the merged token differ from the merged pair, so the next
                # occurrence, if any, is to the right of i.
                try:
                    i = ranks.index(best, i)
                except ValueError:
                    break
        try:
            return [self._id_of[p] for p in parts]
        except KeyError as e:
            raise ValueError(f"cannot encode {piece!r}: the byte {e.args[0]!r} has no id in the vocab") from None

    # ---- decoding ---------------------------------------------------------------------

    def decode(self, ids: Iterable[int]) -> str:
        """Join the tokens' bytes and decode them as UTF-8, invalid sequences as U+FFFD."""
        vocab = self._vocab
        parts = []
        for i in ids:
            try:
                parts.append(vocab[operator.index(i)])
            except TypeError:
                raise TypeError(f"token ids must be ints, got {type(i).__name__} ({i!r})") from None
            except KeyError:
                top = max(vocab, default=-1)
                raise ValueError(f"token id {i} is out of range: not in the vocabulary (ids 0..{top})") from None
        return b"".join(parts).decode("utf-8", errors="replace")

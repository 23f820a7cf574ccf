"""Tokenizer files, shared by the reference and the Rust-backed Tokenizer.

A tokenizer directory holds:

* ``vocab.json``: ``{token: id}`` with each token's bytes in GPT-2's byte-to-unicode form;
* ``merges.txt``: ``#version: 0.2`` then one merge per line, ``a b`` in the same form,
  in merge order;
* ``tokenizer.json``: ferrolm's own record: special tokens, the pattern, the fingerprint.

HF tokenizers (ByteLevel BPE) and tiktoken (after inverting the byte map) read the first two.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from ferrolm._util import atomic_write_bytes
from ferrolm.bpe import patterns

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
CONFIG_FILE = "tokenizer.json"
FORMAT_VERSION = 1


class TokenizerFileError(ValueError):
    """A tokenizer file is missing or malformed; the message names the file and the problem."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable unicode character.

    Printable latin-1 bytes map to themselves; the other 68 bytes map, in byte order,
    to U+0100 onwards, so no token string contains whitespace or control characters.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _decoding_table() -> str:
    """GPT-2's character for each byte, in byte order: a table for the charmap codec."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in range(256))


def token_to_str(token: bytes) -> str:
    return codecs.charmap_decode(token, "strict", _decoding_table())[0]


def tokens_to_strs(tokens: Iterable[bytes]) -> list[str]:
    """``[token_to_str(t) for t in tokens]``, decoded in one call (each byte is one
    character, so the tokens are slices of the whole at the same offsets): a vocab's
    worth in milliseconds."""
    tokens = list(tokens)
    text = codecs.charmap_decode(b"".join(tokens), "strict", _decoding_table())[0]
    ends = list(itertools.accumulate(len(t) for t in tokens))
    return [text[e - len(t) : e] for t, e in zip(tokens, ends)]


def str_to_token(text: str, *, where: str = "token") -> bytes:
    table = unicode_to_bytes()
    try:
        return bytes(table[c] for c in text)
    except KeyError as e:
        raise TokenizerFileError(
            f"{where}: {text!r} contains {e.args[0]!r}, which is not in GPT-2's byte-to-unicode alphabet"
        ) from None


def fingerprint(
    vocab: dict[int, bytes], merges: Sequence[tuple[bytes, bytes]], special_tokens: Sequence[str], pattern: str
) -> str:
    """sha256 over vocab, merges, special tokens and pattern source, in a fixed text form.

    Shards and checkpoints record it, so a model is never fed ids from another tokenizer.
    """
    h = hashlib.sha256()
    h.update(b"ferrolm-tokenizer-v1\nvocab\n")
    for i in sorted(vocab):
        h.update(f"{i} {vocab[i].hex()}\n".encode())
    h.update(b"merges\n")
    for a, b in merges:
        h.update(f"{a.hex()} {b.hex()}\n".encode())
    h.update(b"specials\n")
    for s in special_tokens:
        h.update(s.encode("utf-8").hex().encode() + b"\n")
    h.update(b"pattern\n" + patterns.resolve(pattern).encode("utf-8"))
    return h.hexdigest()


def write_merges(path: str | os.PathLike, merges: Iterable[tuple[bytes, bytes]]) -> None:
    merges = list(merges)
    sides = iter(tokens_to_strs(t for pair in merges for t in pair))
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in zip(sides, sides)]
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))


def read_vocab(path: str | os.PathLike, special_tokens: Sequence[str] = (), *, fast: bool = False) -> dict[int, bytes]:
    """Read a GPT-2-style vocab.json. Entries equal to a special token are read as its UTF-8 bytes.

    ``fast``: parse with the compiled core when it accepts the file (the Rust-backed
    Tokenizer's loaders); otherwise, and for any problem, in Python, which says what is
    wrong. The reference keeps the default, so it stays pure Python.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"vocab file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise TokenizerFileError(f"{path}: not valid JSON: {e}") from None
    if fast:
        from ferrolm import _core

        vocab = _core.read_vocab_json(text, list(special_tokens))
        if vocab is not None:
            return vocab
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerFileError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise TokenizerFileError(f"{path}: expected a JSON object {{token: id}}, got {type(raw).__name__}")
    specials = set(special_tokens)
    vocab: dict[int, bytes] = {}
    for token, i in raw.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise TokenizerFileError(f"{path}: id of {token!r} must be a non-negative integer, got {i!r}")
        if i in vocab:
            raise TokenizerFileError(f"{path}: id {i} is used twice")
        if not token:
            raise TokenizerFileError(f"{path}: the empty string is not a token (id {i})")
        if token in specials:
            vocab[i] = token.encode("utf-8")
        else:
            vocab[i] = str_to_token(token, where=f"{path}: token")
    return vocab


def read_merges(path: str | os.PathLike, *, fast: bool = False) -> list[tuple[bytes, bytes]]:
    """Read a GPT-2-style merges.txt (an optional ``#version`` line, then ``a b`` per line).

    ``fast`` as for :func:`read_vocab`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"merges file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise TokenizerFileError(f"{path}: not UTF-8: {e}") from None
    if fast:
        from ferrolm import _core

        merges = _core.read_merges_txt(text)
        if merges is not None:
            return merges
    merges = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise TokenizerFileError(f"{path}:{lineno}: expected two tokens separated by one space, got {line!r}")
        where = f"{path}:{lineno}"
        merges.append((str_to_token(parts[0], where=where), str_to_token(parts[1], where=where)))
    return merges


def write_config(
    path: str | os.PathLike, special_tokens: Sequence[str], pattern: str, fp: str, extra: dict | None = None
) -> None:
    record = {
        "format": "ferrolm-tokenizer",
        "format_version": FORMAT_VERSION,
        "special_tokens": list(special_tokens),
        "pattern": patterns.name_of(pattern),
        "fingerprint": fp,
    }
    if extra:
        record.update(extra)
    atomic_write_bytes(path, (json.dumps(record, ensure_ascii=False, indent=2) + "\n").encode("utf-8"))


def read_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer config not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerFileError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(record, dict) or record.get("format") != "ferrolm-tokenizer":
        raise TokenizerFileError(f'{path}: not a ferrolm tokenizer.json (missing "format": "ferrolm-tokenizer")')
    specials = record.get("special_tokens", [])
    if not isinstance(specials, list) or not all(isinstance(s, str) for s in specials):
        raise TokenizerFileError(f"{path}: special_tokens must be a list of strings")
    if not isinstance(record.get("pattern", "gpt2"), str):
        raise TokenizerFileError(f"{path}: pattern must be a string")
    return record


def save_dir(
    directory: str | os.PathLike,
    vocab: dict[int, bytes],
    merges: Sequence[tuple[bytes, bytes]],
    special_tokens: Sequence[str],
    pattern: str,
    fp: str | None = None,
) -> Path:
    """Write vocab.json, merges.txt and tokenizer.json into `directory` (created if needed).

    ``fp``: the fingerprint when the caller has it (else computed here)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specials = list(special_tokens)
    # vocab.json stores special tokens as their literal text, as GPT-2's does with <|endoftext|>.
    special_bytes = {s.encode("utf-8") for s in specials}
    items: dict[str, int] = {}
    ids = sorted(vocab)
    for i, key in zip(ids, tokens_to_strs(vocab[i] for i in ids)):
        b = vocab[i]
        if b in special_bytes:
            key = b.decode("utf-8")
        if key in items:
            raise TokenizerFileError(f"{directory}: two ids map to the token {key!r}")
        items[key] = i
    atomic_write_bytes(directory / VOCAB_FILE, json.dumps(items, ensure_ascii=False).encode("utf-8"))
    write_merges(directory / MERGES_FILE, merges)
    write_config(directory / CONFIG_FILE, specials, pattern, fp or fingerprint(vocab, merges, specials, pattern))
    return directory


def load_dir(
    directory: str | os.PathLike, *, fast: bool = False
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]], list[str], str]:
    """Read a tokenizer directory: (vocab, merges, special_tokens, pattern).

    Without tokenizer.json (a bare GPT-2-style pair of files) the specials default to
    none and the pattern to "gpt2". ``fast`` as for :func:`read_vocab`.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {directory}")
    config_path = directory / CONFIG_FILE
    if config_path.exists():
        config = read_config(config_path)
        specials, pattern = list(config.get("special_tokens", [])), config.get("pattern", "gpt2")
    else:
        specials, pattern = [], "gpt2"
    vocab = read_vocab(directory / VOCAB_FILE, specials, fast=fast)
    merges = read_merges(directory / MERGES_FILE, fast=fast)
    return vocab, merges, specials, patterns.resolve(pattern)


# --------------------------------------------------------------------------------------
# Other formats: tiktoken's rank file and HF tokenizers' tokenizer.json
# --------------------------------------------------------------------------------------


def write_tiktoken_ranks(path: str | os.PathLike, ranks: Iterable[tuple[bytes, int]]) -> None:
    """Write a ``.tiktoken`` rank file: ``base64(token) rank`` per line, in the order given."""
    import base64

    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in ranks]
    atomic_write_bytes(path, "".join(lines).encode("ascii"))


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a ``.tiktoken`` rank file into ``{token bytes: rank}``."""
    import base64
    import binascii

    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"tiktoken rank file not found: {path}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerFileError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:80]!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError):
            raise TokenizerFileError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:80]!r}") from None
        if rank < 0:
            raise TokenizerFileError(f"{path}:{lineno}: negative rank {rank}")
        if token in ranks:
            raise TokenizerFileError(f"{path}:{lineno}: token {token!r} appears twice")
        ranks[token] = rank
    return ranks


def hf_tokenizer_json(
    vocab: dict[int, bytes], merges: Sequence[tuple[bytes, bytes]], special_ids: Sequence[tuple[str, int]], pattern: str
) -> dict:
    """An HF tokenizers ``tokenizer.json`` (ByteLevel BPE) encoding as ferrolm does.

    The pattern becomes a Split pre-tokenizer followed by a ByteLevel one that only maps
    bytes; special tokens become added tokens; ``ignore_merges`` makes a pre-token that is
    itself a token encode as that token, as ferrolm and tiktoken do.
    """
    special_set = {i for _, i in special_ids}
    model_vocab: dict[str, int] = {}
    for i in sorted(vocab):
        if i in special_set:
            continue
        model_vocab.setdefault(token_to_str(vocab[i]), i)
    # HF takes an added token's id from the model vocab when the content is there (and
    # otherwise numbers it after the vocab), so special tokens go in too, as in GPT-2's file.
    for s, i in special_ids:
        if model_vocab.setdefault(s, i) != i:
            raise ValueError(
                f"special token {s!r} (id {i}) has the same text as token {model_vocab[s]} in byte-level form; tokenizer.json cannot hold both"
            )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for s, i in special_ids
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": patterns.resolve(pattern)},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": model_vocab,
            "merges": [f"{token_to_str(a)} {token_to_str(b)}" for a, b in merges],
        },
    }

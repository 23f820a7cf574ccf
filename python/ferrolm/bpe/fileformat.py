"""What every tokenizer file format shares: the error that names a bad file, bounded reads
of a file, and GPT-2's byte-to-unicode alphabet, in which vocab.json, merges.txt and HF's
tokenizer.json all write a token's bytes as text.

``files`` (the tokenizer folder, vocab.json, merges.txt, ferrolm's record) and ``hf`` (HF's
tokenizer.json) both build on this module.
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
import stat
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

# The largest tokenizer file read: several times the largest public tokenizer.json files
# (a few tens of MB, for vocabularies of ~260k tokens), yet small enough that parsing one
# fits in memory.
MAX_FILE_BYTES = 256 << 20
FORMAT = "ferrolm-tokenizer"  # the "format" of ferrolm's own record
EOT = "<|endoftext|>"  # GPT-2's end-of-text token: the default special token


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


@lru_cache(maxsize=1)
def _encoding_map():
    return codecs.charmap_build(_decoding_table())


def str_to_token(text: str, *, where: str = "token") -> bytes:
    try:
        return codecs.charmap_encode(text, "strict", _encoding_map())[0]
    except UnicodeEncodeError as e:
        raise TokenizerFileError(
            f"{where}: {text!r} contains {text[e.start]!r}, which is not in GPT-2's byte-to-unicode alphabet"
        ) from None


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def read_file_bytes(path: str | os.PathLike, what: str) -> bytes:
    """The content of the tokenizer file ``path``, read only when it is a regular file (a
    link to one is followed) of at most MAX_FILE_BYTES: a FIFO, a device such as
    /dev/zero or a huge file is refused by name, never read without end."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then tells what it is.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise TokenizerFileError(f"{path}: is a directory, expected the {what}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise TokenizerFileError(f"{path}: is a directory, expected the {what}")
        if not stat.S_ISREG(st.st_mode):
            raise TokenizerFileError(f"{path}: is not a regular file (a FIFO, socket or device), expected the {what}")
        if st.st_size > MAX_FILE_BYTES:
            raise TokenizerFileError(
                f"{path}: is {st.st_size / 2**20:.1f} MiB, over the {MAX_FILE_BYTES >> 20} MiB a tokenizer file may be"
            )
        data = f.read(MAX_FILE_BYTES + 1)  # a file that grew since fstat is cut here
    if len(data) > MAX_FILE_BYTES:
        raise TokenizerFileError(f"{path}: is over the {MAX_FILE_BYTES >> 20} MiB a tokenizer file may be")
    return data


def parse_json(text: str, path: str | os.PathLike) -> Any:
    """The JSON value of ``text`` read from ``path``; TokenizerFileError naming the file when it
    is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerFileError(f"{path}: not valid JSON: {e}") from None


def _read_text(path: Path, what: str) -> str:
    try:
        return read_file_bytes(path, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerFileError(f"{path}: not UTF-8: {e}") from None

"""Tokenizer files, shared by the reference and the Rust-backed Tokenizer.

A tokenizer directory holds:

* ``vocab.json``: ``{token: id}`` with each token's bytes in GPT-2's byte-to-unicode form;
* ``merges.txt``: ``#version: 0.2`` then one merge per line, ``a b`` in the same form,
  in merge order;
* ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``: the same
  tokenizer for HF ``tokenizers`` and ``transformers`` (``AutoTokenizer.from_pretrained(dir)``);
* ``chat_template.jinja``, for a tokenizer with the chat tokens (``ferrolm.bpe.chat_format``):
  the conversation format as a Jinja template, also in ``tokenizer_config.json``'s
  ``chat_template``, so transformers' ``apply_chat_template`` renders ferrolm's ids;
* ``ferrolm_tokenizer.json``: ferrolm's own record: special tokens, the pattern, the Unicode
  version of the pre-tokenizer's classes, the fingerprint and the sha256 of the five
  files above it, all verified on load (a folder saved before the two config files were
  covered lists three). ``tokenizer_config.json`` may be edited where it does not define
  the tokenizer (a ``chat_template``, ``model_max_length`` ...): when its sha256 differs,
  its special tokens (``added_tokens_decoder`` and the roles such as ``eos_token``) must
  still be the ones the folder's tokenizer gives (:func:`_check_edited_hf_config`).

Every file is read only when it is a regular file of at most MAX_FILE_BYTES (see
:func:`ferrolm.bpe.fileformat.read_file_bytes`). A directory is written whole or not at all
(a temporary sibling, then a rename). Folders written by ferrolm 0.1.0 kept the record in
``tokenizer.json``; they still load. tiktoken (after inverting the byte map) reads vocab.json
and merges.txt.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ferrolm._util import atomic_write_bytes, atomic_write_dir
from ferrolm.bpe import hf, patterns
from ferrolm.bpe.chat_format import CHAT_TEMPLATE_FILE
from ferrolm.bpe.fileformat import (
    FORMAT,
    TokenizerFileError,
    _json_bytes,
    _read_text,
    parse_json,
    read_file_bytes,
    str_to_token,
    tokens_to_strs,
)
from ferrolm.bpe.hf import HF_CONFIG_FILE, HF_FILE, HF_SPECIALS_FILE

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
RECORD_FILE = "ferrolm_tokenizer.json"
LEGACY_RECORD_FILE = "tokenizer.json"  # where ferrolm 0.1.0 kept its record
CONFIG_FILE = RECORD_FILE
FORMAT_VERSION = 2
# The files whose sha256 the record keeps: all but the record itself, since transformers
# reads its special tokens' roles and model_max_length from the two config files.
CHECKED_FILES = (VOCAB_FILE, MERGES_FILE, HF_FILE, HF_CONFIG_FILE, HF_SPECIALS_FILE)
# chat_template.jinja (a chat tokenizer's) is not checked: a template may be edited, as in tokenizer_config.json.
TOKENIZER_FILES = (VOCAB_FILE, MERGES_FILE, HF_FILE, HF_CONFIG_FILE, HF_SPECIALS_FILE, CHAT_TEMPLATE_FILE, RECORD_FILE)
# The keys of tokenizer_config.json that define the tokenizer for transformers: the special
# tokens' ids and roles. Its other keys (chat_template, model_max_length ...) may be edited.
HF_CONFIG_TOKEN_KEYS = (
    "added_tokens_decoder",
    "additional_special_tokens",
    *(f"{role}_token" for role in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")),
)


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


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def merges_bytes(merges: Iterable[tuple[bytes, bytes]]) -> bytes:
    """merges.txt's content: ``#version: 0.2`` then ``a b`` per merge in byte-to-unicode form."""
    merges = list(merges)
    sides = iter(tokens_to_strs(t for pair in merges for t in pair))
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in zip(sides, sides)]
    return ("\n".join(lines) + "\n").encode("utf-8")


def write_merges(path: str | os.PathLike, merges: Iterable[tuple[bytes, bytes]]) -> None:
    atomic_write_bytes(path, merges_bytes(merges))


def vocab_bytes(vocab: dict[int, bytes], special_tokens: Sequence[str], where: str = "vocab") -> bytes:
    """vocab.json's content. Special tokens are stored as their literal text, as GPT-2's
    file stores <|endoftext|>."""
    special_bytes = {s.encode("utf-8") for s in special_tokens}
    items: dict[str, int] = {}
    ids = sorted(vocab)
    for i, key in zip(ids, tokens_to_strs(vocab[i] for i in ids)):
        b = vocab[i]
        if b in special_bytes:
            key = b.decode("utf-8")
        if key in items:
            raise TokenizerFileError(f"{where}: two ids map to the token {key!r}")
        items[key] = i
    return json.dumps(items, ensure_ascii=False).encode("utf-8")


def read_vocab(path: str | os.PathLike, special_tokens: Sequence[str] = (), *, fast: bool = False) -> dict[int, bytes]:
    """Read a GPT-2-style vocab.json. Entries equal to a special token are read as its UTF-8 bytes.

    ``fast``: parse with the compiled core when it accepts the file (the Rust-backed
    Tokenizer's loaders); otherwise, and for any problem, in Python, which says what is
    wrong. The reference keeps the default, so it stays pure Python.
    """
    path = Path(path)
    try:
        text = _read_text(path, "vocab file")
    except TokenizerFileError as e:
        raise TokenizerFileError(str(e).replace(": not UTF-8:", ": not valid JSON:")) from None
    return parse_vocab(text, path, special_tokens, fast=fast)


def parse_vocab(text: str, path: Path, special_tokens: Sequence[str] = (), *, fast: bool = False) -> dict[int, bytes]:
    """:func:`read_vocab` of the text of ``path``."""
    if fast:
        from ferrolm import _core

        vocab = _core.read_vocab_json(text, list(special_tokens))
        if vocab is not None:
            return vocab
    raw = parse_json(text, path)
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

    A merge listed twice is refused: HF tokenizers' ``BPE.from_file`` ranks it at its last
    line, the rank order of the file at its first; a trained merges.txt never repeats one.
    ``fast`` as for :func:`read_vocab`.
    """
    path = Path(path)
    return parse_merges(_read_text(path, "merges file"), path, fast=fast)


def parse_merges(text: str, path: Path, *, fast: bool = False) -> list[tuple[bytes, bytes]]:
    """:func:`read_merges` of the text of ``path``."""
    if fast:
        from ferrolm import _core

        merges = _core.read_merges_txt(text)
        if merges is not None and len(set(merges)) == len(merges):
            return merges
    merges = []
    first_line: dict[tuple[bytes, bytes], int] = {}
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise TokenizerFileError(f"{path}:{lineno}: expected two tokens separated by one space, got {line!r}")
        where = f"{path}:{lineno}"
        pair = (str_to_token(parts[0], where=where), str_to_token(parts[1], where=where))
        seen = first_line.setdefault(pair, lineno)
        if seen != lineno:
            raise TokenizerFileError(
                f"{where}: the merge {line!r} repeats line {seen}: a merge has one rank, so each is listed once"
            )
        merges.append(pair)
    return merges


# --------------------------------------------------------------------------------------
# ferrolm's record
# --------------------------------------------------------------------------------------


def record(
    special_tokens: Sequence[str],
    pattern: str,
    fp: str,
    checked: dict[str, bytes] | None = None,
    extra: dict | None = None,
) -> dict:
    """ferrolm's record of a tokenizer directory; ``checked``: {file name: content} whose
    sha256 it keeps."""
    rec = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "special_tokens": list(special_tokens),
        "pattern": patterns.name_of(pattern),
        "unicode_version": patterns.unicode_version(),
        "fingerprint": fp,
    }
    if checked:
        rec["sha256"] = {name: sha256_hex(data) for name, data in checked.items()}
    if extra:
        rec.update(extra)
    return rec


def write_config(
    path: str | os.PathLike, special_tokens: Sequence[str], pattern: str, fp: str, extra: dict | None = None
) -> None:
    """Write a record alone (without file checksums) to ``path``."""
    atomic_write_bytes(path, _json_bytes(record(special_tokens, pattern, fp, extra=extra)))


def read_config(path: str | os.PathLike) -> dict:
    """Read a ferrolm record (``ferrolm_tokenizer.json``, or a 0.1.0 folder's ``tokenizer.json``)."""
    path = Path(path)
    return _check_record(parse_json(_read_text(path, "tokenizer record"), path), path)


def _check_record(rec: Any, path: Path) -> dict:
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise TokenizerFileError(f'{path}: not a ferrolm tokenizer record (missing "format": "{FORMAT}")')
    version = rec.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise TokenizerFileError(f"{path}: format_version {version!r} is newer than this ferrolm reads")
    specials = rec.get("special_tokens", [])
    if not isinstance(specials, list) or not all(isinstance(s, str) for s in specials):
        raise TokenizerFileError(f"{path}: special_tokens must be a list of strings")
    if not isinstance(rec.get("pattern", "gpt2"), str):
        raise TokenizerFileError(f"{path}: pattern must be a string")
    if not isinstance(rec.get("fingerprint", ""), str):
        raise TokenizerFileError(f"{path}: fingerprint must be a string")
    sums = rec.get("sha256", {})
    if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
        raise TokenizerFileError(f"{path}: sha256 must map file names to hex digests")
    return rec


# --------------------------------------------------------------------------------------
# Writing a directory whole
# --------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------
# The tokenizer directory
# --------------------------------------------------------------------------------------


def special_ids_in(vocab: dict[int, bytes], special_tokens: Sequence[str]) -> list[tuple[str, int]]:
    """(token, id) of each special token, found by its bytes in ``vocab`` (lowest id first),
    or numbered after the largest id when absent, as the tokenizers do."""
    ids: dict[bytes, int] = {}
    for i in sorted(vocab):
        ids.setdefault(vocab[i], i)
    top = max(vocab, default=-1)
    out = []
    for s in special_tokens:
        b = s.encode("utf-8")
        if b not in ids:
            top += 1
            ids[b] = top
        out.append((s, ids[b]))
    return out


def directory_files(
    vocab: dict[int, bytes],
    merges: Sequence[tuple[bytes, bytes]],
    special_ids: Sequence[tuple[str, int]],
    pattern: str,
    fp: str,
    model_max_length: int | None = None,
) -> dict[str, bytes]:
    """The content of each file of a tokenizer directory, the record last."""
    specials = [s for s, _ in special_ids]
    files = {VOCAB_FILE: vocab_bytes(vocab, specials), MERGES_FILE: merges_bytes(merges)}
    files.update(hf.hf_files(vocab, merges, special_ids, pattern, model_max_length))
    files[RECORD_FILE] = _json_bytes(record(specials, pattern, fp, {n: files[n] for n in CHECKED_FILES}))
    return files


def save_dir(
    directory: str | os.PathLike,
    vocab: dict[int, bytes],
    merges: Sequence[tuple[bytes, bytes]],
    special_tokens: Sequence[str],
    pattern: str,
    fp: str | None = None,
    *,
    special_ids: Sequence[tuple[str, int]] | None = None,
    model_max_length: int | None = None,
) -> Path:
    """Write a tokenizer directory (see the module docstring), whole or not at all.

    ``fp``: the fingerprint when the caller has it (else computed here); ``special_ids``:
    the special tokens' ids (else looked up by their bytes in ``vocab``);
    ``model_max_length``: the length transformers may feed a model (default 1024)."""
    specials = list(special_tokens)
    if special_ids is None:
        special_ids = special_ids_in(vocab, specials)
    fp = fp or fingerprint(vocab, merges, specials, pattern)
    files = directory_files(vocab, merges, special_ids, pattern, fp, model_max_length)
    return atomic_write_dir(directory, files, owned=TOKENIZER_FILES)


class LoadedDir(NamedTuple):
    vocab: dict[int, bytes]
    merges: list[tuple[bytes, bytes]]
    special_tokens: list[str]
    pattern: str
    fingerprint: str | None  # recorded; None for a folder without ferrolm's record
    record_path: Path | None


def load_dir(directory: str | os.PathLike, *, fast: bool = False) -> LoadedDir:
    """Read a tokenizer directory, checking every checksum its record keeps.

    A directory without ferrolm's record loads from an HF ``tokenizer.json`` (a byte-level
    BPE made elsewhere; see :func:`ferrolm.bpe.hf.read_hf_tokenizer`). vocab.json and merges.txt alone
    are refused (an incomplete directory); ``Tokenizer.from_files`` reads such a pair.
    The caller checks the recorded fingerprint with :func:`check_fingerprint`.
    ``fast`` as for :func:`read_vocab`.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {directory}")
    record_path = directory / RECORD_FILE
    if record_path.exists():
        rec = read_config(record_path)
    else:
        rec, record_path = _legacy_record(directory)
        if rec is None:
            vocab, merges, specials, pattern = hf.read_hf_tokenizer(directory / HF_FILE)
            return LoadedDir(vocab, merges, specials, pattern, None, None)
    texts = _checked_texts(directory, rec, record_path)
    specials = list(rec.get("special_tokens", []))
    vocab = parse_vocab(texts[VOCAB_FILE], directory / VOCAB_FILE, specials, fast=fast)
    if HF_CONFIG_FILE in texts:
        _check_edited_hf_config(directory / HF_CONFIG_FILE, texts[HF_CONFIG_FILE], vocab, specials, record_path)
    merges = parse_merges(texts[MERGES_FILE], directory / MERGES_FILE, fast=fast)
    pattern = patterns.resolve(rec.get("pattern", "gpt2"))
    _warn_unicode(rec, record_path)
    return LoadedDir(vocab, merges, specials, pattern, rec.get("fingerprint"), record_path)


def _legacy_record(directory: Path) -> tuple[dict | None, Path]:
    """(record, path) of a 0.1.0 folder's tokenizer.json, or (None, path) for an HF one."""
    path = directory / LEGACY_RECORD_FILE
    if not path.exists():
        present = [n for n in (VOCAB_FILE, MERGES_FILE) if (directory / n).exists()]
        raise TokenizerFileError(
            f"{directory}: incomplete tokenizer directory: {RECORD_FILE} is missing"
            + (f" (it has {' and '.join(present)}; a save was interrupted?)" if present else "")
            + "; a bare vocab.json + merges.txt pair loads with Tokenizer.from_files(vocab, merges, special_tokens, pattern)"
        )
    data = parse_json(_read_text(path, "tokenizer.json"), path)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return _check_record(data, path), path
    return None, path


def _checked_texts(directory: Path, rec: dict, record_path: Path) -> dict[str, str]:
    """The text of vocab.json and merges.txt; every file the record has a sha256 of is checked,
    except that an edited tokenizer_config.json comes back too, for its special tokens to be
    checked once the vocabulary is read."""
    sums = rec.get("sha256", {})
    out = {}
    for name in dict.fromkeys([*sums, VOCAB_FILE, MERGES_FILE]):
        path = directory / name
        try:
            data = read_file_bytes(path, name)
        except FileNotFoundError:
            raise TokenizerFileError(
                f"{directory}: incomplete tokenizer directory: {name} is missing (listed in {record_path.name})"
            ) from None
        edited_config = name == HF_CONFIG_FILE and name in sums and sha256_hex(data) != sums[name]
        if edited_config:
            out[name] = data.decode("utf-8", "replace")
        elif name in sums and sha256_hex(data) != sums[name]:
            raise TokenizerFileError(
                f"{path}: its sha256 differs from the one recorded in {record_path.name}: the file was changed or damaged"
            )
        if name in (VOCAB_FILE, MERGES_FILE):
            try:
                out[name] = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerFileError(f"{path}: not UTF-8: {e}") from None
    return out


def _check_edited_hf_config(
    path: Path, text: str, vocab: dict[int, bytes], specials: Sequence[str], record_path: Path
) -> None:
    """An edited tokenizer_config.json must keep the special tokens the tokenizer gives
    (``HF_CONFIG_TOKEN_KEYS`` as ferrolm writes them): transformers takes their ids and
    roles from it, and a change there would make it disagree with ferrolm."""
    config = parse_json(text, path)
    if not isinstance(config, dict):
        raise TokenizerFileError(f"{path}: must hold a JSON object")
    want = hf.hf_tokenizer_config(special_ids_in(vocab, specials))
    for key in HF_CONFIG_TOKEN_KEYS:
        if config.get(key) != want.get(key):
            raise TokenizerFileError(
                f"{path}: {key} differs from the special tokens recorded in {record_path.name} "
                f"({json.dumps(want.get(key))} expected): the file's tokenizer part was changed or damaged "
                "(its other fields, such as chat_template, may be edited)"
            )


def _warn_unicode(rec: dict, record_path: Path) -> None:
    saved, ours = rec.get("unicode_version"), patterns.unicode_version()
    if saved is not None and saved != ours:
        import warnings

        warnings.warn(
            f"{record_path}: the tokenizer was saved with Unicode {saved} character classes, this ferrolm has "
            f"{ours}: text with characters new in between may pre-tokenize differently",
            stacklevel=3,
        )


def check_fingerprint(loaded: LoadedDir, actual: str) -> None:
    """Raise when the fingerprint of what was read differs from the recorded one."""
    if loaded.fingerprint and loaded.fingerprint != actual:
        raise TokenizerFileError(
            f"{loaded.record_path}: recorded fingerprint {loaded.fingerprint[:12]}... differs from the tokenizer "
            f"the directory holds ({actual[:12]}...): the record, vocab.json or merges.txt was changed or damaged"
        )


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

    data = read_file_bytes(path, "tiktoken rank file")
    path = Path(path)
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

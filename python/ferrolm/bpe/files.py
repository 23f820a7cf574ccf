"""Tokenizer files, shared by the reference and the Rust-backed Tokenizer.

A tokenizer directory holds:

* ``vocab.json``: ``{token: id}`` with each token's bytes in GPT-2's byte-to-unicode form;
* ``merges.txt``: ``#version: 0.2`` then one merge per line, ``a b`` in the same form,
  in merge order;
* ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``: the same
  tokenizer for HF ``tokenizers`` and ``transformers`` (``AutoTokenizer.from_pretrained(dir)``);
* ``ferrolm_tokenizer.json``: ferrolm's own record: special tokens, the pattern, the Unicode
  version of the pre-tokenizer's classes, the fingerprint and the sha256 of the three
  files above it, all verified on load.

A directory is written whole or not at all (a temporary sibling, then a rename). Folders
written by ferrolm 0.1.0 kept the record in ``tokenizer.json``; they still load. tiktoken
(after inverting the byte map) reads vocab.json and merges.txt.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from ferrolm._util import atomic_write_bytes, fsync_dir
from ferrolm.bpe import patterns

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_SPECIALS_FILE = "special_tokens_map.json"
RECORD_FILE = "ferrolm_tokenizer.json"
LEGACY_RECORD_FILE = "tokenizer.json"  # where ferrolm 0.1.0 kept its record
CONFIG_FILE = RECORD_FILE
FORMAT = "ferrolm-tokenizer"
FORMAT_VERSION = 2
# The files whose sha256 the record keeps (the HF config files are the user's to edit).
CHECKED_FILES = (VOCAB_FILE, MERGES_FILE, HF_FILE)
TOKENIZER_FILES = (VOCAB_FILE, MERGES_FILE, HF_FILE, HF_CONFIG_FILE, HF_SPECIALS_FILE, RECORD_FILE)
# transformers' model_max_length when no model's context length is known (GPT-2's).
DEFAULT_MODEL_MAX_LENGTH = 1024


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


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


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


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise TokenizerFileError(f"{path}: is a directory, expected the {what}") from None
    except UnicodeDecodeError as e:
        raise TokenizerFileError(f"{path}: not UTF-8: {e}") from None


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
    return parse_merges(_read_text(path, "merges file"), path, fast=fast)


def parse_merges(text: str, path: Path, *, fast: bool = False) -> list[tuple[bytes, bytes]]:
    """:func:`read_merges` of the text of ``path``."""
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
    try:
        rec = json.loads(_read_text(path, "tokenizer record"))
    except json.JSONDecodeError as e:
        raise TokenizerFileError(f"{path}: not valid JSON: {e}") from None
    return _check_record(rec, path)


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

# Test-only: called after a directory's files are written and synced, before its rename.
_before_rename: Callable[[], None] | None = None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _check_replaceable(target: Path, owned: Iterable[str]) -> None:
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    others = sorted(set(os.listdir(target)) - set(owned))
    if others:
        raise FileExistsError(
            f"{target} holds files this would delete ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): "
            "write into a new or empty directory"
        )


def _remove_stale(target: Path) -> None:
    """Temporary siblings left by an earlier write into ``target`` that was killed."""
    prefix = f".{target.name}."
    for p in target.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False when unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _swap_in(tmp: Path, target: Path) -> None:
    """Put ``tmp`` at ``target``; what was at ``target`` ends at ``tmp``'s name (or is gone)."""
    if not target.exists():
        os.rename(tmp, target)
    elif not _exchange(tmp, target):
        # Two renames: between them ``target`` is absent, never half-written.
        old = tmp.with_name(tmp.name[: -len(".tmp")] + ".old.tmp")
        os.rename(target, old)
        os.rename(tmp, target)
        os.rename(old, tmp)


def write_dir(target: str | os.PathLike, files: dict[str, bytes], owned: Iterable[str] = TOKENIZER_FILES) -> Path:
    """Write ``files`` ({name: content}) as the directory ``target``, whole or not at all.

    The files go into a temporary sibling directory, are fsynced, and the directory is
    renamed to ``target`` (swapped in when ``target`` exists). An existing ``target`` may
    hold only names in ``owned`` (the files a previous write made), so nothing else is lost.
    """
    target = Path(target)
    _check_replaceable(target, owned)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        for name, data in files.items():
            _write_synced(tmp / name, data)
        fsync_dir(tmp)
        if _before_rename is not None:
            _before_rename()
        _swap_in(tmp, target)
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
    files.update(hf_files(vocab, merges, special_ids, pattern, model_max_length))
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
    return write_dir(directory, directory_files(vocab, merges, special_ids, pattern, fp, model_max_length))


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
    BPE made elsewhere; see :func:`read_hf_tokenizer`). vocab.json and merges.txt alone
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
            vocab, merges, specials, pattern = read_hf_tokenizer(directory / HF_FILE)
            return LoadedDir(vocab, merges, specials, pattern, None, None)
    texts = _checked_texts(directory, rec, record_path)
    specials = list(rec.get("special_tokens", []))
    vocab = parse_vocab(texts[VOCAB_FILE], directory / VOCAB_FILE, specials, fast=fast)
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
    try:
        data = json.loads(_read_text(path, "tokenizer.json"))
    except json.JSONDecodeError as e:
        raise TokenizerFileError(f"{path}: not valid JSON: {e}") from None
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return _check_record(data, path), path
    return None, path


def _checked_texts(directory: Path, rec: dict, record_path: Path) -> dict[str, str]:
    """The text of vocab.json and merges.txt; every file the record has a sha256 of is checked."""
    sums = rec.get("sha256", {})
    out = {}
    for name in dict.fromkeys([*sums, VOCAB_FILE, MERGES_FILE]):
        path = directory / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise TokenizerFileError(
                f"{directory}: incomplete tokenizer directory: {name} is missing (listed in {record_path.name})"
            ) from None
        if name in sums and sha256_hex(data) != sums[name]:
            raise TokenizerFileError(
                f"{path}: its sha256 differs from the one recorded in {record_path.name}: the file was changed or damaged"
            )
        if name in (VOCAB_FILE, MERGES_FILE):
            try:
                out[name] = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerFileError(f"{path}: not UTF-8: {e}") from None
    return out


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


EOT = "<|endoftext|>"
# Special tokens that end a document in other vocabularies, for transformers' eos_token.
_EOS_NAMES = (EOT, "<|end_of_text|>", "<|im_end|>", "</s>", "<eos>", "<|eot_id|>")


def hf_special_roles(special_tokens: Sequence[str]) -> dict[str, str]:
    """transformers' ``eos_token`` and ``pad_token`` among ``special_tokens``.

    eos: <|endoftext|> (or another end-of-document name); pad: a token named "pad", else
    eos (padding is masked, so any id serves), else the first special token."""
    eos = next((s for s in _EOS_NAMES if s in special_tokens), None)
    pad = next((s for s in special_tokens if "pad" in s.lower()), None) or eos
    if pad is None and special_tokens:
        pad = special_tokens[0]
    return {k: v for k, v in (("eos_token", eos), ("pad_token", pad)) if v is not None}


def hf_tokenizer_config(special_ids: Sequence[tuple[str, int]], model_max_length: int | None = None) -> dict:
    """``tokenizer_config.json`` for transformers: the fast tokenizer class, the special
    tokens' roles, the model's maximum length, no clean-up of spaces on decode."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(model_max_length or DEFAULT_MODEL_MAX_LENGTH),
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for s, i in special_ids
        },
    }
    config.update(hf_special_roles([s for s, _ in special_ids]))
    return config


def hf_files(
    vocab: dict[int, bytes],
    merges: Sequence[tuple[bytes, bytes]],
    special_ids: Sequence[tuple[str, int]],
    pattern: str,
    model_max_length: int | None = None,
) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json, by name."""
    hf = json.dumps(hf_tokenizer_json(vocab, merges, special_ids, pattern), ensure_ascii=False).encode("utf-8")
    return {
        HF_FILE: hf,
        HF_CONFIG_FILE: _json_bytes(hf_tokenizer_config(special_ids, model_max_length)),
        HF_SPECIALS_FILE: _json_bytes(hf_special_roles([s for s, _ in special_ids])),
    }


# --------------------------------------------------------------------------------------
# Reading HF tokenizer.json files made elsewhere
# --------------------------------------------------------------------------------------

_MODEL_HINTS = {"Unigram": " (SentencePiece Unigram)", "WordPiece": " (BERT-style WordPiece)", "WordLevel": ""}


def read_hf_tokenizer(
    path: str | os.PathLike, *, assume_normalized: bool = False
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]], list[str], str]:
    """(vocab, merges, special tokens, pattern) of an HF ``tokenizer.json`` (or a folder
    holding one) for a byte-level BPE: GPT-2's ByteLevel pre-tokenizer, or a Split regex
    followed by a ByteLevel that only maps bytes (Llama-3, Qwen2 and others).

    Every added token becomes a special token (matched in the text, never split). What
    ferrolm does not model is refused with a TokenizerFileError naming it: other models
    (Unigram, WordPiece, ...), normalizers, prefix spaces, added-token options. The
    post-processor is ignored: ferrolm's encode adds no BOS or template tokens.
    ``assume_normalized``: accept a normalizer (Qwen2's NFC, say), on the promise that the
    text is already normalized: ids then equal the original's for such text only.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / HF_FILE).exists() and (path / "tokenizer.model").exists():
            raise TokenizerFileError(f"{path}: holds a SentencePiece tokenizer.model, which ferrolm does not read")
        path = path / HF_FILE
    if path.suffix == ".model":
        raise TokenizerFileError(
            f"{path}: a SentencePiece model file: ferrolm reads byte-level BPE tokenizer.json files"
        )
    try:
        data = json.loads(_read_text(path, "HF tokenizer.json"))
    except json.JSONDecodeError as e:
        raise TokenizerFileError(f"{path}: not valid JSON: {e}") from None
    if isinstance(data, dict) and data.get("format") == FORMAT:
        raise TokenizerFileError(
            f"{path}: is ferrolm's own record (a 0.1.0 folder): load the folder with Tokenizer.load"
        )
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise TokenizerFileError(f'{path}: not an HF tokenizers file (no "model" object)')
    _check_hf_model(path, data["model"])
    if not assume_normalized:
        _check_hf_normalizer(path, data.get("normalizer"))
    pattern = _hf_pattern(path, data.get("pre_tokenizer"))
    decoder = data.get("decoder")
    if decoder is not None and (not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel"):
        raise TokenizerFileError(f"{path}: decoder {_describe(decoder)} is not supported (ferrolm decodes bytes)")
    added = _hf_added_tokens(path, data.get("added_tokens") or [])
    vocab = _hf_vocab(path, data["model"].get("vocab"), added)
    merges = _hf_merges(path, data["model"].get("merges") or [])
    return vocab, merges, [s for s, _ in sorted(added.items(), key=lambda kv: kv[1])], pattern


def _describe(obj: Any) -> str:
    return repr(obj.get("type")) if isinstance(obj, dict) else repr(obj)


def _check_hf_model(path: Path, model: dict) -> None:
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind != "BPE":
        raise TokenizerFileError(
            f"{path}: a {kind} model{_MODEL_HINTS.get(str(kind), '')}: ferrolm reads byte-level BPE tokenizers only"
        )
    unsupported = {
        "dropout": model.get("dropout") not in (None, 0, 0.0),
        "continuing_subword_prefix": bool(model.get("continuing_subword_prefix")),
        "end_of_word_suffix": bool(model.get("end_of_word_suffix")),
        "byte_fallback (a SentencePiece-style BPE)": bool(model.get("byte_fallback")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise TokenizerFileError(f"{path}: the BPE model uses {', '.join(bad)}, which ferrolm does not model")


def _check_hf_normalizer(path: Path, normalizer: Any) -> None:
    if normalizer is None or (
        isinstance(normalizer, dict) and normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")
    ):
        return
    raise TokenizerFileError(
        f"{path}: normalizer {_describe(normalizer)} is not supported: ferrolm does not normalize text, so ids would "
        "differ (for text already normalized, pass assume_normalized=True)"
    )


def _hf_pattern(path: Path, pre: Any) -> str:
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    steps = steps if isinstance(steps, list) else [steps]
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        _check_byte_level(path, steps[0])
        return "gpt2"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        _check_byte_level(path, steps[1])
        split = steps[0]
        regex = split.get("pattern", {}).get("Regex") if isinstance(split.get("pattern"), dict) else None
        if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
            raise TokenizerFileError(
                f"{path}: the Split pre-tokenizer must be a Regex with behavior Isolated, not inverted; got {split}"
            )
        return regex
    raise TokenizerFileError(
        f"{path}: pre-tokenizer {kinds if len(kinds) > 1 else _describe(pre)} is not supported: ferrolm reads "
        "ByteLevel (GPT-2) or Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]"
    )


def _check_byte_level(path: Path, step: dict) -> None:
    if step.get("add_prefix_space"):
        raise TokenizerFileError(f"{path}: ByteLevel add_prefix_space=true is not supported (ferrolm adds no space)")


def _hf_added_tokens(path: Path, added: Any) -> dict[str, int]:
    if not isinstance(added, list):
        raise TokenizerFileError(f"{path}: added_tokens must be a list")
    out: dict[str, int] = {}
    for t in added:
        content, i = (t.get("content"), t.get("id")) if isinstance(t, dict) else (None, None)
        if not isinstance(content, str) or not content or not isinstance(i, int) or i < 0:
            raise TokenizerFileError(f"{path}: added token {t!r} needs a non-empty content and an id")
        options = [k for k in ("lstrip", "rstrip", "single_word") if t.get(k)]
        if options:
            raise TokenizerFileError(
                f"{path}: added token {content!r} uses {', '.join(options)}, which ferrolm does not model"
            )
        if out.setdefault(content, i) != i:
            raise TokenizerFileError(f"{path}: added token {content!r} is listed with two ids")
    return out


def _hf_vocab(path: Path, raw: Any, added: dict[str, int]) -> dict[int, bytes]:
    if not isinstance(raw, dict):
        raise TokenizerFileError(f'{path}: the model has no "vocab" object')
    vocab: dict[int, bytes] = {}
    for token, i in itertools.chain(raw.items(), added.items()):
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise TokenizerFileError(f"{path}: id of {token!r} must be a non-negative integer, got {i!r}")
        b = token.encode("utf-8") if added.get(token) == i else str_to_token(token, where=f"{path}: token")
        if vocab.setdefault(i, b) != b:
            raise TokenizerFileError(f"{path}: id {i} is used by two tokens")
    singles = {b[0] for b in vocab.values() if len(b) == 1}
    if len(singles) < 256:
        missing = min(set(range(256)) - singles)
        raise TokenizerFileError(
            f"{path}: not a byte-level vocabulary: {256 - len(singles)} of the 256 bytes have no token (e.g. 0x{missing:02x})"
        )
    return vocab


def _hf_merges(path: Path, raw: Any) -> list[tuple[bytes, bytes]]:
    if not isinstance(raw, list):
        raise TokenizerFileError(f"{path}: the model's merges must be a list")
    merges = []
    for k, m in enumerate(raw):
        parts = m.split(" ") if isinstance(m, str) else m
        if not isinstance(parts, list) or len(parts) != 2 or not all(isinstance(x, str) and x for x in parts):
            raise TokenizerFileError(f"{path}: merge {k} must be 'a b' or [a, b], got {m!r}")
        where = f"{path}: merge {k}"
        merges.append((str_to_token(parts[0], where=where), str_to_token(parts[1], where=where)))
    return merges

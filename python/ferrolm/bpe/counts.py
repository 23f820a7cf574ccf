"""Tokenizer training in two phases: pre-token counts per part, then merges from all of them.

    from ferrolm.bpe import counts
    for i in range(8):                    # on 8 machines, jobs or Ray tasks
        counts.count(["owt.txt"], f"c/owt.{i}.counts", part=(i, 8))
    vocab, merges = counts.train_from_counts([f"c/owt.{i}.counts" for i in range(8)], 32000)

The merges equal those of ``ferrolm.bpe.trainer.train`` over the whole input, for any part
count and thread count: a part is a byte range of the inputs cut just after a special token
(a hard boundary) or at a file's end, and counts add up. Compressed, JSON Lines and Parquet
files are not cut: each goes whole to the part in which it starts.

A counts file (the layout is in rust/train/counts_file.rs) is versioned and checksummed and
records the pattern, special tokens and Unicode version of the pre-tokenizer: counts made
under other settings are refused. The merge step holds one table of the distinct pre-tokens
of all the files (read one at a time), as the single-run trainer does.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Union

from ferrolm import _core
from ferrolm._util import check_out, check_special_tokens, fsync_dir
from ferrolm.bpe import inputs as _inputs
from ferrolm.bpe import patterns
from ferrolm.bpe import trainer as _trainer

__all__ = ["count", "count_texts", "train_from_counts", "part_ranges", "read_header"]

PathInput = Union[str, "os.PathLike[str]"]
FORMAT = "ferrolm-pretoken-counts"
MAGIC = b"ferrolm-counts\n\0"
#: The largest header the core writes or reads (rust/train/counts_file.rs).
MAX_HEADER = 1 << 24


def part_ranges(
    paths: Sequence[str], part: tuple[int, int], special_tokens: Iterable[str], column: str = "text"
) -> list[tuple[str, int, int]]:
    """The ``(path, start, end)`` byte ranges of part ``(I, N)`` of ``paths`` read end to
    end: N nearly equal ranges, each boundary moved forward to just after a special token
    or to a file's end (a file that cannot be cut goes whole to the part it starts in).
    The rule is the core's, which ``count`` reads the part with."""
    i, n = part
    specials = check_special_tokens(special_tokens)
    return [(os.fspath(p), a, b) for p, a, b in _core.count_part_ranges(list(paths), specials, i, n, column)]


def _header(specials: list[str], pattern: str, extra: dict) -> str:
    return json.dumps(
        {
            "format": FORMAT,
            "pattern": patterns.resolve(pattern),
            "special_tokens": specials,
            "unicode_version": patterns.unicode_version(),
            "ferrolm_version": _core.version(),
            **extra,
        },
        ensure_ascii=False,
        sort_keys=True,
    )


def count(
    input: PathInput | Sequence[PathInput],
    counts_out: PathInput,
    special_tokens: Iterable[str] | None = ("<|endoftext|>",),
    *,
    part: tuple[int, int] | str | None = None,
    pattern: str = "gpt2",
    num_threads: int | None = None,
    errors: str = "strict",
    column: str = "text",
    progress: bool = True,
    force: bool = False,
) -> dict:
    """Count the pre-tokens of ``input`` (paths, globs, folders), or of its part ``(I, N)``
    (or ``"I/N"``, I 0-based), into the counts file ``counts_out``; return its header.
    The file appears whole or not at all. An existing ``counts_out`` that is not a counts
    file is replaced only when ``force``; an input never."""
    from ferrolm.bpe.shards import parse_part

    specials = check_special_tokens(special_tokens)
    patterns.resolve(pattern)
    if errors not in ("strict", "replace"):
        raise ValueError(f'errors must be "strict" or "replace", got {errors!r}')
    given = [os.fspath(p) for p in ([input] if isinstance(input, (str, os.PathLike)) else input)]
    paths = _inputs.expand(given)
    if not paths:
        raise ValueError("the corpus is empty: no input files given")
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"input file not found: {p}")
    check_counts_out(counts_out, paths, force=force)
    split = parse_part(part)
    before = [_inputs.identity(p) for p in paths]
    trainer = _core.BpeTrainer(specials, pattern, num_threads, errors, _trainer._CHUNK_SIZE)
    bars = _trainer._Progress(progress)
    try:
        report = bars.stage("counting", "B")
        if split is None:
            _trainer._count_files(trainer, paths, given, column, report)
            ranges = None
        else:
            ranges = [(os.fspath(p), a, b) for p, a, b in trainer.count_part(paths, split[0], split[1], column, report)]
    finally:
        bars.close()
    _check_unchanged(before)
    extra = {
        "inputs": before,
        "part": list(split) if split else None,
        "ranges": [[os.path.abspath(p), a, b] for p, a, b in ranges] if ranges is not None else None,
    }
    return _write(trainer, counts_out, _header(specials, pattern, extra))


def _check_unchanged(before: list[list]) -> None:
    """Refuse counts of a file that changed while it was read (a mix of two versions)."""
    for rec in before:
        change = _inputs.identity_change(rec, _inputs.identity(rec[0]))
        if change:
            raise ValueError(f"{rec[0]} changed while it was counted ({change}); count it again")


def count_texts(
    texts: Iterable[str],
    counts_out: PathInput,
    special_tokens: Iterable[str] | None = ("<|endoftext|>",),
    *,
    pattern: str = "gpt2",
    num_threads: int | None = None,
    part: tuple[int, int] | None = None,
    source: object = None,
    force: bool = False,
) -> dict:
    """Count the pre-tokens of documents (each a text of its own, as ``trainer.train`` reads
    an iterable) into ``counts_out``. ``part`` and ``source`` (any JSON value naming the
    whole of which these documents are part ``part``) let ``train_from_counts`` check that
    every part of the whole is given once. ``force``: as for ``count``."""
    check_counts_out(counts_out, [], force=force)
    specials = check_special_tokens(special_tokens)
    patterns.resolve(pattern)
    trainer = _core.BpeTrainer(specials, pattern, num_threads, "strict", _trainer._CHUNK_SIZE)
    _trainer._feed_documents(trainer, _inputs.text_batches(texts), None)
    extra = {"inputs": source, "part": list(part) if part else None, "ranges": None}
    return _write(trainer, counts_out, _header(specials, pattern, extra))


def check_counts_out(counts_out: PathInput, inputs: Iterable[PathInput], *, force: bool) -> None:
    """Refuse to write ``counts_out`` over one of ``inputs``, or, unless ``force``, over a file
    that is not a counts file (one an earlier count wrote may be replaced)."""
    check_out(counts_out, inputs, force=force, judge=_judge_counts, example="corpus.counts", flag="--counts-out")


def _judge_counts(path: Path) -> str | None:
    try:
        if read_header(path).get("format") == FORMAT:
            return None
    except (OSError, ValueError):
        pass
    return "exists and is not a pre-token counts file of ferrolm's; choose another file name"


def _write(trainer, counts_out: PathInput, header: str) -> dict:
    """The trainer's counts to ``counts_out``, whole or not at all; returns the header."""
    out = Path(counts_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        entries = trainer.write_counts(os.fspath(tmp), header)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
    record = json.loads(header)
    record["unique_pretokens"] = entries
    return record


def read_header(path: PathInput) -> dict:
    """The header of a counts file (its checksum is checked when it is read for training);
    ValueError naming the file when the header is not there whole."""
    name = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(24)
        if len(head) < 24 or head[:16] != MAGIC:
            raise ValueError(f"{name}: not a ferrolm pre-token counts file")
        n = int.from_bytes(head[20:24], "little")
        # The header, the entry count and the checksum must fit in the file.
        if n > MAX_HEADER or 24 + n + 8 + 32 > size:
            raise ValueError(f"{name}: damaged counts file (header length {n:,} does not fit its {size:,} bytes)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{name}: damaged counts file (its {n:,}-byte header is not a JSON object)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: damaged counts file (its {n:,}-byte header is not a JSON object)")
    return header


def train_from_counts(
    counts_paths: PathInput | Sequence[PathInput],
    vocab_size: int,
    special_tokens: Iterable[str] | None = None,
    *,
    pattern: str | None = None,
    num_threads: int | None = None,
    progress: bool = True,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train from counts files: ``(vocab, merges)`` as ``trainer.train`` returns them for
    the inputs the files counted. ``special_tokens`` and ``pattern`` default to the files'
    (which must all agree, with each other, with these when given, and with this ferrolm's
    Unicode version); the parts of one split must all be there, each once."""
    given = [counts_paths] if isinstance(counts_paths, (str, os.PathLike)) else list(counts_paths)
    if not given:
        raise ValueError("no counts files given")
    for p in given:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"counts file not found: {os.fspath(p)}")
    headers = [read_header(p) for p in given]
    first = headers[0]
    specials = check_special_tokens(first.get("special_tokens") if special_tokens is None else special_tokens)
    pat = patterns.resolve(pattern) if pattern is not None else first.get("pattern")
    want = {"pattern": pat, "special_tokens": specials, "unicode_version": patterns.unicode_version()}
    _check_headers(given, headers, want)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if not 256 + len(specials) <= vocab_size <= _trainer.MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} must be between {256 + len(specials)} and {_trainer.MAX_VOCAB_SIZE}")
    trainer = _core.BpeTrainer(specials, pat, num_threads, "strict", None)
    bars = _trainer._Progress(progress)
    try:
        for p in given:
            header = json.loads(trainer.add_counts_file(os.fspath(p)))
            if header != headers[given.index(p)]:  # changed between the check and the read
                raise ValueError(f"{os.fspath(p)}: changed while being read")
        num_merges = vocab_size - 256 - len(specials)
        merges, vocab = trainer.learn(num_merges, bars.stage("merging", "merge", num_merges))
    finally:
        bars.close()
    for s in specials:
        vocab[len(vocab)] = s.encode("utf-8")
    return vocab, merges


def _check_headers(paths: list, headers: list[dict], want: dict) -> None:
    for p, h in zip(paths, headers):
        if h.get("format") != FORMAT:
            raise ValueError(f"{os.fspath(p)}: not a ferrolm pre-token counts file")
        for key, value in want.items():
            if h.get(key) != value:
                raise ValueError(
                    f"{os.fspath(p)}: counted with {key} {h.get(key)!r}, not {value!r}; "
                    "counts made under other settings do not add up to one run"
                )
    splits: dict[str, dict[int, list]] = {}
    members: dict[str, list] = {}
    for p, h in zip(paths, headers):
        part = h.get("part")
        files = _file_entries(h.get("inputs"))
        whole = [e[0] for e in files] if files is not None else h.get("inputs")
        key = json.dumps([whole, part[1] if part else None])
        index = part[0] if part else 0
        splits.setdefault(key, {}).setdefault(index, []).append(os.fspath(p))
        members.setdefault(key, []).append((os.fspath(p), files))
    for key, found in splits.items():
        _check_one_version(members[key])
        n = json.loads(key)[1] or 1
        twice = [names for names in found.values() if len(names) > 1]
        if twice:
            raise ValueError(f"the same counts are given twice: {', '.join(twice[0])}")
        missing = [i for i in range(n) if i not in found]
        if missing:
            example = next(iter(found.values()))[0]
            raise ValueError(
                f"{len(missing)} of the {n} parts that {example} belongs to are missing (part {missing[0]}/{n} and others)"
                if len(missing) > 1
                else f"part {missing[0]}/{n} of the split that {example} belongs to is missing"
            )


def _file_entries(inputs) -> list | None:
    """The ``[path, size, ...]`` records of a header's inputs; None when they are not files
    (the documents of a Dataset, say)."""
    if not isinstance(inputs, list) or not all(
        isinstance(e, list) and len(e) >= 2 and isinstance(e[0], str) and type(e[1]) is int for e in inputs
    ):
        return None
    return inputs


def _check_one_version(members: list[tuple[str, list | None]]) -> None:
    """Refuse the counts files of one split that counted different versions of an input."""
    seen: dict[str, list[tuple[str, list]]] = {}
    for name, files in members:
        for rec in files or []:
            known = seen.setdefault(rec[0], [])
            for other, earlier in known:
                change = _inputs.identity_change(earlier, rec)
                if change:
                    raise ValueError(
                        f"{other} and {name} counted different versions of {rec[0]} ({change}): "
                        "count every part from the same version of the input"
                    )
            if all(earlier != rec for _, earlier in known):  # an older file's [path, size] beside a full record
                known.append((name, rec))

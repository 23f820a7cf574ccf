"""Token shards: encode text corpora into flat uint16/uint32 files, list and check them.

A shard is ``P.bin`` (little-endian token ids, no header; documents each followed by the
end-of-text id) plus its sidecar ``P.json`` (dtype, counts, vocab size, eos id, tokenizer
fingerprint, inputs with sizes and sha256). ``--part I/N`` writes ``P.part-I-of-N.bin/.json``.

    from ferrolm import Tokenizer

    from ferrolm.bpe import shards
    tok = Tokenizer.load("tok/")
    shards.encode(tok, ["owt_train.txt"], "data/owt")        # data/owt.bin + data/owt.json
    shards.validate_shards("data/owt", tokenizer=tok)          # [] when all is well

The heavy lifting is Rust (``ferrolm._core.encode_shard``): large reads cut at document
boundaries, encoding on all cores in input order, resumable writes. This module builds the
job, shows progress, and writes the sidecar once the data is complete.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Union

from ferrolm import _core
from ferrolm._util import atomic_open
from ferrolm.bpe import patterns

PathInput = Union[str, "os.PathLike[str]"]

FORMAT = "ferrolm-shard"
FORMAT_VERSION = 1
MANIFEST_FORMAT = "ferrolm-shards-manifest"
EOT = "<|endoftext|>"

#: Target size of the chunks read and encoded as one task (a chunk ends at a document
#: boundary, so it may be a little larger). Small enough that the buffers of the chunks in
#: flight stay few MB: memory a process touches for the first time costs a page fault
#: per 4 KiB, and with 4 MiB chunks those faults took about 10 % of the encoding time.
DEFAULT_CHUNK_SIZE = 1 << 20
#: Seconds between commits of the progress journal (each costs two fsyncs).
DEFAULT_COMMIT_INTERVAL = 5.0
_BUILTIN_PATTERNS = ("gpt2", "cl100k", "o200k")
_ITEMSIZE = {"uint16": 2, "uint32": 4}


class ShardError(ValueError):
    """A shard or set of shards that is missing, incomplete or inconsistent."""


# --------------------------------------------------------------------------- paths


def parse_part(spec: str | Sequence[int] | None) -> tuple[int, int] | None:
    """``"I/N"`` (I 0-based) → ``(I, N)``; also accepts a pair or None."""
    if spec is None:
        return None
    if isinstance(spec, str):
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
        if not m:
            raise ValueError(f"--part must look like I/N (e.g. 0/8), got {spec!r}")
        i, n = int(m.group(1)), int(m.group(2))
    else:
        i, n = (int(x) for x in spec)
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--part {i}/{n}: need N >= 1 and 0 <= I < N (I is 0-based)")
    return i, n


def output_paths(out: PathInput, part: tuple[int, int] | None = None) -> tuple[Path, Path]:
    """``(P.bin, P.json)`` for prefix ``out``, or ``P.part-I-of-N.bin/.json`` for a part."""
    prefix = os.fspath(out)
    for ext in (".bin", ".json"):
        if prefix.endswith(ext):
            prefix = prefix[: -len(ext)]
    if part is not None:
        prefix = f"{prefix}.part-{part[0]}-of-{part[1]}"
    return Path(prefix + ".bin"), Path(prefix + ".json")


def _journal_path(bin_path: Path) -> Path:
    return bin_path.with_name(bin_path.name[: -len(".bin")] + ".progress.json")


# --------------------------------------------------------------------------- encode


def _load_tokenizer(tokenizer: Any):
    from ferrolm.bpe.tokenizer import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        return Tokenizer.load(tokenizer)
    raise TypeError(f"tokenizer must be a ferrolm.Tokenizer or a tokenizer directory, got {type(tokenizer).__name__}")


def pick_dtype(dtype: str, vocab_size: int) -> str:
    """Resolve ``auto``/``uint16``/``uint32`` for a vocabulary, refusing a dtype too small for it."""
    if dtype == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype must be auto, uint16 or uint32, got {dtype!r}")
    if dtype == "uint16" and vocab_size > 1 << 16:
        raise ValueError(
            f"token ids of this tokenizer go up to {vocab_size - 1}, which does not fit in uint16; "
            "use --dtype uint32 (or auto)"
        )
    return dtype


class _Progress:
    """A tqdm bar in bytes (MB/s, ETA) with tokens/s in the postfix."""

    def __init__(self, enabled: bool | None, desc: str):
        self.bar = None
        self.start = time.perf_counter()
        self.first: tuple[int, int] | None = None
        if enabled is False:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is a dependency
            return
        self.bar = tqdm(
            total=0,
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            desc=desc,
            dynamic_ncols=True,
            disable=None if enabled is None else False,
            smoothing=0.1,
        )

    def __call__(self, raw_done: int, raw_total: int, tokens: int, documents: int) -> None:
        if self.first is None:
            self.first = (raw_done, tokens)
        if self.bar is None:
            return
        if self.bar.total != raw_total:
            self.bar.total = raw_total
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = (tokens - self.first[1]) / elapsed
        self.bar.set_postfix_str(
            f"{tokens / 1e6:,.1f}M tok, {rate / 1e6:,.2f}M tok/s, {documents:,} docs", refresh=False
        )
        self.bar.update(raw_done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def encode(
    tokenizer: Any,
    inputs: PathInput | Sequence[PathInput],
    out: PathInput,
    *,
    threads: int | None = None,
    dtype: str = "auto",
    part: str | Sequence[int] | None = None,
    jsonl_field: str = "text",
    input_format: str = "auto",
    errors: str = "strict",
    chunk_size: int | None = None,
    commit_interval: float = DEFAULT_COMMIT_INTERVAL,
    progress: bool | None = True,
    hash_inputs: bool = True,
) -> dict:
    """Encode ``inputs`` into the shard ``out`` (``out.bin`` + ``out.json``); return the sidecar.

    * ``inputs``: plain text whose documents are separated by the tokenizer's ``<|endoftext|>``
      (as TinyStories and the CS336 OpenWebText files), ``.gz``/``.zst`` compressed text, and
      JSON Lines (``*.jsonl``/``*.ndjson``, or ``input_format="jsonl"``) whose ``jsonl_field``
      holds each document. Plain text is encoded exactly as ``tokenizer.encode(whole_text)``
      (special tokens allowed), plus an eos after a last document that lacks one; JSON Lines
      documents are encoded as ordinary text, each followed by the eos id.
    * ``dtype``: ``auto`` (uint16 when the vocab fits), ``uint16`` or ``uint32``.
    * ``part``: ``"I/N"`` encodes only the I-th (0-based) of N byte ranges of the inputs,
      cut at document boundaries, into ``out.part-I-of-N.bin``; the N parts concatenated
      equal the whole.
    * ``errors``: ``strict`` (invalid UTF-8 is an error naming file and byte offset) or
      ``replace`` (U+FFFD).
    * ``hash_inputs``: record the sha256 of each input in the sidecar (computed while reading;
      ``False`` saves its CPU time and records ``null``).

    The output is byte-identical for any ``threads`` and ``chunk_size``. A run that is killed
    (Ctrl-C or kill -9) leaves ``out.bin.partial`` and ``out.progress.json``; calling again
    with the same tokenizer, inputs and options continues from the last committed chunk.
    The final names appear only once the data is complete and fsynced.
    """
    tok = _load_tokenizer(tokenizer)
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    inputs = [os.fspath(p) for p in inputs]
    if not inputs:
        raise ValueError("no input files given")
    for p in inputs:
        if not os.path.exists(p):
            raise FileNotFoundError(f"input file not found: {p}")
        if os.path.isdir(p):
            raise ValueError(f"input {p} is a directory, not a file")
    if input_format not in ("auto", "text", "jsonl"):
        raise ValueError(f"input format must be auto, text or jsonl, got {input_format!r}")
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors must be strict or replace, got {errors!r}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    part_t = parse_part(part)
    dt = pick_dtype(dtype, tok.vocab_size)
    bin_path, json_path = output_paths(out, part_t)
    bin_path.parent.mkdir(parents=True, exist_ok=True)

    eos_id = tok.eos_id
    eos = (EOT, int(eos_id)) if eos_id is not None else None
    if eos is None:
        print(
            f"ferrolm encode: warning: the tokenizer has no {EOT} token; documents will not be separated",
            file=sys.stderr,
        )
    # Newline cuts inside long documents are exact only for the built-in patterns.
    newline_cuts = patterns.name_of(tok.pattern) in _BUILTIN_PATTERNS and not any("\n" in s for s in tok.special_tokens)

    fp = tok.fingerprint
    stats = [os.stat(p) for p in inputs]
    params = json.dumps(
        {
            "tokenizer_fingerprint": fp,
            "inputs": [[os.path.abspath(p), st.st_size, st.st_mtime_ns] for p, st in zip(inputs, stats)],
            "dtype": dt,
            "eos": list(eos) if eos else None,
            "part": list(part_t) if part_t else None,
            "jsonl_field": jsonl_field,
            "input_format": input_format,
            "errors": errors,
            "newline_cuts": newline_cuts,
            "hash": bool(hash_inputs),
        },
        sort_keys=True,
    )
    bar = _Progress(progress, desc=f"encode {bin_path.name}")
    try:
        result = _core.encode_shard(
            tok._core,
            inputs,
            os.fspath(bin_path),
            dtype=dt,
            eos=eos,
            jsonl_field=jsonl_field,
            input_format=None if input_format == "auto" else input_format,
            errors=errors,
            chunk_size=int(chunk_size or DEFAULT_CHUNK_SIZE),
            threads=int(threads or 0),
            part=part_t,
            newline_cuts=newline_cuts,
            params=params,
            commit_interval=float(commit_interval),
            progress=bar,
            hash=bool(hash_inputs),
        )
    finally:
        bar.close()

    total = sum(st.st_size for st in stats)
    records = []
    for r in result["inputs"]:
        rec = {"path": os.fspath(r["path"]), "bytes": r["bytes"], "sha256": r["sha256"]}
        if part_t is not None:
            rec["range"] = list(r["range"])
        if r["uncompressed_bytes"] is not None:
            rec["uncompressed_bytes"] = r["uncompressed_bytes"]
        records.append(rec)
    sidecar = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": dt,
        "num_tokens": result["num_tokens"],
        "num_documents": result["num_documents"],
        "vocab_size": tok.vocab_size,
        "eos_id": eos_id,
        "tokenizer_fingerprint": fp,
        "inputs": records,
        "part": list(part_t) if part_t else None,
        "byte_range": list(result["byte_range"]) if part_t else None,
        "total_input_bytes": total,
        "ferrolm_version": _core.version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    _finalize(Path(result["partial_path"]), bin_path, json_path, sidecar)
    sidecar["resumed_tokens"] = result["resumed_tokens"]
    sidecar["restart_reason"] = result["restart_reason"]
    return sidecar


def _finalize(partial: Path, bin_path: Path, json_path: Path, sidecar: dict) -> None:
    """Data to its final name, then the sidecar (written beside it, fsynced, renamed): a
    failure before the sidecar's rename leaves no sidecar, so no shard that claims to be whole."""
    with atomic_open(json_path) as f:
        f.write((json.dumps(sidecar, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
        if partial != bin_path:
            os.replace(partial, bin_path)
    try:
        os.unlink(_journal_path(bin_path))
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- list / validate


def read_json_object(path: Path) -> dict:
    """The JSON object in a sidecar or manifest file; ShardError when it is not one."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"shard sidecar not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(record, dict):
        raise ShardError(f"{path}: expected a JSON object")
    return record


def read_sidecar(path: Path) -> dict:
    """A shard's sidecar record; ShardError when the file is not one."""
    record = read_json_object(path)
    if record.get("format") != FORMAT:
        raise ShardError(f'{path}: not a ferrolm shard sidecar (missing "format": "{FORMAT}")')
    return record


_PART_RE = re.compile(r"\.part-(\d+)-of-(\d+)\.json$")


def resolve_shards(src: PathInput | Sequence[PathInput]) -> list[Path]:
    """The sidecar paths ``src`` names, in order (see the shard contract).

    ``src`` is a prefix P (``P.json``, or else all ``P.part-I-of-N.json``, all N required), a
    ``P.json`` or ``P.bin`` path, a manifest, or a list of these.
    """
    if not isinstance(src, (str, os.PathLike)):
        out: list[Path] = []
        for s in src:
            out.extend(resolve_shards(s))
        if not out:
            raise ShardError("no shards given")
        return out
    s = os.fspath(src)
    p = Path(s)
    if s.endswith(".bin"):
        return [Path(s[:-4] + ".json")]
    if s.endswith(".json") and p.exists():
        record = read_json_object(p)
        if record.get("format") == MANIFEST_FORMAT:
            parts = record.get("parts")
            if not isinstance(parts, list) or not all(isinstance(x, str) for x in parts):
                raise ShardError(f'{p}: a manifest needs "parts": [relative prefixes]')
            return resolve_shards([str(p.parent / x) for x in parts])
        return [p]
    if Path(s + ".json").exists():
        return [Path(s + ".json")]
    parent = p.parent if str(p.parent) else Path(".")
    found: dict[int, set[int]] = {}
    if parent.is_dir():
        for f in parent.iterdir():
            name = f.name
            if name.startswith(p.name + ".part-"):
                m = _PART_RE.search(name)
                if m and name[: m.start()] == p.name:
                    found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if not found:
        raise FileNotFoundError(f"no shard found at {s} (looked for {s}.json and {s}.part-I-of-N.json)")
    if len(found) > 1:
        raise ShardError(f"{s}: parts of different splits are present ({', '.join(f'of-{n}' for n in sorted(found))})")
    n, have = next(iter(found.items()))
    missing = sorted(set(range(n)) - have)
    if missing:
        shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ShardError(f"{s}: {len(missing)} of {n} parts missing (part {shown})")
    return [Path(f"{s}.part-{i}-of-{n}.json") for i in range(n)]


def list_shards(src: PathInput | Sequence[PathInput]) -> list[dict]:
    """The sidecars of ``src`` (each with ``"json_path"`` and ``"bin_path"`` added), in order."""
    out = []
    for j in resolve_shards(src):
        record = read_sidecar(j)
        record["json_path"] = str(j)
        record["bin_path"] = str(j.with_suffix(".bin"))
        out.append(record)
    return out


def validate_shards(src: PathInput | Sequence[PathInput], tokenizer: Any = None, *, deep: bool = False) -> list[str]:
    """Problems found in the shards of ``src`` (empty when all is well).

    Checks: each ``.bin`` exists with exactly ``num_tokens`` items; dtype, vocab size, eos id
    and tokenizer fingerprint agree across parts (and with ``tokenizer``, a Tokenizer, a
    directory or a fingerprint string); parts of an N-way split tile the inputs with no gap
    or overlap and agree on the inputs' sizes; no resume journal is left over. ``deep``
    also reads every id and checks it is below ``vocab_size``.
    """
    problems: list[str] = []
    try:
        records = list_shards(src)
    except (ShardError, FileNotFoundError) as e:
        return [str(e)]
    want_fp = None
    if tokenizer is not None:
        want_fp = (
            tokenizer
            if isinstance(tokenizer, str) and re.fullmatch(r"[0-9a-f]{64}", tokenizer)
            else _load_tokenizer(tokenizer).fingerprint
        )
    first = records[0]
    for r in records:
        name = r["json_path"]
        dt = r.get("dtype")
        if dt not in _ITEMSIZE:
            problems.append(f"{name}: unknown dtype {dt!r}")
            continue
        bad = [k for k in ("num_tokens", "num_documents", "vocab_size") if not _is_count(r.get(k, 0))]
        if bad:
            problems += [f"{name}: {k} must be a non-negative integer, got {r.get(k)!r}" for k in bad]
            continue
        bin_path = Path(r["bin_path"])
        if not bin_path.exists():
            problems.append(f"{name}: data file {bin_path} is missing")
        else:
            size = bin_path.stat().st_size
            if size != r.get("num_tokens", -1) * _ITEMSIZE[dt]:
                problems.append(
                    f"{bin_path}: {size} bytes, but the sidecar says {r.get('num_tokens')} {dt} tokens "
                    f"({r.get('num_tokens', 0) * _ITEMSIZE[dt]} bytes)"
                )
            elif deep and r["num_tokens"]:
                import numpy as np

                data = np.memmap(bin_path, dtype=np.dtype(dt).newbyteorder("<"), mode="r")
                top = int(data.max())
                if top >= r["vocab_size"]:
                    problems.append(f"{bin_path}: holds token id {top}, not below vocab_size {r['vocab_size']}")
        journal = _journal_path(bin_path)
        if journal.exists():
            problems.append(
                f"{journal}: a resume journal is left over (an encode of this shard was interrupted after it completed, or is running)"
            )
        for key in ("dtype", "vocab_size", "eos_id", "tokenizer_fingerprint"):
            if r.get(key) != first.get(key):
                problems.append(f"{name}: {key} {r.get(key)!r} differs from {first['json_path']}'s {first.get(key)!r}")
        if want_fp is not None and r.get("tokenizer_fingerprint") != want_fp:
            problems.append(
                f"{name}: tokenizer fingerprint {str(r.get('tokenizer_fingerprint'))[:12]}… differs from the given tokenizer's {want_fp[:12]}…"
            )
    # Parts of one split: ranges tile [0, total), consistent inputs.
    splits: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("part"):
            splits.setdefault((Path(r["json_path"]).name.split(".part-")[0], r["part"][1]), []).append(r)
    for (stem, n), parts in splits.items():
        parts.sort(key=lambda r: r["part"][0])
        idx = [r["part"][0] for r in parts]
        if idx != list(range(n)):
            problems.append(f"{stem}: parts {idx} of {n} present; expected 0..{n - 1}")
            continue
        pos = 0
        for r in parts:
            br = r.get("byte_range")
            if not br or br[0] != pos:
                problems.append(
                    f"{r['json_path']}: byte range {br} does not start where the previous part ended ({pos})"
                )
                break
            pos = br[1]
        else:
            total = parts[0].get("total_input_bytes")
            if total is not None and pos != total:
                problems.append(f"{stem}: the parts cover {pos} bytes of the {total} bytes of input")
        totals = {r.get("total_input_bytes") for r in parts}
        if len(totals) > 1:
            problems.append(
                f"{stem}: parts were made from inputs of different total sizes {sorted(t for t in totals if t is not None)}"
            )
    return problems


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _count(v) -> str:
    """A sidecar count for the listing: with thousands separators, or as it is when not a count."""
    return f"{v:,}" if _is_count(v) else repr(v)


def format_listing(records: Iterable[dict]) -> str:
    """A table of shards for ``ferrolm shards``."""
    rows = [("shard", "part", "dtype", "tokens", "documents", "vocab", "eos", "tokenizer", "input bytes")]
    tok_total = doc_total = 0
    for r in records:
        part = f"{r['part'][0]}/{r['part'][1]}" if r.get("part") else "-"
        br = r.get("byte_range")
        in_bytes = (
            (br[1] - br[0]) if br else r.get("total_input_bytes", sum(i.get("bytes", 0) for i in r.get("inputs", [])))
        )
        rows.append(
            (
                Path(r["bin_path"]).name,
                part,
                r.get("dtype", "?"),
                _count(r.get("num_tokens", 0)),
                _count(r.get("num_documents", 0)),
                str(r.get("vocab_size")),
                str(r.get("eos_id")),
                str(r.get("tokenizer_fingerprint", ""))[:12],
                _count(in_bytes),
            )
        )
        tok_total += r.get("num_tokens", 0) if _is_count(r.get("num_tokens", 0)) else 0
        doc_total += r.get("num_documents", 0) if _is_count(r.get("num_documents", 0)) else 0
    if len(rows) > 2:
        rows.append(("total", "", "", f"{tok_total:,}", f"{doc_total:,}", "", "", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    )

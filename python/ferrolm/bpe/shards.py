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
from ferrolm._util import atomic_open, check_out
from ferrolm.bpe import inputs as _inputs
from ferrolm.bpe import patterns

PathInput = Union[str, "os.PathLike[str]"]

FORMAT = "ferrolm-shard"
FORMAT_VERSION = 1
MANIFEST_FORMAT = "ferrolm-shards-manifest"
#: The resume journal's format (rust/shards/writer.rs).
JOURNAL_FORMAT = "ferrolm-encode-progress"
MANIFEST_VERSION = 1
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
    column: str = "text",
    jsonl_field: str | None = None,
    input_format: str = "auto",
    errors: str = "strict",
    chunk_size: int | None = None,
    commit_interval: float = DEFAULT_COMMIT_INTERVAL,
    progress: bool | None = True,
    hash_inputs: bool = True,
    force: bool = False,
) -> dict:
    """Encode ``inputs`` into the shard ``out`` (``out.bin`` + ``out.json``); return the sidecar.

    * ``inputs``: files, globs (``"data/*.parquet"``) and folders (every file below, sorted):
      plain text whose documents are separated by the tokenizer's ``<|endoftext|>``
      (as TinyStories and the CS336 OpenWebText files), ``.gz``/``.zst`` compressed text,
      JSON Lines (``*.jsonl``/``*.ndjson``, or any file whose first line is a JSON object,
      ``.json`` included) and Parquet (read by the core, a batch of rows at a time), whose
      ``column`` holds each document. Plain text is encoded exactly as
      ``tokenizer.encode(whole_text)`` (special tokens allowed), plus an eos after a last
      document that lacks one; JSON Lines and Parquet documents are encoded as ordinary
      text, each followed by the eos id. Formats ferrolm does not read (xz, bzip2, zip, ...)
      are refused by name.
    * ``column``: the field of a JSON Lines record, or the column of a Parquet file, that
      holds the text (``jsonl_field`` is the older name of the same option).
    * ``dtype``: ``auto`` (uint16 when the vocab fits), ``uint16`` or ``uint32``.
    * ``part``: ``"I/N"`` encodes only the I-th (0-based) of N byte ranges of the inputs,
      cut at document boundaries, into ``out.part-I-of-N.bin``; the N parts concatenated
      equal the whole (a compressed or Parquet file goes whole to one part).
    * ``errors``: ``strict`` (invalid UTF-8 is an error naming file and byte offset) or
      ``replace`` (U+FFFD).
    * ``hash_inputs``: record the sha256 of each input in the sidecar (computed while reading;
      ``False`` saves its CPU time and records ``null``).

    The output is byte-identical for any ``threads`` and ``chunk_size``. A run that is killed
    (Ctrl-C or kill -9) leaves ``out.bin.partial`` and ``out.progress.json``; calling again
    with the same tokenizer, inputs and options continues from the last committed chunk
    (an input edited since is noticed, and the run starts over). The final names appear
    only once the data is complete and fsynced. An output that would replace an input is
    refused; so is one that would replace a file that is not part of a shard (a ``.bin``
    without ferrolm's sidecar, a ``.json`` that is not one) unless ``force``.
    """
    tok = _load_tokenizer(tokenizer)
    patterns_given = [os.fspath(p) for p in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]
    paths = _input_files(patterns_given)
    field = jsonl_field or column
    _check_options(input_format, errors, threads)
    job = _Job(tok, out, parse_part(part), dtype, field, errors)
    _check_outputs_apart(paths, job.outputs())
    job.check_replaceable(paths, force)
    params = job.params(inputs=[_input_identity(p) for p in paths], input_format=input_format, hash=bool(hash_inputs))
    job.identities = {rec[0]: rec for rec in map(_inputs.identity, paths)}
    result = job.run(
        paths,
        params,
        progress=progress,
        input_format=None if input_format == "auto" else input_format,
        chunk_size=chunk_size,
        threads=threads,
        commit_interval=commit_interval,
        hash=bool(hash_inputs),
    )
    total = sum(os.path.getsize(p) for p in paths)
    extra = {"input_patterns": patterns_given} if patterns_given != paths else {}
    return job.finish(result, total, extra)


def encode_texts(
    tokenizer: Any,
    texts: Iterable[str],
    out: PathInput,
    *,
    threads: int | None = None,
    dtype: str = "auto",
    errors: str = "strict",
    chunk_size: int | None = None,
    progress: bool | None = True,
    hash_inputs: bool = True,
    force: bool = False,
) -> dict:
    """Encode an iterable of documents (an HF ``datasets`` column, a generator, a list of
    str) into the shard ``out``; return the sidecar.

    Each item is one document, encoded as ordinary text and followed by the eos id: the
    ``.bin`` equals what ``encode`` writes for the same documents in a JSON Lines or Parquet
    file, or in a text file separated by ``<|endoftext|>``. The sidecar records the
    documents' count, bytes and sha256 in place of an input file. An interrupted run
    starts over (an iterable cannot be replayed); the final names appear only once the
    data is complete. ``force``: as for ``encode``.
    """
    if isinstance(texts, (str, bytes, os.PathLike)):
        raise TypeError("encode_texts takes an iterable of documents (str); to encode files use encode()")
    tok = _load_tokenizer(tokenizer)
    _check_options("auto", errors, threads)
    job = _Job(tok, out, None, dtype, "text", errors)
    job.check_replaceable([], force)
    # Each call is a run of its own: a journal left by another never matches.
    params = job.params(inputs=[["iterable", os.urandom(8).hex()]], input_format="auto", hash=bool(hash_inputs))
    result = job.run(
        [""],
        params,
        reader=_inputs.DocReader(texts),
        progress=progress,
        input_format=None,
        chunk_size=chunk_size,
        threads=threads,
        commit_interval=DEFAULT_COMMIT_INTERVAL,
        hash=bool(hash_inputs),
    )
    return job.finish(result, 0, {})


def _input_files(specs: list[str]) -> list[str]:
    """The files that ``specs`` (paths, globs, folders) name, each checked to exist."""
    if not specs:
        raise ValueError("no input files given")
    paths = _inputs.expand(specs)
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"input file not found: {p}")
    return paths


def _check_options(input_format: str, errors: str, threads: int | None) -> None:
    if input_format not in ("auto", "text", "jsonl"):
        raise ValueError(f"input format must be auto, text or jsonl, got {input_format!r}")
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors must be strict or replace, got {errors!r}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")


def _input_identity(path: str) -> list:
    """What a resumed run must find unchanged: path, size, modification and change times
    (the change time moves on any write, even one that restores the modification time)."""
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _check_outputs_apart(inputs: list[str], outputs: list[Path]) -> None:
    """Refuse an output that is one of the inputs (the same file, through links too)."""
    ids = {}
    for p in inputs:
        st = os.stat(p)
        ids[(st.st_dev, st.st_ino)] = p
    for out in outputs:
        try:
            st = os.stat(out)
        except FileNotFoundError:
            continue
        victim = ids.get((st.st_dev, st.st_ino))
        if victim is not None:
            raise ValueError(f"the output {out} would replace the input {victim}; choose another --out")


class _Job:
    """One encode job's fixed parts: tokenizer, output names, dtype, eos, field."""

    def __init__(self, tok, out: PathInput, part: tuple[int, int] | None, dtype: str, field: str, errors: str):
        self.tok = tok
        self.part = part
        self.dtype = pick_dtype(dtype, tok.vocab_size)
        self.field = field
        self.errors = errors
        self.bin_path, self.json_path = output_paths(out, part)
        #: ``inputs.identity`` of each input file by absolute path, taken before the run.
        self.identities: dict[str, list] = {}
        eos_id = tok.eos_id
        self.eos = (EOT, int(eos_id)) if eos_id is not None else None
        # Text cuts inside long documents are exact only for the built-in patterns, and only
        # a special token with a space or a newline in it can straddle one.
        self.newline_cuts = patterns.name_of(tok.pattern) in _BUILTIN_PATTERNS and not any(
            "\n" in s or " " in s for s in tok.special_tokens
        )

    def outputs(self) -> list[Path]:
        b = self.bin_path
        return [b, self.json_path, Path(f"{b}.partial"), _journal_path(b)]

    def check_replaceable(self, inputs: list[str], force: bool) -> None:
        """Refuse, unless ``force``, to write over a file this job's outputs did not make: a
        ``.bin`` is a shard's when its sidecar is ferrolm's or a resume journal of ferrolm's
        is beside it (a run killed between the two renames)."""
        journal = _journal_path(self.bin_path)
        ours = _is_journal(journal) or _is_sidecar(self.json_path)
        checks = [
            (self.json_path, lambda p: None if _is_sidecar(p) else "exists and is not a shard sidecar of ferrolm's"),
            (
                self.bin_path,
                lambda p: None if ours else f"exists without a shard sidecar of ferrolm's ({self.json_path})",
            ),
            (journal, lambda p: None if _is_journal(p) else "exists and is not a resume journal of ferrolm's"),
        ]
        for path, judge in checks:
            check_out(path, inputs, force=force, judge=lambda p, j=judge: _choose_another(j(p)), example="corpus")

    def params(self, **inputs) -> str:
        """The job's identity: a journal is resumed only by a job with the same."""
        return json.dumps(
            {
                "tokenizer_fingerprint": self.tok.fingerprint,
                "dtype": self.dtype,
                "eos": list(self.eos) if self.eos else None,
                "part": list(self.part) if self.part else None,
                "jsonl_field": self.field,
                "errors": self.errors,
                "newline_cuts": self.newline_cuts,
                **inputs,
            },
            sort_keys=True,
        )

    def run(self, paths, params, *, reader=None, progress, input_format, chunk_size, threads, commit_interval, hash):
        """The core's encode into ``P.bin.partial``; returns its summary. ``reader`` hands
        the core the documents of an iterable; files (Parquet too) the core reads itself."""
        if self.eos is None:
            print(
                f"ferrolm encode: warning: the tokenizer has no {EOT} token; documents will not be separated",
                file=sys.stderr,
            )
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        bar = _Progress(progress, desc=f"encode {self.bin_path.name}")
        try:
            return _core.encode_shard(
                self.tok._core,
                paths,
                os.fspath(self.bin_path),
                dtype=self.dtype,
                eos=self.eos,
                jsonl_field=self.field,
                input_format=input_format,
                errors=self.errors,
                chunk_size=int(chunk_size or DEFAULT_CHUNK_SIZE),
                threads=int(threads or 0),
                part=self.part,
                newline_cuts=self.newline_cuts,
                params=params,
                commit_interval=float(commit_interval),
                progress=bar,
                hash=hash,
                docs=reader,
            )
        finally:
            bar.close()

    def finish(self, result: dict, total_input_bytes: int, extra: dict) -> dict:
        """Write the sidecar, move the data to its final name; the sidecar (with how the
        run started and the bytes of text it encoded) is returned."""
        sidecar = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype,
            "num_tokens": result["num_tokens"],
            "num_documents": result["num_documents"],
            "vocab_size": self.tok.vocab_size,
            "eos_id": self.tok.eos_id,
            "tokenizer_fingerprint": self.tok.fingerprint,
            "inputs": [self._record(r, result) for r in result["inputs"]],
            "part": list(self.part) if self.part else None,
            "byte_range": list(result["byte_range"]) if self.part else None,
            "total_input_bytes": total_input_bytes,
            **extra,
            "ferrolm_version": _core.version(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        _finalize(Path(result["partial_path"]), self.bin_path, self.json_path, sidecar)
        sidecar["resumed_tokens"] = result["resumed_tokens"]
        sidecar["restart_reason"] = result["restart_reason"]
        sidecar["text_bytes"] = result["text_bytes"]
        return sidecar

    def _record(self, r: dict, result: dict) -> dict:
        path = os.fspath(r["path"])
        if path in ("", "."):  # documents from an iterable
            return {"path": None, "documents": result["num_documents"], "sha256": r["sha256"]}
        rec = {"path": path, "bytes": r["bytes"], "sha256": r["sha256"]}
        known = self.identities.get(os.path.abspath(path))
        if known is not None:  # what a rerun compares (ferrolm.ray): the version of the file read
            rec["mtime_ns"], rec["sample_sha256"] = known[2], known[3]
        if self.part is not None:
            rec["range"] = list(r["range"])
        if r["uncompressed_bytes"] is not None:
            rec["uncompressed_bytes"] = r["uncompressed_bytes"]
        return rec


def _choose_another(found: str | None) -> str | None:
    return None if found is None else f"{found}: choose another --out"


def _is_sidecar(path: Path) -> bool:
    try:
        read_sidecar(path)
    except (OSError, ValueError):
        return False
    return True


def _is_journal(path: Path) -> bool:
    try:
        return read_json_object(path).get("format") == JOURNAL_FORMAT
    except (OSError, ValueError):
        return False


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


_PART_RE = re.compile(r"\.part-(\d+)-of-(\d+)$")


def manifest_path(out: PathInput) -> Path:
    """``P.manifest.json`` for the output prefix ``P`` (or its ``P.bin``)."""
    prefix = output_paths(out)[0].with_suffix("")
    return prefix.with_name(prefix.name + ".manifest.json")


def write_manifest(out: PathInput, record: dict) -> dict:
    """Write ``record`` (its ``parts``: the part prefixes, relative to the manifest's folder)
    as the manifest of ``out``, atomically, and return it as written; the manifest's
    presence says the set of parts is whole."""
    record = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, **record}
    with atomic_open(manifest_path(out)) as f:
        f.write((json.dumps(record, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return record


def manifest_parts(path: Path, record: dict) -> list[Path]:
    """The part prefixes that the manifest ``record`` read from ``path`` lists, in order."""
    parts = record.get("parts")
    if not isinstance(parts, list) or not parts or not all(isinstance(x, str) for x in parts):
        raise ShardError(f'{path}: a manifest needs a non-empty list of part prefixes in "parts"')
    return [path.parent / x for x in parts]


def find_parts(prefix: PathInput) -> list[Path]:
    """The prefixes of all ``prefix.part-I-of-N`` shards, in part order (every one of the N
    must be there); [] when there is none."""
    prefix = Path(prefix)
    parent = prefix.parent if str(prefix.parent) else Path(".")
    found: dict[int, set[int]] = {}
    if parent.is_dir():
        for f in parent.iterdir():
            name = f.name
            if name.startswith(prefix.name + ".part-") and name.endswith(".json"):
                m = _PART_RE.search(name[: -len(".json")])
                if m and name[: m.start()] == prefix.name:
                    found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if not found:
        return []
    if len(found) > 1:
        raise ShardError(
            f"{prefix}: parts of different splits are present ({', '.join(f'of-{n}' for n in sorted(found))})"
        )
    n, have = next(iter(found.items()))
    missing = sorted(set(range(n)) - have)
    if missing:
        shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ShardError(
            f"{prefix}: {len(missing)} of {n} parts missing (part {shown}): "
            f"{prefix.name}.part-{missing[0]}-of-{n}.json not found"
        )
    extra = sorted(i for i in have if i >= n)
    if extra:
        raise ShardError(f"{prefix}: part index {extra[0]} out of range for {n} parts")
    return [prefix.with_name(f"{prefix.name}.part-{i}-of-{n}") for i in range(n)]


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
            return resolve_shards(manifest_parts(p, record))
        return [p]
    if Path(s + ".json").exists():
        return [Path(s + ".json")]
    parts = find_parts(p)
    if not parts:
        raise FileNotFoundError(f"no shard found at {s} (looked for {s}.json and {s}.part-I-of-N.json)")
    return [q.with_name(q.name + ".json") for q in parts]


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

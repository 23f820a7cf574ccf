"""Encoding past one machine on Ray: the parts of a corpus encoded as Ray tasks.

    import ferrolm.ray
    ferrolm.ray.encode("tok/", ["owt_train.txt"], "data/owt", parts=64)
    # data/owt.part-I-of-64.bin/.json for I in 0..63, then data/owt.manifest.json

    ds = ray.data.read_parquet("s3://bucket/corpus/")        # or any ray.data.Dataset
    ferrolm.ray.encode("tok/", ds, "data/corpus", column="text")

Each part is the ``--part I/N`` of ``ferrolm encode`` (files) or one block of a Ray Dataset,
encoded by one Ray task into ``P.part-I-of-N.bin/.json``. Read in part order (the readers
take the prefix ``P`` as for any split, or the manifest), the parts hold exactly the ids of
encoding the whole input on one machine. The manifest ``P.manifest.json`` is written last,
atomically, once every part is complete: its presence says the set is whole.

A rerun skips the parts whose sidecar is complete and matches the job; a part whose worker
died is run again by Ray (``max_retries``), resuming from the part's journal, and its bytes
are those of a run that was never interrupted. Outputs go to a filesystem every node sees.

Ray is an optional dependency (``pip install "ferrolm[ray]"``). ``ray.init`` joins the
cluster that ``RAY_ADDRESS`` names, or starts a local one, unless Ray is already initialised.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ferrolm.bpe import shards
from ferrolm.bpe.shards import manifest_path

__all__ = ["DEFAULT_MAX_RETRIES", "RAY_EXTRA", "encode", "init", "manifest_path", "train_tokenizer"]

RAY_EXTRA = 'pip install "ferrolm[ray]"'
DEFAULT_MAX_RETRIES = 3


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError(f"Ray is not installed; {RAY_EXTRA}") from None
    return ray


def init() -> Any:
    """The ``ray`` module, connected: as this process already is, else to the cluster that
    ``RAY_ADDRESS`` names, else to a new local cluster."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, configure_logging=False, log_to_driver=False)
    return ray


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _part_record(json_path: Path) -> dict:
    sc = shards.read_sidecar(json_path)
    bin_path = json_path.with_suffix(".bin")
    return {
        "name": json_path.name[: -len(".json")],
        "num_tokens": sc["num_tokens"],
        "num_documents": sc["num_documents"],
        "sha256": _sha256_file(bin_path),
    }


# --------------------------------------------------------------------------- tasks


def _encode_file_part(tok, paths: list[str], out: str, part: tuple[int, int], options: dict) -> dict:
    shards.encode(tok, paths, out, part=part, progress=False, **options)
    return _part_record(shards.output_paths(out, part)[1])


def _encode_block(tok, block, column: str, part_prefix: str, options: dict) -> dict:
    if column not in block.column_names:
        raise ValueError(f"the dataset has no column {column!r} (its columns: {', '.join(block.column_names)})")
    shards.encode_texts(tok, block.column(column).to_pylist(), part_prefix, progress=False, **options)
    return _part_record(Path(part_prefix + ".json"))


# --------------------------------------------------------------------------- driver


def encode(
    tokenizer: Any,
    inputs: Any,
    out: shards.PathInput,
    *,
    parts: int | None = None,
    column: str = "text",
    dtype: str = "auto",
    input_format: str = "auto",
    errors: str = "strict",
    threads_per_part: int = 1,
    chunk_size: int | None = None,
    hash_inputs: bool = True,
    max_retries: int = DEFAULT_MAX_RETRIES,
    progress: bool = True,
    force: bool = False,
) -> dict:
    """Encode ``inputs`` into the parts of ``out`` as Ray tasks; return the manifest.

    * ``inputs``: files, globs and folders as for ``ferrolm.bpe.shards.encode`` (on a
      filesystem every node sees), or a ``ray.data.Dataset`` whose ``column`` holds one
      document per row (each block becomes a part, in the dataset's order; each document
      is followed by the eos id, as ``shards.encode_texts`` does).
    * ``parts``: for files, the number of parts N (default: the cluster's CPU count); each
      is ``--part I/N``. Not used for a Dataset, whose blocks are the parts.
    * ``threads_per_part``: the CPUs each task asks Ray for and the encoder's threads.
    * ``max_retries``: how often Ray reruns a part whose worker died.

    Other options are those of ``shards.encode``. Parts of a different N under the same
    prefix are refused (remove them, or rerun with their N).
    """
    ray = init()
    tok = shards._load_tokenizer(tokenizer)
    if threads_per_part < 1:
        raise ValueError(f"threads_per_part must be >= 1, got {threads_per_part}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    options = {
        "threads": threads_per_part,
        "dtype": dtype,
        "errors": errors,
        "chunk_size": chunk_size,
        "hash_inputs": hash_inputs,
        "force": force,
    }
    dtype_resolved = shards.pick_dtype(dtype, tok.vocab_size)
    tok_ref = ray.put(tok)
    task_options = {"num_cpus": threads_per_part, "max_retries": max_retries, "retry_exceptions": False}
    prefix = str(shards.output_paths(out)[0].with_suffix(""))
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)

    if _is_dataset(inputs):
        if parts is not None:
            raise ValueError("parts is set by the Dataset's blocks; repartition the Dataset to change it")
        n, pending, done, source = _submit_blocks(
            ray, inputs, tok, tok_ref, dtype_resolved, prefix, column, task_options, options
        )
    else:
        shards._check_options(input_format, errors, threads_per_part)
        options["input_format"] = input_format
        if parts is None:
            parts = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads_per_part)
        n, pending, done, source = _submit_file_parts(
            ray, inputs, int(parts), tok, tok_ref, dtype_resolved, prefix, task_options, options
        )

    skipped = len(done)
    if progress and skipped:
        print(f"ferrolm.ray: {skipped} of {n} parts already complete, skipped", file=sys.stderr)
    done.update(_gather(ray, pending, n, progress))
    records = [done[i] for i in range(n)]
    manifest = {
        "parts": [r["name"] for r in records],
        "part_records": records,
        "num_tokens": sum(r["num_tokens"] for r in records),
        "num_documents": sum(r["num_documents"] for r in records),
        "dtype": dtype_resolved,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer_fingerprint": tok.fingerprint,
        **source,
    }
    manifest = shards.write_manifest(prefix, manifest)
    manifest["skipped_parts"] = skipped
    return manifest


def _submit_blocks(ray, dataset, tok, tok_ref, dtype: str, prefix: str, column: str, task_options, options):
    """A task per block of ``dataset`` not encoded yet: ``(n, pending, done, source)``."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    blocks = dataset.to_arrow_refs()
    n = len(blocks)
    _refuse_other_splits(prefix, n)
    remote = ray.remote(_encode_block).options(**task_options)
    count_rows = ray.remote(_num_rows).options(num_cpus=0)
    rows = ray.get([count_rows.remote(b) for b in blocks])
    pending, done, listed = {}, {}, _listed_parts(prefix)
    for i, block in enumerate(blocks):
        part_prefix = f"{prefix}.part-{i}-of-{n}"
        if _complete_block(Path(part_prefix + ".json"), tok, dtype, rows[i]):
            done[i] = _part_record(Path(part_prefix + ".json"))
        else:
            opts = {**options, "force": options["force"] or Path(part_prefix).name in listed}
            pending[i] = remote.remote(tok_ref, block, column, part_prefix, opts)
    return n, pending, done, {"dataset_blocks": n, "column": column}


def _submit_file_parts(ray, inputs, n: int, tok, tok_ref, dtype: str, prefix: str, task_options, options):
    """A task per part ``I/n`` of the input files not encoded yet: ``(n, pending, done, source)``."""
    given = [os.fspath(p) for p in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]
    paths = [os.path.abspath(p) for p in shards._input_files(given)]
    if n < 1:
        raise ValueError(f"parts must be >= 1, got {n}")
    _refuse_other_splits(prefix, n)
    total = sum(os.path.getsize(p) for p in paths)
    remote = ray.remote(_encode_file_part).options(**task_options)
    pending, done, listed = {}, {}, _listed_parts(prefix)
    for i in range(n):
        json_path = shards.output_paths(prefix, (i, n))[1]
        if _complete_file_part(json_path, tok, dtype, (i, n), paths, total):
            done[i] = _part_record(json_path)
        else:
            opts = {**options, "force": options["force"] or json_path.with_suffix("").name in listed}
            pending[i] = remote.remote(tok_ref, paths, prefix, (i, n), opts)
    return n, pending, done, {"inputs": paths, "total_input_bytes": total}


def _listed_parts(prefix: str) -> set:
    """The parts the manifest of an earlier run at ``prefix`` lists: their files are this
    writer's to replace, even where a part's sidecar is gone."""
    try:
        manifest = shards.read_json_object(manifest_path(prefix))
    except (OSError, ValueError):
        return set()
    if manifest.get("format") != shards.MANIFEST_FORMAT or not isinstance(manifest.get("parts"), list):
        return set()
    return {name for name in manifest["parts"] if isinstance(name, str)}


def _gather(ray, pending: dict, n: int, progress: bool) -> dict[int, dict]:
    """Wait for the part tasks; a part that fails raises its own exception here."""
    index = {ref: i for i, ref in pending.items()}
    left = list(pending.values())
    out: dict[int, dict] = {}
    try:
        while left:
            ready, left = ray.wait(left, num_returns=1)
            for ref in ready:
                try:
                    out[index[ref]] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    raise (cause if isinstance(cause, Exception) else e) from None
                if progress:
                    print(f"ferrolm.ray: {n - len(left)} of {n} parts done", file=sys.stderr, flush=True)
    except BaseException:
        for ref in left:
            ray.cancel(ref)
        raise
    return out


def _num_rows(block) -> int:
    return block.num_rows


def _is_dataset(obj) -> bool:
    return type(obj).__module__.startswith("ray.data") and hasattr(obj, "to_arrow_refs")


_SPLIT_RE = re.compile(r"\.part-\d+-of-(\d+)\.(?:bin|json)$")


def _refuse_other_splits(prefix: str, n: int) -> None:
    p = Path(prefix)
    parent = p.parent if str(p.parent) else Path(".")
    others = set()
    for f in parent.iterdir():
        m = _SPLIT_RE.search(f.name)
        if m and f.name[: m.start()] == p.name and int(m.group(1)) != n:
            others.add(int(m.group(1)))
    if others:
        raise ValueError(
            f"{prefix}: parts of a {'/'.join(str(k) for k in sorted(others))}-way split are already there; "
            f"rerun with that number of parts, or remove them to encode {n} parts"
        )


def _sidecar_if_whole(json_path: Path, tok, dtype: str) -> dict | None:
    """The part's sidecar when its data is complete and made with this tokenizer and dtype."""
    try:
        sc = shards.read_sidecar(json_path)
    except (FileNotFoundError, shards.ShardError):
        return None
    bin_path = json_path.with_suffix(".bin")
    if sc.get("tokenizer_fingerprint") != tok.fingerprint or sc.get("dtype") != dtype:
        return None
    if not isinstance(sc.get("num_tokens"), int) or not bin_path.exists():
        return None
    if bin_path.stat().st_size != sc["num_tokens"] * (2 if dtype == "uint16" else 4):
        return None
    return sc


def _complete_file_part(json_path, tok, dtype, part, paths, total) -> bool:
    sc = _sidecar_if_whole(json_path, tok, dtype)
    return (
        sc is not None
        and sc.get("part") == list(part)
        and sc.get("total_input_bytes") == total
        and {r.get("path") for r in sc.get("inputs", [])} <= set(paths)
        and all(_same_version(r) for r in sc["inputs"])
    )


def _same_version(record: dict) -> bool:
    """Whether the input a part's sidecar records is still the version the part read (a
    sidecar from before identities were recorded never is)."""
    from ferrolm.bpe import inputs

    try:
        now = inputs.identity(record["path"])
    except (OSError, KeyError, TypeError):
        return False
    was = [now[0], record.get("bytes"), record.get("mtime_ns"), record.get("sample_sha256")]
    return inputs.identity_change(was, now) is None


def _complete_block(json_path, tok, dtype, rows: int) -> bool:
    sc = _sidecar_if_whole(json_path, tok, dtype)
    return sc is not None and sc.get("num_documents") == rows


# --------------------------------------------------------------------------- tokenizer training


def _count_part(paths: list[str], counts_out: str, special_tokens: list[str], part: tuple[int, int], options: dict):
    from ferrolm.bpe import counts

    counts.count(paths, counts_out, special_tokens, part=part, progress=False, **options)
    return counts_out


def _count_block(block, column: str, counts_out: str, special_tokens: list[str], part, source, options: dict):
    from ferrolm.bpe import counts

    if column not in block.column_names:
        raise ValueError(f"the dataset has no column {column!r} (its columns: {', '.join(block.column_names)})")
    counts.count_texts(
        block.column(column).to_pylist(), counts_out, special_tokens, part=part, source=source, **options
    )
    return counts_out


def train_tokenizer(
    inputs: Any,
    vocab_size: int,
    special_tokens: Sequence[str] = ("<|endoftext|>",),
    *,
    pattern: str = "gpt2",
    parts: int | None = None,
    work_dir: shards.PathInput,
    num_threads: int | None = None,
    threads_per_part: int = 1,
    column: str = "text",
    max_retries: int = DEFAULT_MAX_RETRIES,
    progress: bool = True,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]], list[str], str]:
    """Count the pre-tokens of ``parts`` parts of ``inputs`` as Ray tasks (into
    ``work_dir/part-I-of-N.counts``, on a filesystem every node sees), then learn the merges
    here from all of them. Returns ``(vocab, merges, special_tokens, pattern)``; the merges
    are those of one run over the whole input. A rerun skips the parts already counted."""
    from ferrolm._util import check_special_tokens
    from ferrolm.bpe import counts, patterns
    from ferrolm.bpe import inputs as _inputs

    ray = init()
    specials = check_special_tokens(special_tokens)
    resolved = patterns.resolve(pattern)
    task_options = {"num_cpus": threads_per_part, "max_retries": max_retries, "retry_exceptions": False}
    if _is_dataset(inputs):
        return _train_tokenizer_on_dataset(
            ray, inputs, vocab_size, specials, pattern, Path(work_dir), column, num_threads, task_options, progress
        )
    given = [os.fspath(p) for p in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]
    paths = [os.path.abspath(p) for p in _inputs.expand(given)]
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"input file not found: {p}")
    if parts is None:
        parts = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads_per_part)
    n = int(parts)
    if n < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    identity = [_inputs.identity(p) for p in paths]
    remote = ray.remote(_count_part).options(num_cpus=threads_per_part, max_retries=max_retries, retry_exceptions=False)
    options = {"pattern": pattern, "num_threads": threads_per_part, "column": column}
    files, pending = [], {}
    for i in range(n):
        out = work / f"part-{i}-of-{n}.counts"
        files.append(out)
        try:
            h = counts.read_header(out)
            whole = (h.get("part"), h.get("inputs"), h.get("pattern"), h.get("special_tokens")) == (
                [i, n],
                identity,
                resolved,
                specials,
            )
        except (OSError, ValueError):
            whole = False
        if not whole:
            pending[i] = remote.remote(paths, os.fspath(out), specials, (i, n), options)
    if progress and n - len(pending):
        print(f"ferrolm.ray: {n - len(pending)} of {n} parts already counted, skipped", file=sys.stderr)
    _gather(ray, pending, n, progress)
    vocab, merges = counts.train_from_counts(
        files, vocab_size, specials, pattern=resolved, num_threads=num_threads, progress=progress
    )
    return vocab, merges, specials, pattern


def _train_tokenizer_on_dataset(
    ray, ds, vocab_size, specials, pattern, work, column, num_threads, task_options, progress
):
    """Each block of the Dataset counted by a task (its documents each a text of its own),
    then the merges learned here."""
    from ferrolm.bpe import counts

    blocks = ds.to_arrow_refs()
    n = len(blocks)
    rows = ray.get([ray.remote(_num_rows).options(num_cpus=0).remote(b) for b in blocks])
    source = [["ray-dataset", column, rows]]
    work.mkdir(parents=True, exist_ok=True)
    remote = ray.remote(_count_block).options(**task_options)
    options = {"pattern": pattern, "num_threads": task_options["num_cpus"]}
    files = [work / f"part-{i}-of-{n}.counts" for i in range(n)]
    pending = {
        i: remote.remote(block, column, os.fspath(files[i]), specials, (i, n), source, options)
        for i, block in enumerate(blocks)
    }
    _gather(ray, pending, n, progress)
    vocab, merges = counts.train_from_counts(
        files, vocab_size, specials, pattern=pattern, num_threads=num_threads, progress=progress
    )
    return vocab, merges, specials, pattern

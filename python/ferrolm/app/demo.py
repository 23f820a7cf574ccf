"""`ferrolm demo`: the whole pipeline on real text, in a few minutes, on any machine.

    text ─▶ train a tokenizer ─▶ encode shards ─▶ train the cpu-small LM ─▶ samples + loss plot

Default data is text that every Python installation already has: the source of its own
standard library (``sysconfig.get_paths()["stdlib"]``: ``.py`` modules plus ``.txt`` /
``.rst`` files, without ``site-packages``, the test suites and the generated codec tables
of ``encodings/``). Nothing is downloaded and no corpus ships with ferrolm. ``data=[paths]`` uses the user's own files instead (plain
text whose documents are separated by ``<|endoftext|>``, as TinyStories and the CS336
OpenWebText sample; ``.gz`` / ``.zst`` too).

Every artefact lands under one directory::

    OUT/data/train.txt, val.txt, sources.tsv   the text used, split ~98/2 by a hash of each document
    OUT/tokenizer/                            vocab.json, merges.txt, tokenizer.json
    OUT/shards/train.bin/.json, val.bin/.json the encoded corpus (uint16)
    OUT/run/                                  config.toml, metrics.jsonl, checkpoints/, best.pt
    OUT/loss.png                              the loss curve
    OUT/samples.txt                           text sampled from the trained model
    OUT/report.md, OUT/demo.json              what was done, how long each stage took

From Python::

    from ferrolm.app.demo import run_demo
    result = run_demo("ferrolm-demo", minutes=5)
    print(result.plot, result.samples)

Each stage calls ferrolm's public Python API (``Tokenizer.train``, ``shards.encode``,
``train.train``, ``generate.generate``, ``plot.plot_run``), so an error names the stage
and the real cause.
"""

from __future__ import annotations

import contextlib
import datetime
import gzip
import hashlib
import io
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from ferrolm import __version__
from ferrolm._util import atomic_write_bytes
from ferrolm.bpe import shards
from ferrolm.bpe.tokenizer import Tokenizer
from ferrolm.lm.config import load_config

EOT = "<|endoftext|>"
#: Between two documents in the demo's text files.
SEPARATOR = "\n" + EOT + "\n"
#: The marker file that makes an output directory a demo directory (safe to replace).
MARKER = "demo.json"
MARKER_FORMAT = "ferrolm-demo"

DEFAULT_OUT = "ferrolm-demo"
#: Training minutes: with the other stages the whole demo stays under 10 minutes on 2 cores.
DEFAULT_MINUTES = 5.0
DEFAULT_VOCAB_SIZE = 4096
#: Text used at most (MB); more would not be seen in a few minutes of training anyway.
DEFAULT_MAX_MB = 24.0
VAL_PERCENT = 2
#: The validation text is at least this large (when there is enough text), so that its
#: loss is measured on more than a handful of windows.
MIN_VAL_BYTES = 64 * 1024
PRESET = "cpu-small"

DEFAULT_PROMPTS = ["import os\n", "def ", "class "]  # for the standard library's code
USER_PROMPTS = ["", "", ""]  # new documents, started from <|endoftext|>

#: Directory names under the stdlib that are not the standard library's own text (or, for
#: `encodings`, are mostly generated character-map tables rather than code or prose).
_EXCLUDED_DIRS = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib-dynload",
    "test",
    "tests",
    "idle_test",
    "ensurepip",
    "encodings",
}
_TEXT_SUFFIXES = (".py", ".txt", ".rst")
#: What this module creates inside the output directory (and replaces on a re-run).
_OWNED = ["data", "tokenizer", "shards", "run", "loss.png", "samples.txt", "report.md", MARKER]

PathLike = Union[str, "os.PathLike[str]"]


# ---------------------------------------------------------------------------------------
# Data: collect documents, split train / val by a hash of each document
# ---------------------------------------------------------------------------------------


@dataclass
class DataInfo:
    source: str  # "python-stdlib" or "user files"
    train_path: Path
    val_path: Path
    train_docs: int = 0
    val_docs: int = 0
    train_bytes: int = 0
    val_bytes: int = 0
    files: int = 0
    truncated: bool = False  # stopped at max_bytes
    notes: list = field(default_factory=list)


def stdlib_root() -> Path:
    """The directory of this Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Optional[PathLike] = None) -> list[tuple[str, Path]]:
    """(relative posix path, path) of the standard library's text files, sorted by relative path.

    ``.py``, ``.txt`` and ``.rst`` files; not site-packages, compiled-module directories,
    bundled wheels or the test suites (``test``/``tests`` directories, ``test_*.py``).
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(
            f"the Python standard library was not found at {root}; pass --data FILE to use your own text"
        )
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("config-"))
        for name in filenames:
            if name.endswith(_TEXT_SUFFIXES) and not name.startswith("test_"):
                p = Path(dirpath) / name
                out.append((p.relative_to(root).as_posix(), p))
    out.sort()
    if not out:
        raise FileNotFoundError(f"no .py files under {root}; pass --data FILE to use your own text")
    return out


def _in_val(key: bytes, val_percent: int) -> bool:
    return zlib.crc32(key) % 100 < val_percent


def _stdlib_documents(root: Optional[PathLike]) -> Iterator[tuple[str, str]]:
    """(name, text) per file, in a deterministic pseudo-random order (sha256 of the relative
    path), so that a size cap keeps a mix of the whole library rather than its first letters."""
    files = stdlib_files(root)
    files.sort(key=lambda rp: hashlib.sha256(rp[0].encode("utf-8")).digest())
    for rel, path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable, or a file in another encoding: not worth a demo's time
        text = text.strip()
        if text and EOT not in text:
            yield rel, text


def _open_text(path: Path):
    name = path.name
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="")
    if name.endswith((".zst", ".zstd")):
        try:
            import zstandard
        except ImportError:
            raise ValueError(
                f'{path}: reading .zst files needs the zstandard package: pip install "ferrolm[zstd]"'
            ) from None
        return io.TextIOWrapper(zstandard.open(path, "rb"), encoding="utf-8", errors="replace", newline="")
    return open(path, encoding="utf-8", errors="replace", newline="")


def _user_files(paths: Sequence[PathLike]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith((".txt", ".txt.gz", ".txt.zst")))
            if not found:
                raise FileNotFoundError(f"--data {p}: a directory without .txt files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"--data {p}: no such file or directory")
    return files


def _user_documents(files: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """Documents of the user's files, split at <|endoftext|>, streamed in 1 MB reads."""
    for path in files:
        with _open_text(path) as f:
            buf = ""
            while True:
                block = f.read(1 << 20)
                if not block:
                    break
                buf += block
                parts = buf.split(EOT)
                buf = parts.pop()
                for doc in parts:
                    doc = doc.strip()
                    if doc:
                        yield str(path), doc
            buf = buf.strip()
            if buf:
                yield str(path), buf


def prepare_data(
    out_dir: PathLike,
    data: Optional[Sequence[PathLike]] = None,
    *,
    max_bytes: Optional[int] = int(DEFAULT_MAX_MB * 1e6),
    val_percent: int = VAL_PERCENT,
    stdlib: Optional[PathLike] = None,
) -> DataInfo:
    """Write ``out_dir/train.txt`` and ``out_dir/val.txt`` (documents separated by
    ``"\\n<|endoftext|>\\n"``) and ``out_dir/sources.tsv``.

    ``data=None``: the Python standard library (``stdlib`` overrides its location, for tests).
    A document goes to validation when the crc32 of its text (of its relative path, for the
    standard library) falls in the first ``val_percent`` of 100 buckets: deterministic, and
    equal documents never land on both sides. The validation text is topped up to at least
    MIN_VAL_BYTES (or a tenth of the text, if smaller) with the last training documents.
    Stops after ``max_bytes`` of text (None or 0: all of it).
    """
    if not 0 < val_percent < 100:
        raise ValueError(f"val_percent must be in (0, 100), got {val_percent}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if data:
        files = _user_files(data)
        docs = _user_documents(files)
        info = DataInfo("user files", out_dir / "train.txt", out_dir / "val.txt", files=len(files))
    else:
        docs = _stdlib_documents(stdlib)
        info = DataInfo(
            f"Python {platform.python_version()} standard library", out_dir / "train.txt", out_dir / "val.txt"
        )
    # Standard-library documents are assigned to a side by their path, user documents by their text.
    train, val, sources, total = _split_documents(docs, info, max_bytes, val_percent, by_name=not data)
    if not data:
        info.files = len(sources)
    if total == 0:
        raise ValueError("no text found in " + (", ".join(map(str, data)) if data else "the standard library"))
    _top_up_validation(train, val, want=min(MIN_VAL_BYTES, total // 10))
    if not val or not train:
        train, val = _split_one_document(train + val, val_percent, total)
        info.notes.append("the text has a single document: the last lines are the validation text")
    for path, docs_ in ((info.train_path, train), (info.val_path, val)):
        _write_text(path, SEPARATOR.join(docs_) + SEPARATOR)
    info.train_docs, info.val_docs = len(train), len(val)
    info.train_bytes, info.val_bytes = info.train_path.stat().st_size, info.val_path.stat().st_size
    lines = ["source\tdocuments\tbytes"] + [f"{k}\t{v[0]}\t{v[1]}" for k, v in sources.items()]
    _write_text(out_dir / "sources.tsv", "\n".join(lines) + "\n")
    return info


def _split_documents(docs, info: DataInfo, max_bytes: Optional[int], val_percent: int, *, by_name: bool):
    """(train, val, sources: name -> [documents, bytes], total bytes) of `docs` within `max_bytes`."""
    train: list[str] = []
    val: list[str] = []
    sources: dict[str, list[int]] = {}
    total = 0
    for name, doc in docs:
        n = len(doc.encode("utf-8"))
        if max_bytes and total + n > max_bytes:
            info.truncated = True
            if total >= 0.95 * max_bytes:
                break
            continue  # too large for what is left of the budget; a smaller one may fit
        key = name.encode("utf-8") if by_name else doc.encode("utf-8")
        (val if _in_val(key, val_percent) else train).append(doc)
        s = sources.setdefault(name, [0, 0])
        s[0] += 1
        s[1] += n
        total += n
    return train, val, sources, total


def _top_up_validation(train: list[str], val: list[str], want: int) -> None:
    """Move training documents (from the end) to validation until it holds `want` bytes, but
    none so large that validation would take more than twice its share; in place."""
    val_bytes = sum(len(d.encode("utf-8")) for d in val)
    i = len(train) - 1
    while val_bytes < want and i >= 0 and len(train) > 1:
        n = len(train[i].encode("utf-8"))
        if val_bytes + n <= 2 * want:
            val.insert(0, train.pop(i))
            val_bytes += n
        i -= 1
    if not val and len(train) > 1:
        val.append(train.pop(min(range(len(train)), key=lambda k: len(train[k]))))


def _split_one_document(docs: list[str], val_percent: int, total: int) -> tuple[list[str], list[str]]:
    """One document in all: cut it at a line break near (100 - val_percent) %."""
    whole = "\n".join(docs)
    n_val = max(len(whole) * val_percent // 100, min(MIN_VAL_BYTES, len(whole) // 10))
    cut = whole.rfind("\n", 0, len(whole) - n_val) + 1 or len(whole) - n_val
    train, val = [whole[:cut].strip()], [whole[cut:].strip()]
    if not train[0] or not val[0]:
        raise ValueError(f"too little text to split into training and validation ({total} bytes)")
    return train, val


def _write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


# ---------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------


@dataclass
class DemoResult:
    out_dir: Path
    data: DataInfo
    tokenizer_dir: Path
    train_shard: Path
    val_shard: Path
    run_dir: Path
    checkpoint: Path
    plot: Optional[Path]
    samples_path: Path
    samples: list
    report_path: Path
    timings: dict  # stage -> seconds
    train_status: str = ""
    steps: int = 0
    first_val_loss: Optional[float] = None
    final_val_loss: Optional[float] = None
    best_val_loss: Optional[float] = None
    train_tokens: int = 0
    val_tokens: int = 0
    vocab_size: int = 0
    total_s: float = 0.0


def _prepare_out_dir(out: Path) -> None:
    """Create `out`; a previous demo there is replaced, anything else is left alone (error)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        marker = out / MARKER
        ok = False
        if marker.is_file():
            try:
                ok = json.loads(marker.read_text(encoding="utf-8")).get("format") == MARKER_FORMAT
            except (OSError, ValueError):
                ok = False
        if not ok:
            raise FileExistsError(
                f"--out {out} exists and is not a ferrolm demo directory (no {MARKER}); choose a new or empty directory"
            )
        for name in _OWNED:  # only what a demo wrote
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    _write_marker(out, {"format": MARKER_FORMAT, "status": "running", "started": _now()})


def _write_marker(out: Path, payload: dict) -> None:
    atomic_write_bytes(out / MARKER, (json.dumps(payload, indent=2, default=str) + "\n").encode("utf-8"))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def _fmt_s(s: float) -> str:
    return f"{s:.1f} s" if s < 90 else f"{int(s // 60)} min {s % 60:02.0f} s"


def run_demo(
    out: PathLike = DEFAULT_OUT,
    data: Optional[Sequence[PathLike]] = None,
    *,
    minutes: float = DEFAULT_MINUTES,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    device: str = "auto",
    max_mb: Optional[float] = DEFAULT_MAX_MB,
    overrides: Sequence[str] = (),
    prompts: Optional[Sequence[str]] = None,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_p: Optional[float] = 0.95,
    seed: int = 1337,
    progress: bool = True,
    log: Optional[Callable[[str], None]] = None,
    stdlib: Optional[PathLike] = None,
) -> DemoResult:
    """Run the whole pipeline into ``out``; return what was made (paths, timings, losses).

    ``minutes``: training time (the model trains until then, or the preset's max_steps);
    ``vocab_size``: of the tokenizer (the model's vocabulary follows it); ``device``: auto,
    cpu, cuda, mps ...; ``max_mb``: text used at most; ``overrides``: ``section.field=value``
    changes to the cpu-small training config, applied last; ``prompts``: what samples start
    from (default: code openings for the standard library, new documents for user data).
    """
    _check_args(minutes, vocab_size, max_mb, max_new_tokens)
    d = _Demo(Path(out), log or _print, progress)
    settings = dict(device=device, seed=seed, minutes=minutes, overrides=overrides)
    _train_config(d, vocab_size, **settings)  # a bad --set fails here, before any work
    if data:
        _user_files(data)  # and so do missing files
    _prepare_out_dir(d.out)

    info = _collect_text(d, data, max_mb, stdlib)
    tok = _train_tokenizer(d, info, vocab_size)
    n_train, n_val = _encode_shards(d, tok, info)
    summary, ckpt, vals = _train_model(d, _train_config(d, tok.vocab_size, **settings), n_train, n_val, minutes)
    if prompts is None:
        prompts = USER_PROMPTS if data else DEFAULT_PROMPTS
    dev, samples = _sample(d, ckpt, tok, prompts, max_new_tokens, temperature, top_p, device, seed)
    plot = _plot(d, info)

    result = DemoResult(
        out_dir=d.out,
        data=info,
        tokenizer_dir=d.tok_dir,
        train_shard=d.train_prefix,
        val_shard=d.val_prefix,
        run_dir=d.run_dir,
        checkpoint=ckpt,
        plot=plot,
        samples_path=d.out / "samples.txt",
        samples=samples,
        report_path=d.out / "report.md",
        timings=d.timings,
        train_status=summary.status,
        steps=summary.step,
        first_val_loss=vals[0] if vals else None,
        final_val_loss=summary.final_val_loss,
        best_val_loss=summary.best_val_loss,
        train_tokens=n_train,
        val_tokens=n_val,
        vocab_size=tok.vocab_size,
        total_s=time.perf_counter() - d.t_start,
    )
    _write_text(result.report_path, _report(result, minutes=minutes, device=str(dev)))
    _write_marker(d.out, _done_marker(result, device=str(dev), minutes=minutes))
    result.total_s = time.perf_counter() - d.t_start
    d.say("\n" + _summary_text(result))
    return result


N_STAGES = 6


@dataclass
class _Demo:
    """Where a demo's artefacts go, how it reports, and how long each stage took."""

    out: Path
    say: Callable[[str], None]
    progress: bool
    t_start: float = field(default_factory=time.perf_counter)
    timings: dict = field(default_factory=dict)  # stage -> seconds

    @property
    def tok_dir(self) -> Path:
        return self.out / "tokenizer"

    @property
    def train_prefix(self) -> Path:
        return self.out / "shards" / "train"

    @property
    def val_prefix(self) -> Path:
        return self.out / "shards" / "val"

    @property
    def run_dir(self) -> Path:
        return self.out / "run"

    @contextlib.contextmanager
    def stage(self, i: int, key: str, what: str) -> Iterator[None]:
        """Announce stage `i` and time it under `key`."""
        self.say(f"\n[{i}/{N_STAGES}] {what}  (elapsed {_fmt_s(time.perf_counter() - self.t_start)})")
        t0 = time.perf_counter()
        yield
        self.timings[key] = time.perf_counter() - t0


def _print(msg: str) -> None:
    print(msg, flush=True)


def _check_args(minutes: float, vocab_size: int, max_mb: Optional[float], max_new_tokens: int) -> None:
    if not (minutes > 0):
        raise ValueError(f"minutes must be > 0, got {minutes}")
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must be at least 258 (256 bytes, <|endoftext|> and a merge), got {vocab_size}")
    if max_mb is not None and max_mb < 0:
        raise ValueError(f"max_mb must be >= 0 (0: all the text), got {max_mb}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def _train_config(d: _Demo, model_vocab: int, *, device: str, seed: int, minutes: float, overrides: Sequence[str]):
    """The cpu-small preset pointed at the demo's files, trained for `minutes` (then `overrides`)."""
    base = [
        f"model.vocab_size={model_vocab}",
        f"data.train={json.dumps(str(d.train_prefix))}",
        f"data.val={json.dumps(str(d.val_prefix))}",
        f"data.tokenizer={json.dumps(str(d.tok_dir))}",
        f"run.out_dir={json.dumps(str(d.run_dir))}",
        f"run.device={json.dumps(device)}",
        f"run.seed={seed}",
        f"schedule.max_time_s={minutes * 60.0}",
        'schedule.schedule_by="time"',
        # Frequent, small evaluations: a curve with many points for ~5 % of the time.
        "run.eval_every=20",
        "run.eval_batches=4",
        "run.checkpoint_every=0",
        "run.keep_last=1",
        "run.compile=false",  # minutes of training: compiling would cost more than it saves
    ]
    if not d.progress:
        base.append("run.progress=false")
    return load_config(PRESET, base + list(overrides))


def _collect_text(d: _Demo, data: Optional[Sequence[PathLike]], max_mb: Optional[float], stdlib) -> DataInfo:
    """Stage 1: the training and validation text files."""
    where = "your files " + ", ".join(map(str, data)) if data else "this Python's standard library source (no download)"
    with d.stage(1, "data", "collecting text: " + where):
        max_bytes = int(max_mb * 1e6) if max_mb else None
        info = prepare_data(d.out / "data", data, max_bytes=max_bytes, stdlib=stdlib)
    capped = f" (capped at {max_mb:g} MB; --max-mb 0 uses all)" if info.truncated else ""
    d.say(
        f"  {info.source}: {info.files} files, {info.train_docs + info.val_docs:,} documents, "
        f"{_fmt_bytes(info.train_bytes + info.val_bytes)}{capped}"
    )
    d.say(
        f"  train {info.train_path} ({info.train_docs:,} docs, {_fmt_bytes(info.train_bytes)}); "
        f"val {info.val_path} ({info.val_docs:,} docs, {_fmt_bytes(info.val_bytes)})"
    )
    for note in info.notes:
        d.say(f"  note: {note}")
    return info


def _train_tokenizer(d: _Demo, info: DataInfo, vocab_size: int) -> Tokenizer:
    """Stage 2: a byte-level BPE tokenizer trained on the training text, saved."""
    with d.stage(
        2, "tokenizer", f"training a byte-level BPE tokenizer, vocab_size {vocab_size} (--vocab-size to change)"
    ):
        tok = Tokenizer.train(str(info.train_path), vocab_size, [EOT], progress=d.progress)
        tok.save(d.tok_dir)
    if tok.vocab_size < vocab_size:
        d.say(f"  the text ran out of pairs to merge: vocab_size {tok.vocab_size} instead of {vocab_size}")
    longest = sorted((b for b in tok.vocab.values() if b != EOT.encode()), key=lambda b: (-len(b), b))[:5]
    d.say(
        f"  saved {d.tok_dir} ({len(tok.merges):,} merges, fingerprint {tok.fingerprint[:12]}); longest tokens: "
        + ", ".join(repr(b.decode("utf-8", "replace")) for b in longest)
    )
    return tok


def _encode_shards(d: _Demo, tok: Tokenizer, info: DataInfo) -> tuple[int, int]:
    """Stage 3: the text as token shards; (training tokens, validation tokens)."""
    with d.stage(3, "encode", "encoding the text into uint16 token shards"):
        side_train = shards.encode(tok, [info.train_path], d.train_prefix, progress=d.progress)
        side_val = shards.encode(tok, [info.val_path], d.val_prefix, progress=d.progress)
    n_train, n_val = int(side_train["num_tokens"]), int(side_val["num_tokens"])
    d.say(
        f"  {d.train_prefix}.bin: {n_train:,} tokens ({info.train_bytes / max(n_train, 1):.2f} bytes/token); "
        f"{d.val_prefix}.bin: {n_val:,} tokens"
    )
    return n_train, n_val


def _train_model(d: _Demo, cfg, n_train: int, n_val: int, minutes: float):
    """Stage 4: the LM trained for the time budget; (summary, checkpoint, validation losses)."""
    from ferrolm.lm.train import train  # torch: imported when the demo gets here, not for `ferrolm --help`

    cfg.require_data()
    m = cfg.model
    for name, n in (("training", n_train), ("validation", n_val)):
        if n < m.context_length + 2:
            raise ValueError(
                f"the {name} shard has {n} tokens, fewer than the model's context_length + 2 = {m.context_length + 2}: "
                "give more text (--data), or a smaller model.context_length with --set"
            )
    shape = f"d_model {m.d_model}, {m.num_layers} layers, {m.num_heads} heads, context {m.context_length}"
    what = (
        f"training the {PRESET} Transformer LM for {minutes:g} min on {cfg.run.device} ({shape}, vocab {m.vocab_size})"
    )
    with d.stage(4, "train", what):
        summary = train(cfg)
    if summary.status == "interrupted":  # Ctrl-C: the run is saved; stop the demo here
        d.say(f"  {summary.message}")
        raise KeyboardInterrupt
    if summary.status not in ("done", "time"):
        raise RuntimeError(f"training stopped ({summary.status}): {summary.message}")
    vals = [r["val_loss"] for r in summary.records if r.get("val_loss") is not None]
    best = d.run_dir / "best.pt"
    ckpt = best if best.is_file() else summary.last_checkpoint
    if ckpt is None or not Path(ckpt).is_file():
        raise RuntimeError(f"training finished without a checkpoint in {d.run_dir}")
    if vals:
        d.say(f"  {summary.step} steps ({summary.status}); val loss {vals[0]:.3f} -> {vals[-1]:.3f}")
    else:
        d.say(f"  {summary.step} steps")
    d.say(f"  checkpoint {ckpt}")
    return summary, Path(ckpt), vals


def _sample(d: _Demo, ckpt: Path, tok, prompts, max_new_tokens, temperature, top_p, device: str, seed: int):
    """Stage 5: a sample per prompt, printed and written to samples.txt; (device, samples)."""
    import torch

    from ferrolm.lm.checkpoint import load_model
    from ferrolm.lm.generate import generate_text, resolve_device

    what = f"sampling {len(prompts)} texts of up to {max_new_tokens} tokens (temperature {temperature}, top-p {top_p})"
    with d.stage(5, "generate", what):
        dev = resolve_device(device)
        model, _, _ = load_model(ckpt, dev, tokenizer=tok)
        gen = torch.Generator(device=dev).manual_seed(seed)
        samples = []
        for i, prompt in enumerate(prompts):
            sampling = (max_new_tokens, temperature, None, top_p, tok.eos_id, gen)
            samples.append(prompt + generate_text(model, tok.encode(prompt), tok.token_bytes, *sampling)[0])
            d.say(f"--- sample {i + 1} (prompt {prompt!r}) ---\n{samples[-1]}")
        listing = (f"--- sample {i + 1} (prompt {p!r}) ---\n{s}\n\n" for i, (p, s) in enumerate(zip(prompts, samples)))
        _write_text(d.out / "samples.txt", "".join(listing))
    return dev, samples


def _plot(d: _Demo, info: DataInfo) -> Optional[Path]:
    """Stage 6: loss.png, or None (with how to get it) when matplotlib is missing."""
    with d.stage(6, "plot", "plotting the loss curve"):
        try:
            from ferrolm.app.plot import plot_run  # matplotlib: only for this stage
        except ImportError as e:  # everything else is done; say how to get the plot
            d.say(f"  no plot: {e} (pip install matplotlib, then: ferrolm plot {d.run_dir})")
            return None
        plot = plot_run(d.run_dir, x="step", out=d.out / "loss.png", title=f"ferrolm demo: {PRESET} on {info.source}")
        d.say(f"  {plot}")
    return plot


def _done_marker(r: DemoResult, *, device: str, minutes: float) -> dict:
    """demo.json once the demo is complete: what it made and how long it took."""
    info = r.data
    return {
        "format": MARKER_FORMAT,
        "status": "done",
        "finished": _now(),
        "total_s": round(r.total_s, 1),
        "timings_s": {k: round(v, 1) for k, v in r.timings.items()},
        "device": device,
        "minutes": minutes,
        "data": {
            "source": info.source,
            "train_bytes": info.train_bytes,
            "val_bytes": info.val_bytes,
            "train_docs": info.train_docs,
            "val_docs": info.val_docs,
            "truncated": info.truncated,
        },
        "vocab_size": r.vocab_size,
        "train_tokens": r.train_tokens,
        "val_tokens": r.val_tokens,
        "steps": r.steps,
        "first_val_loss": r.first_val_loss,
        "final_val_loss": r.final_val_loss,
        "best_val_loss": r.best_val_loss,
        "checkpoint": str(r.checkpoint),
    }


def _listing(out: Path) -> list[str]:
    rows = []
    for p in sorted(out.rglob("*")):
        if p.is_file():
            rel = p.relative_to(out).as_posix()
            rows.append(f"  {rel:<44s} {_fmt_bytes(p.stat().st_size):>9s}")
    return rows


def _report(r: DemoResult, *, minutes: float, device: str) -> str:
    t = r.timings
    lines = [
        "# ferrolm demo",
        "",
        f"- date: {_now()}; ferrolm {__version__}; Python {platform.python_version()}; torch {_torch_version()}; device {device}",
        f"- data: {r.data.source}: {r.data.train_docs:,} training documents ({_fmt_bytes(r.data.train_bytes)}), "
        f"{r.data.val_docs:,} validation documents ({_fmt_bytes(r.data.val_bytes)})",
        f"- tokenizer: byte-level BPE, vocab_size {r.vocab_size}: {r.tokenizer_dir}",
        f"- shards: {r.train_tokens:,} training tokens, {r.val_tokens:,} validation tokens",
        f"- model: {PRESET} preset, trained {minutes:g} min: {r.steps} steps, status {r.train_status}",
    ]
    if r.first_val_loss is not None and r.final_val_loss is not None:
        lines.append(
            f"- validation loss: {r.first_val_loss:.3f} at step 0 -> {r.final_val_loss:.3f} at step {r.steps} "
            f"(best {r.best_val_loss:.3f}), nats/token"
        )
    lines += ["", "| stage | time |", "|---|---:|"]
    names = {
        "data": "collect text",
        "tokenizer": "train tokenizer",
        "encode": "encode shards",
        "train": "train LM",
        "generate": "sample",
        "plot": "plot",
    }
    for k, v in t.items():
        lines.append(f"| {names.get(k, k)} | {_fmt_s(v)} |")
    lines.append(f"| **total** | **{_fmt_s(r.total_s)}** |")
    lines += ["", "## Samples", ""]
    if r.first_val_loss is not None and r.final_val_loss is not None:
        lines += [what_to_expect(r.first_val_loss, r.final_val_loss, r.vocab_size), ""]
    for s in r.samples:
        lines += ["```", s, "```", ""]
    if r.plot is not None:
        lines += ["## Loss", "", f"![loss curve]({r.plot.name})", ""]
    return "\n".join(lines)


def what_to_expect(first_val_loss: float, final_val_loss: float, vocab_size: int) -> str:
    """What the samples can show, read from the losses the run reached: a few CPU minutes
    give text with the look of the corpus, not its sense, and that is what the loss says."""
    return (
        f"what to expect: a model that knows nothing scores ln({vocab_size}) = {math.log(vocab_size):.2f} "
        f"nats/token; this one went from {first_val_loss:.2f} to {final_val_loss:.2f}, as unsure at each "
        f"token as a pick among {math.exp(min(final_val_loss, 700.0)):,.0f}. At such a loss samples take on "
        "the look of the text (for the standard library's code: indentation, keywords, names, comments) "
        "but not its sense; the loss keeps falling with longer training (--minutes N, or a GPU)."
    )


def _summary_text(r: DemoResult) -> str:
    t = r.timings
    lines = [
        "=" * 72,
        f"ferrolm demo finished in {_fmt_s(r.total_s)}: " + ", ".join(f"{k} {_fmt_s(v)}" for k, v in t.items()),
    ]
    if r.first_val_loss is not None and r.final_val_loss is not None:
        lines.append(
            f"validation loss {r.first_val_loss:.3f} -> {r.final_val_loss:.3f} nats/token after {r.steps} steps"
        )
        lines.append(what_to_expect(r.first_val_loss, r.final_val_loss, r.vocab_size))
    lines += [f"everything is in {r.out_dir.resolve()}:"] + _listing(r.out_dir)
    lines += [
        "",
        "next:",
        f"  ferrolm generate --checkpoint {r.checkpoint} --tokenizer {r.tokenizer_dir} --prompt 'def ' --max-new-tokens 200",
        "  ferrolm download tinystories && ferrolm demo --data data/TinyStoriesV2-GPT4-train.txt   (another corpus)",
    ]
    return "\n".join(lines)


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except Exception:  # pragma: no cover
        return "?"


__all__ = ["run_demo", "prepare_data", "stdlib_files", "stdlib_root", "DemoResult", "DataInfo"]


if __name__ == "__main__":  # pragma: no cover
    run_demo(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT)

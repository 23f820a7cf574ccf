"""Checkpoints: model + optimizer state, the iteration, and whatever the trainer adds.

A checkpoint is a ``torch.save`` of a dict with plain contents (tensors, numbers, strings,
lists, dicts), so ``torch.load(..., weights_only=True)`` reads it: RNG states are stored as
tensors and tuples of ints, never numpy objects. Writes to a path are atomic: the data goes
to a temporary file in the same directory, is fsynced, then renamed over the target, so a
crash or a full disk leaves the previous checkpoint intact. A sha256 over the contents is
stored with them and checked on load, so a flipped bit is an error, not a silent resume.

    save_checkpoint(model, optimizer, iteration, "ckpt.pt", config=cfg_dict)
    iteration = load_checkpoint("ckpt.pt", model, optimizer)

A trained model for inference, with its tokenizer, is ``load_model``: the one place that
reads checkpoints for generate, eval, export and serving. The weights a new run starts from
(``run.init_from``) are ``initial_weights``, read the same way.

    model, tokenizer, info = load_model("runs/x", device="cuda", dtype="bfloat16")
    config, state_dict, tokenizer = initial_weights("runs/x", chat_tokens=False)
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, Optional, Union

import numpy as np
import torch

from ferrolm._util import atomic_open
from ferrolm.bpe.tokenizer import Tokenizer
from ferrolm.lm.device import resolve_device
from ferrolm.lm.hf import is_hf_folder, read_hf_folder, safetensors_open
from ferrolm.lm.hf_remote import is_remote_folder, read_remote_folder
from ferrolm.lm.model import ModelConfig, TransformerLM

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "apply_checkpoint",
    "CheckpointError",
    "get_rng_state",
    "set_rng_state",
    "unwrap_model",
    "content_checksum",
    "load_model",
    "LoadedModel",
    "find_tokenizer",
    "resolve_checkpoint",
    "read_model_checkpoint",
    "initial_weights",
    "InitialWeights",
    "latest_checkpoint",
    "step_checkpoints",
    "CHECKPOINT_DIR",
    "BEST_FILE",
]

FORMAT = "ferrolm-checkpoint"
FORMAT_VERSION = 1

Target = Union[str, "os.PathLike[str]", BinaryIO]
PathLike = Union[str, "os.PathLike[str]"]

# A run folder (``ferrolm train``'s run.out_dir) holds these.
CHECKPOINT_DIR = "checkpoints"  # step checkpoints step_00000100.pt, ...
BEST_FILE = "best.pt"  # the lowest validation loss so far
_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint is unreadable, not a ferrolm checkpoint, or does not fit the model."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


# ---------------------------------------------------------------------------------------
# RNG state as weights_only-loadable values
# ---------------------------------------------------------------------------------------


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and CUDA) RNG states as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states saved by `get_rng_state` (missing entries are left alone)."""
    if "python" in state:
        random.setstate(_to_tuple(state["python"]))
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state(
            (s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
        )
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])


# ---------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------


def save_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, iteration: int, out: Target, **extra: Any
) -> None:
    """Save model and optimizer state and `iteration` to `out` (a path or a binary file).

    Keyword arguments are stored beside them (e.g. ``config=...``, ``rng=get_rng_state()``,
    ``tokenizer_fingerprint=...``); they must be plain values or tensors. A path is written
    atomically: on any failure (e.g. a full disk) the file at `out` is left as it was.
    """
    reserved = {"format", "format_version", "model", "optimizer", "iteration", "checksum"} & set(extra)
    if reserved:
        raise ValueError(f"save_checkpoint: {sorted(reserved)} are reserved checkpoint keys")
    obj = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "iteration": int(iteration),
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        **extra,
    }
    obj["checksum"] = content_checksum(obj)
    if isinstance(out, (str, os.PathLike)):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_open(out) as f:
                _torch_save(obj, f, Path(out))
        except OSError as e:  # a full disk may show only when the last bytes are flushed
            if e.errno in _DISK_FULL and "is full" not in str(e):
                raise _write_error(e, Path(out)) from None
            raise
    else:
        torch.save(obj, out)


_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class _WriteRecorder:
    """A binary file that remembers the OSError its write raised: torch.save reports a
    failed write (a full disk) only as a RuntimeError about its zip writer."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()

    def __getattr__(self, name: str) -> Any:  # seek, tell, ... of the file
        return getattr(self.f, name)


def _torch_save(obj: dict, f: BinaryIO, target: Path) -> None:
    recorder = _WriteRecorder(f)
    try:
        torch.save(obj, recorder)
    except RuntimeError:
        if recorder.error is None:
            raise
        raise _write_error(recorder.error, target) from None


def _write_error(err: OSError, target: Path) -> OSError:
    """An OSError that says why ``target`` could not be written, and where."""
    where = target.absolute().parent
    if err.errno in _DISK_FULL:
        try:
            free = f", {shutil.disk_usage(where).free / 2**20:,.1f} MB free there"
        except OSError:
            free = ""
        what = "No space left on device" if err.errno == errno.ENOSPC else "Disk quota exceeded"
        return OSError(err.errno, f"{what}: the disk of {where} is full{free} (writing {target.name})")
    return OSError(err.errno, f"{err.strerror or err} (writing {target})")


# ---------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------


def read_checkpoint(src: Target, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint dict at `src`, loaded with weights_only=True; CheckpointError if unusable."""
    name = os.fspath(src) if isinstance(src, (str, os.PathLike)) else getattr(src, "name", "<file object>")
    if isinstance(src, (str, os.PathLike)) and not Path(src).is_file():
        raise FileNotFoundError(f"checkpoint not found: {name}")
    try:
        obj = torch.load(src, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # zip errors, unpickling errors, EOF: all mean the file is unusable
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "weights_only" in first:  # torch's advice to unpickle arbitrary objects does not apply
            first = "it holds data that is not plain tensors and values"
        detail = f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__
        raise CheckpointError(f"checkpoint {name} is corrupt or not a ferrolm checkpoint ({detail})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f'{name} is not a ferrolm checkpoint (no "format": "{FORMAT}" entry)')
    if not isinstance(obj.get("format_version"), int) or obj["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{name}: checkpoint format_version {obj.get('format_version')!r} is newer than this ferrolm reads ({FORMAT_VERSION})"
        )
    if not isinstance(obj.get("model"), dict) or not isinstance(obj.get("iteration"), int):
        raise CheckpointError(f"{name}: checkpoint lacks model weights or iteration")
    if "checksum" in obj and obj["checksum"] != content_checksum(obj):  # older checkpoints have none
        raise CheckpointError(
            f"checkpoint {name} is corrupt: its contents do not match the checksum recorded when it was saved"
        )
    return obj


def content_checksum(obj: dict[str, Any]) -> str:
    """sha256 over a checkpoint's entries but "checksum": every tensor's dtype, shape and
    bytes and every plain value, in the dict's order (which torch.save keeps)."""
    h = hashlib.sha256()
    _hash_value(h, {k: v for k, v in obj.items() if k != "checksum"})
    return h.hexdigest()


def _hash_value(h, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(f"dict {len(value)}\n".encode())
        for k, v in value.items():
            _hash_value(h, k)
            _hash_value(h, v)
    elif isinstance(value, (list, tuple)):
        h.update(f"list {len(value)}\n".encode())
        for v in value:
            _hash_value(h, v)
    else:
        h.update(f"{type(value).__name__} {value!r}\n".encode())


def _describe_mismatch(saved: dict, expected: dict) -> str:
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in saved and isinstance(saved[k], torch.Tensor) and tuple(saved[k].shape) != tuple(expected[k].shape)
    ]
    parts = []
    if shapes:
        parts.append(f"{len(shapes)} shape mismatch(es), e.g. {'; '.join(shapes[:3])}")
    if missing:
        parts.append(f"{len(missing)} missing key(s), e.g. {', '.join(missing[:3])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s), e.g. {', '.join(unexpected[:3])}")
    return "; ".join(parts)


def apply_checkpoint(
    ckpt: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    name: str = "checkpoint",
) -> int:
    """Load a dict from `read_checkpoint` into `model` (and `optimizer`); return its iteration."""
    target = unwrap_model(model)
    expected = target.state_dict()
    mismatch = _describe_mismatch(ckpt["model"], expected)
    if mismatch:
        cfg = ckpt.get("config", {}).get("model") if isinstance(ckpt.get("config"), dict) else None
        hint = f" (it was saved with model config {cfg})" if cfg else ""
        raise CheckpointError(
            f"{name} does not fit this model, was it saved from a different config?{hint}: {mismatch}"
        )
    target.load_state_dict(ckpt["model"])
    if optimizer is not None:
        if ckpt.get("optimizer") is None:
            raise CheckpointError(f"{name} holds no optimizer state")
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{name}: optimizer state does not fit this optimizer ({e})") from None
    return int(ckpt["iteration"])


def load_checkpoint(src: Target, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore `model` (and `optimizer`, when given) from `src`; return the saved iteration.

    Loads with weights_only=True onto the CPU (load_state_dict copies onto the model's
    device). Raises FileNotFoundError when `src` is missing and CheckpointError when it is
    corrupt, not a ferrolm checkpoint, or saved from a model of another shape.
    """
    name = os.fspath(src) if isinstance(src, (str, os.PathLike)) else "checkpoint"
    return apply_checkpoint(read_checkpoint(src), model, optimizer, name=name)


def checkpoint_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, iteration: int, **extra: Any
) -> bytes:
    """The bytes `save_checkpoint` would write (handy for tests and in-memory copies)."""
    buf = io.BytesIO()
    save_checkpoint(model, optimizer, iteration, buf, **extra)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------
# A trained model for inference: load_model
# ---------------------------------------------------------------------------------------


def step_checkpoints(run_dir: PathLike) -> list[tuple[int, Path]]:
    """(step, path) of a run folder's step checkpoints, oldest first."""
    d = Path(run_dir) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _STEP_FILE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: PathLike) -> Optional[Path]:
    """The newest step checkpoint of a run folder, or None."""
    ckpts = step_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def resolve_checkpoint(path: PathLike) -> Path:
    """The file or folder ``load_model`` reads for ``path``: a run folder gives its best.pt,
    else its newest step checkpoint; an exported Hugging Face folder, a checkpoint file or a
    ``.safetensors`` weights file is itself. FileNotFoundError when there is nothing to load."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {os.fspath(path)}")
    if not p.is_dir():
        raise FileNotFoundError(f"{os.fspath(path)} is neither a checkpoint file nor a folder")
    if is_hf_folder(p):
        return p
    if (p / BEST_FILE).is_file():
        return p / BEST_FILE
    newest = latest_checkpoint(p)
    if newest is None:
        raise FileNotFoundError(
            f"{os.fspath(path)}: no checkpoint in this folder (a run folder holds {BEST_FILE} or "
            f"{CHECKPOINT_DIR}/step_N.pt; an exported model holds config.json and model.safetensors)"
        )
    return newest


def _read_safetensors(path: Path) -> dict[str, Any]:
    """A checkpoint dict from a ``ferrolm export --format safetensors`` weights file."""
    safe_open = safetensors_open()
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise CheckpointError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    if "ferrolm_model_config" not in meta:
        raise CheckpointError(f"{path}: not a ferrolm weights file (no ferrolm_model_config metadata)")
    cfg = json.loads(meta["ferrolm_model_config"])
    if cfg.get("tie_embeddings") and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["token_embeddings.weight"]
    return {
        "config": {"model": cfg},
        "model": sd,
        "iteration": None,
        "tokenizer_fingerprint": meta.get("tokenizer_fingerprint"),
        "tokenizer_dir": meta.get("tokenizer_dir"),
    }


def _read_hf_folder(path: Path) -> dict[str, Any]:
    """A checkpoint dict from an exported Hugging Face folder (``ferrolm.lm.hf.read_hf_folder``;
    ``ferrolm.lm.hf_remote.read_remote_folder`` for one with ferrolm's modeling file)."""
    try:
        return read_remote_folder(path) if is_remote_folder(path) else read_hf_folder(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def read_model_checkpoint(path: PathLike) -> tuple[dict[str, Any], Path]:
    """(checkpoint dict, the file or folder read) for anything ``load_model`` accepts."""
    source = resolve_checkpoint(path)
    if source.is_dir():
        return _read_hf_folder(source), source
    if source.suffix == ".safetensors":
        return _read_safetensors(source), source
    return read_checkpoint(source), source


def _model_config(ckpt: dict[str, Any], name: str) -> dict[str, Any]:
    cfg = ckpt.get("config")
    if isinstance(cfg, dict) and isinstance(cfg.get("model"), dict):
        cfg = cfg["model"]  # a training config: {"model": {...}, "optimizer": {...}, ...}
    if not isinstance(cfg, dict) or "vocab_size" not in cfg:
        raise CheckpointError(
            f"{name} stores no model config (needed to build the model); was it saved by `ferrolm train`?"
        )
    return dict(cfg)


def _run_folder(source: Path) -> Path:
    """The run folder of RUN/best.pt or RUN/checkpoints/step_N.pt (a folder is its own)."""
    if source.is_dir():
        return source
    parent = source.parent
    return parent.parent if parent.name == CHECKPOINT_DIR else parent


def _tokenizer_candidates(ckpt: dict[str, Any], source: Path) -> list[Path]:
    """Where the tokenizer of a checkpoint may be, in the order they are tried."""
    run = _run_folder(source)
    found: list[Path] = []
    if is_hf_folder(run):
        found.append(run)  # an exported folder carries its tokenizer
    recorded = ckpt.get("tokenizer_dir")
    if isinstance(recorded, str) and recorded:
        found.append(Path(recorded))
    from_run = ckpt.get("tokenizer_dir_from_run")
    if isinstance(from_run, str) and from_run:
        found.append(run / from_run)
    cfg = ckpt.get("config")
    data = cfg.get("data") if isinstance(cfg, dict) else None
    written = data.get("tokenizer") if isinstance(data, dict) else None
    # data.tokenizer may be a 64-hex fingerprint rather than a folder
    if isinstance(written, str) and written and not re.fullmatch(r"[0-9a-fA-F]{64}", written):
        found.append(Path(written))  # as written: relative to where training ran, or absolute
        if not Path(written).is_absolute():
            found += [run / written, source.parent / written]
    unique: dict[Path, Path] = {}  # one try per folder, however it was named
    for p in found:
        unique.setdefault(p.absolute(), p)
    return list(unique.values())


def find_tokenizer(ckpt: dict[str, Any], source: PathLike, tokenizer: Any = None) -> Any:
    """The tokenizer of the checkpoint dict ``ckpt`` read from ``source``, or None when
    neither it nor ``tokenizer`` names one.

    ``tokenizer`` (a Tokenizer or its folder), when given, is the one; else the places the
    checkpoint names are tried in order: the tokenizer files of an exported folder, the
    absolute path recorded at training, that path relative to the run folder, and the
    run config's ``data.tokenizer`` as written, relative to the run folder and to the
    checkpoint's folder. The first that exists and whose fingerprint is the one recorded
    in the checkpoint wins; a CheckpointError naming what was tried when none does.
    """
    return _find_tokenizer(ckpt, Path(source), tokenizer)[0]


def _find_tokenizer(ckpt: dict[str, Any], source: Path, tokenizer: Any) -> tuple[Any, Optional[Path]]:
    """(tokenizer or None, the folder it was loaded from or None): see ``find_tokenizer``."""

    want = ckpt.get("tokenizer_fingerprint")
    if tokenizer is not None:
        given = isinstance(tokenizer, (str, os.PathLike))
        tok = Tokenizer.load(tokenizer) if given else tokenizer
        have = getattr(tok, "fingerprint", None)
        if want is not None and have != want:
            raise CheckpointError(
                f"tokenizer and checkpoint do not belong together: {source} was trained with tokenizer "
                f"fingerprint {str(want)[:16]}..., the tokenizer given has {str(have)[:16]}..."
            )
        return tok, (Path(tokenizer) if given else None)
    candidates = _tokenizer_candidates(ckpt, source)
    if not candidates:
        return None, None
    tried = []
    for path in candidates:
        if not path.is_dir():
            tried.append(f"{path} (not there)")
            continue
        try:
            tok = Tokenizer.load(path)
        except (OSError, ValueError) as e:
            tried.append(f"{path} (unreadable: {e})")
            continue
        if want is None or tok.fingerprint == want:
            return tok, path
        tried.append(f"{path} (another tokenizer: fingerprint {tok.fingerprint[:16]}...)")
    expected = f" (fingerprint {str(want)[:16]}...)" if want else ""
    raise CheckpointError(
        f"{source}: the tokenizer it was trained with{expected} is not found; tried {'; '.join(tried)}. "
        "Give its folder (--tokenizer DIR on the command line)"
    )


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoadedModel(NamedTuple):
    """What ``load_model`` returns; unpacks as ``model, tokenizer, info``."""

    model: torch.nn.Module  # a TransformerLM in eval mode
    tokenizer: Any  # a ferrolm Tokenizer, or None
    info: dict[str, Any]  # the checkpoint's entries but its tensors, and "source"/"tokenizer_source"


def load_model(
    path: PathLike,
    device: Union[str, torch.device] = "cpu",
    dtype: Union[str, torch.dtype, None] = None,
    *,
    tokenizer: Any = None,
    require_tokenizer: bool = False,
) -> LoadedModel:
    """A trained model, ready for inference, and its tokenizer: ``(model, tokenizer, info)``.

    ``path``: a run folder of ``ferrolm train`` (its best.pt, else its newest step
    checkpoint), a checkpoint file, a ``.safetensors`` weights file or an exported Hugging
    Face folder of ``ferrolm export``. ``device``: "cpu", "cuda", "cuda:1", "mps" or "auto".
    ``dtype``: "float32", "bfloat16", "float16" or a torch dtype (default: as saved).
    ``tokenizer``: a Tokenizer or its folder (checked against the fingerprint recorded at
    training); by default it is found as ``find_tokenizer`` says, None when the checkpoint
    names none (then an error with ``require_tokenizer``); ``False`` skips it.
    ``info``: iteration, config, tokenizer_fingerprint, ... as saved (no tensors), with
    "source" (the file or folder read) and "tokenizer_source".
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    dev = resolve_device(device) if isinstance(device, str) else device
    ckpt, source = read_model_checkpoint(path)
    name = os.fspath(source)
    tok, tok_source = (None, None) if tokenizer is False else _find_tokenizer(ckpt, source, tokenizer)
    if tok is None and require_tokenizer:
        raise CheckpointError(f"{name}: names no tokenizer folder; give it (--tokenizer DIR on the command line)")
    cfg = _model_config(ckpt, name)
    try:
        model = TransformerLM.from_config(ModelConfig.from_dict(cfg))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{name}: its model config {cfg} does not fit this ferrolm's TransformerLM ({e})"
        ) from None
    apply_checkpoint({**ckpt, "iteration": ckpt.get("iteration") or 0}, model, None, name=name)
    if tok is not None and int(tok.vocab_size) > model.config.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {tok.vocab_size} tokens but the model in {name} only {model.config.vocab_size}: "
            "they do not belong together"
        )
    model.to(device=dev, dtype=dtype)
    model.eval()
    info = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "rng", "sampler_states")}
    info["source"] = source
    info["tokenizer_source"] = tok_source
    return LoadedModel(model, tok, info)


class InitialWeights(NamedTuple):
    """What ``initial_weights`` returns; unpacks as ``config, state_dict, tokenizer``."""

    config: ModelConfig  # the source's model (its vocabulary grown by the chat tokens, when added)
    state_dict: dict[str, torch.Tensor]  # TransformerLM.state_dict() keys
    tokenizer: Any  # the source's tokenizer (with the chat tokens, when added)


def initial_weights(source: PathLike, *, chat_tokens: bool = False) -> InitialWeights:
    """The model config, weights and tokenizer a new run starts from: anything ``load_model``
    reads (a run folder, a checkpoint or ``.safetensors`` file, an exported Hugging Face
    folder) or a Llama, Qwen3 or transformers' nanochat folder saved by transformers, whose
    ``tokenizer.json`` loads through ``Tokenizer.from_hf`` when there is no ferrolm record.

    ``chat_tokens=True`` adds the chat tokens to the tokenizer (``chat.add_chat_tokens``) and,
    when they do not fit the model's vocabulary, grows its token tables (``chat.grow_vocab``):
    the logits of every old id stay as they were. Nothing changes when they are there.
    FileNotFoundError for a missing source; CheckpointError naming what is unreadable or
    does not belong together (no tokenizer, a tokenizer larger than the model).
    """
    from ferrolm.lm.chat import add_chat_tokens, grow_vocab

    ckpt, where = read_model_checkpoint(source)
    name = os.fspath(where)
    try:
        cfg = ModelConfig.from_dict(_model_config(ckpt, name))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{name}: its model config does not fit this ferrolm's TransformerLM ({e})") from None
    tok = find_tokenizer(ckpt, where)
    if tok is None:
        raise CheckpointError(f"{name}: names no tokenizer folder, and a new run needs the tokenizer of its weights")
    if int(tok.vocab_size) > cfg.vocab_size:
        raise CheckpointError(
            f"{name}: its tokenizer has {tok.vocab_size} tokens but the model only {cfg.vocab_size}: "
            "they do not belong together"
        )
    state = ckpt["model"]
    if chat_tokens:
        try:
            tok = add_chat_tokens(tok)
        except ValueError as e:
            raise CheckpointError(f"{name}: {e}") from None
        if tok.vocab_size > cfg.vocab_size:
            state = grow_vocab(state, cfg.vocab_size, tok.vocab_size)
            cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)
    return InitialWeights(cfg, dict(state), tok)

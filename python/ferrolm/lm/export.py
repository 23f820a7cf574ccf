"""Export a checkpoint as a Hugging Face model folder that transformers loads with no
ferrolm code: config.json (LlamaForCausalLM, or Qwen3ForCausalLM for a model with
QK-norm), model.safetensors, generation_config.json and the tokenizer files
(tokenizer.json, tokenizer_config.json, ... and ferrolm's own).

    export_hf("runs/x/best.pt", "hf_model")          # tokenizer: the run's data.tokenizer
    AutoModelForCausalLM.from_pretrained("hf_model"); AutoTokenizer.from_pretrained("hf_model")

ferrolm's default architecture is Llama's (RMSNorm, pre-norm, RoPE, SwiGLU, no biases);
grouped-query attention maps to num_key_value_heads, and QK-norm to Qwen3's q_norm/k_norm.
HF rotates halves of each head where ferrolm rotates pairs, so q/k rows are permuted
(``ferrolm.lm.hf.to_hf_state_dict``) and the logits are equal; config.json is
``ferrolm.lm.hf.hf_config``. A model with settings no native architecture has
(``ferrolm.lm.hf.hf_architecture`` names them) is written with ferrolm's own modeling file,
loaded with ``trust_remote_code=True`` (``ferrolm.lm.hf_remote``), or refused with
``remote_code=False``. The folder is written whole or not at all.

``export_safetensors`` writes the weights alone, under ferrolm's own names, with the model
config in the file's metadata: a checkpoint that needs no pickle reader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Union

import torch

from ferrolm._util import atomic_write_bytes, atomic_write_dir, check_out
from ferrolm.bpe import files as tf
from ferrolm.lm.checkpoint import load_model
from ferrolm.lm.hf import hf_architecture, hf_config, hf_special_ids, to_hf_state_dict
from ferrolm.lm.hf_remote import MODELING_FILE, modeling_source, remote_config, remote_state_dict

__all__ = ["export_hf", "export_safetensors", "MODEL_FILES"]

MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PathLike = Union[str, "os.PathLike[str]"]


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata={"format": "pt", **metadata})


# config.json keys that may differ between two exports of one model.
_EXPORT_CHOICES = ("torch_dtype", "dtype")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(tf.read_file_bytes(path, path.name))
    except (OSError, ValueError):
        return None


def _same_model_export(out: Path, config: dict, fingerprint: str) -> bool:
    """Whether ``out`` holds an export of the model ``config`` describes with the tokenizer
    of ``fingerprint``: its config.json equal but for the dtype, its tokenizer record's
    fingerprint equal."""
    found = _read_json(out / "config.json")
    record = _read_json(out / tf.RECORD_FILE)
    if not isinstance(found, dict) or not isinstance(record, dict):
        return False
    drop = set(_EXPORT_CHOICES)
    same_config = {k: v for k, v in found.items() if k not in drop} == {
        k: v for k, v in json.loads(json.dumps(config)).items() if k not in drop
    }
    return same_config and record.get("fingerprint") == fingerprint


def _folder_contents(out: Path, config: dict, fingerprint: str) -> str | None:
    """None when the folder ``out`` may be replaced (empty, or an earlier export of the same
    model); else what it holds."""
    names = sorted(os.listdir(out))
    if not names or _same_model_export(out, config, fingerprint):
        return None
    if "config.json" in names and tf.RECORD_FILE in names:
        what = "an export of another model or tokenizer"
    elif tf.RECORD_FILE in names or tf.HF_FILE in names:
        what = "a tokenizer folder"
    else:
        what = "other files"
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"is not empty: it holds {what} ({shown}); export into a new or empty folder"


def _hf_model(model: Any, tok: Any, dtype: str, remote_code: bool) -> tuple[dict, dict, dict[str, bytes]]:
    """(config.json, weights, other files) of the export: a native architecture when one
    computes the model; else ferrolm's modeling file (``ferrolm.lm.hf_remote``), or, without
    ``remote_code``, the ValueError naming the settings no native architecture has."""
    try:
        hf_architecture(model.config)
    except ValueError as e:
        if not remote_code:
            raise ValueError(f"{e} without remote code (loading it would need trust_remote_code=True)") from None
        config = remote_config(model.config, tok, dtype)
        return config, remote_state_dict(model), {MODELING_FILE: modeling_source()}
    return hf_config(model.config, tok, dtype), to_hf_state_dict(model), {}


def export_hf(
    checkpoint: PathLike,
    out: PathLike,
    tokenizer: Any = None,
    *,
    dtype: str = "float32",
    force: bool = False,
    remote_code: bool = True,
) -> Path:
    """Write the HF folder ``out`` for ``checkpoint`` (see the module docstring); return it.

    ``checkpoint``: anything ``ferrolm.lm.checkpoint.load_model`` reads. ``tokenizer``: a
    Tokenizer or its folder (default: the one the checkpoint names);
    its fingerprint must be the checkpoint's. ``dtype``: float32, bfloat16 or float16.
    A non-empty ``out`` is replaced only when it is an earlier export of the same model
    (config.json equal but for the dtype, the same tokenizer fingerprint), or with
    ``force``; a folder holding files an export does not write is never replaced.
    A model that no native architecture computes is written with ferrolm's modeling file
    (load it with ``trust_remote_code=True``); ``remote_code=False`` refuses it instead.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model, tok, info = load_model(checkpoint, "cpu", tokenizer=tokenizer, require_tokenizer=True)
    cfg = model.config
    config, weights, extra = _hf_model(model, tok, dtype, remote_code)
    check_out(
        out,
        export_inputs(checkpoint, tokenizer, info),
        force=force,
        judge=lambda p: _folder_contents(p, config, tok.fingerprint),
        folder=True,
        example="hf_model",
    )
    weights = {k: v.to(DTYPES[dtype]) for k, v in weights.items()}
    files = {
        **extra,
        "config.json": _json(config),
        "generation_config.json": _json({**hf_special_ids(tok), "do_sample": True, "temperature": 1.0, "top_k": 0}),
        "model.safetensors": _safetensors_bytes(weights, {}),
    }
    special_ids = [(s, tok.special_token_ids[s]) for s in tok.special_tokens]
    files.update(
        tf.directory_files(tok.vocab, tok.merges, special_ids, tok.pattern, tok.fingerprint, cfg.context_length)
    )
    return atomic_write_dir(out, files, owned=MODEL_FILES + (MODELING_FILE,) + tf.TOKENIZER_FILES)


def export_safetensors(checkpoint: PathLike, out: PathLike, *, force: bool = False) -> Path:
    """Write the model weights of ``checkpoint`` to the safetensors file ``out`` under
    ferrolm's names; the metadata holds the model config, the tokenizer fingerprint and
    the tokenizer's folder as recorded at training
    (``ferrolm.lm.checkpoint.load_model`` reads such a file). An existing ``out`` is replaced
    only when ferrolm wrote it (its metadata says so) or with ``force``; never when it is
    the checkpoint read."""
    model, _, info = load_model(checkpoint, "cpu", tokenizer=False)
    out = check_out(
        out, export_inputs(checkpoint, None, info), force=force, judge=_judge_safetensors, example="model.safetensors"
    )
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight")  # the same tensor as the embedding; safetensors stores it once
    meta = {"ferrolm_model_config": json.dumps(model.config.to_dict())}
    for key in ("tokenizer_fingerprint", "tokenizer_dir"):  # what load_model finds the tokenizer by
        if info.get(key):
            meta[key] = str(info[key])
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, _safetensors_bytes(sd, meta))
    return out


def export_inputs(checkpoint: PathLike, tokenizer: Any, info: dict) -> list:
    """What an export reads, as given and as found: never to be written over."""
    given_tokenizer = tokenizer if isinstance(tokenizer, (str, os.PathLike)) else None
    return [checkpoint, info.get("source"), info.get("tokenizer_source"), given_tokenizer]


def _is_ferrolm_safetensors(path: Path) -> bool:
    """Whether ``path`` is a safetensors file whose metadata holds ferrolm's model config."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = int.from_bytes(head, "little")
            if len(head) < 8 or size > 100 << 20:  # safetensors caps its header at 100 MB
                return False
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and "ferrolm_model_config" in meta


def _judge_safetensors(path: Path) -> str | None:
    if _is_ferrolm_safetensors(path):
        return None
    return "exists and is not a safetensors file written by ferrolm; choose a new file name"

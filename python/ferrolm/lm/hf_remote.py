"""Hugging Face export through remote code: for a model that no architecture of
transformers computes (value embeddings, x0 mixing, ReLU^2, soft-capped logits, ...), a
folder whose config.json names ferrolm's own modeling file in ``auto_map``, so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

builds ferrolm's Transformer with nothing but torch and transformers. The modeling file is
``hf_modeling/modeling_ferrolm.py``, shipped with the package and copied as it is.

    remote_config(cfg, tokenizer)   config.json: ferrolm's model config under its own names
    remote_state_dict(model)        the weights as ferrolm saves them (a tied matrix once)
    is_remote_folder(path)          whether config.json names ferrolm's modeling file
    read_remote_folder(path)        a checkpoint dict from such a folder (``load_model``)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ferrolm.lm.config import ModelConfig
from ferrolm.lm.hf import folder_checkpoint, hf_special_ids, safetensors_open

__all__ = [
    "MODELING_FILE",
    "REMOTE_MODEL_TYPE",
    "modeling_source",
    "remote_config",
    "remote_state_dict",
    "is_remote_folder",
    "read_remote_folder",
]

MODELING_FILE = "modeling_ferrolm.py"
REMOTE_MODEL_TYPE = "ferrolm"
_AUTO_MAP = {
    "AutoConfig": "modeling_ferrolm.FerroLMConfig",
    "AutoModelForCausalLM": "modeling_ferrolm.FerroLMForCausalLM",
}


def modeling_source() -> bytes:
    """The modeling file's bytes, as shipped in the package."""
    return (Path(__file__).parent / "hf_modeling" / MODELING_FILE).read_bytes()


def remote_config(cfg: ModelConfig, tokenizer: Any, dtype: str = "float32") -> dict:
    """config.json for ferrolm's modeling file: ``auto_map``, every field of ``cfg`` under its
    own name, the special token ids and the dtype. The head is tied by the model itself, so
    transformers' ``tie_word_embeddings`` stays off."""
    return {
        "architectures": ["FerroLMForCausalLM"],
        "model_type": REMOTE_MODEL_TYPE,
        "auto_map": dict(_AUTO_MAP),
        **cfg.to_dict(),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,  # transformers 4; 5 reads "dtype"
        "dtype": dtype,
        "use_cache": True,
        **hf_special_ids(tokenizer),
    }


def remote_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s weights under ferrolm's names; a tied model's LM head is its embedding and
    is stored once, as the embedding."""
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight")
    return sd


def _read_config(path: Path) -> Any:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / 'config.json'} is not readable JSON ({e})") from None


def is_remote_folder(path: Path) -> bool:
    """Whether the folder ``path``'s config.json is for ferrolm's modeling file."""
    try:
        found = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(found, dict) and found.get("model_type") == REMOTE_MODEL_TYPE


def read_remote_folder(path: Path) -> dict[str, Any]:
    """A checkpoint dict (model config, weights under ferrolm's names, the tokenizer
    fingerprint) from a folder exported with ferrolm's modeling file. ValueError naming the
    file and what is wrong with it."""
    path = Path(path)
    found = _read_config(path)
    if not isinstance(found, dict):
        raise ValueError(f"{path / 'config.json'} is not a JSON object (a {type(found).__name__})")
    fields = ModelConfig.__dataclass_fields__
    try:
        cfg = ModelConfig.from_dict({k: v for k, v in found.items() if k in fields})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / 'config.json'}: not a usable ferrolm model config ({e})") from None
    weights = path / "model.safetensors"
    try:
        with safetensors_open()(os.fspath(weights), framework="pt") as f:
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{weights} is not readable ({type(e).__name__}: {e})") from None
    if cfg.tie_embeddings and "token_embeddings.weight" in sd:
        sd["lm_head.weight"] = sd["token_embeddings.weight"]
    return folder_checkpoint(path, cfg, sd)

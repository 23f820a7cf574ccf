"""Export a checkpoint as a Hugging Face model folder that transformers loads with no
ferrolm code: config.json (LlamaForCausalLM, or Qwen3ForCausalLM for a model with
QK-norm), model.safetensors, generation_config.json and the tokenizer files
(tokenizer.json, tokenizer_config.json, ... and ferrolm's own).

    export_hf("runs/x/best.pt", "hf_model")          # tokenizer: the run's data.tokenizer
    AutoModelForCausalLM.from_pretrained("hf_model"); AutoTokenizer.from_pretrained("hf_model")

ferrolm's default architecture is Llama's (RMSNorm, pre-norm, RoPE, SwiGLU, no biases);
grouped-query attention maps to num_key_value_heads, and QK-norm to Qwen3's q_norm/k_norm.
HF rotates halves of each head where ferrolm rotates pairs, so q/k rows are permuted
(``ferrolm.lm.model.to_hf_state_dict``) and the logits are equal. Settings no exported
architecture has are refused by name (``ferrolm.lm.model.hf_architecture``). The folder
is written whole or not at all.

``export_safetensors`` writes the weights alone, under ferrolm's own names, with the model
config in the file's metadata: a checkpoint that needs no pickle reader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Union

import torch

from ferrolm._util import atomic_write_bytes, atomic_write_dir
from ferrolm.bpe import files as tf
from ferrolm.bpe import hf
from ferrolm.lm.model import ModelConfig, hf_architecture, to_hf_state_dict

__all__ = ["export_hf", "export_safetensors", "hf_config", "llama_config", "MODEL_FILES"]

MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PathLike = Union[str, "os.PathLike[str]"]


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


def _special_ids(tokenizer: Any) -> dict[str, int | None]:
    """bos/eos/pad ids for HF: ferrolm starts a document after eos, so eos is the bos too."""
    roles = hf.hf_special_roles(tokenizer.special_tokens)
    ids = tokenizer.special_token_ids
    eos = ids.get(roles.get("eos_token", ""))
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": ids.get(roles.get("pad_token", ""))}


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config(cfg: ModelConfig, tokenizer: Any, dtype: str = "float32") -> dict:
    """config.json for the HF architecture of ``cfg`` (``hf_architecture``): its shape, RoPE
    theta, key/value heads and tying."""
    arch = hf_architecture(cfg)
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.d_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4 reads this, 5 the dict below
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,  # transformers 4; 5 reads "dtype"
        "dtype": dtype,
        "use_cache": True,
        **_special_ids(tokenizer),
    }
    if arch == "llama":
        config["mlp_bias"] = False
    else:  # Qwen3: every layer full attention
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
        config["layer_types"] = ["full_attention"] * cfg.num_layers
    return config


def llama_config(cfg: ModelConfig, tokenizer: Any, dtype: str = "float32") -> dict:
    """config.json for LlamaForCausalLM; refuses a model that needs another architecture."""
    if hf_architecture(cfg) != "llama":
        raise ValueError("this model has model.qk_norm: its HF architecture is Qwen3 (hf_config)")
    return hf_config(cfg, tokenizer, dtype)


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    try:
        from safetensors.torch import save
    except ImportError:
        raise ImportError("exporting needs the safetensors package: pip install safetensors") from None
    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata={"format": "pt", **metadata})


def _load(checkpoint: PathLike, tokenizer: Any):
    from ferrolm.lm.generate import find_tokenizer, load_model, read_any_checkpoint

    ckpt = read_any_checkpoint(checkpoint)
    tok = find_tokenizer(ckpt, checkpoint, tokenizer)
    if tok is None:
        raise ValueError(
            f"{checkpoint}: its run's config names no tokenizer folder (data.tokenizer): give the tokenizer"
        )
    model, ckpt = load_model(checkpoint, "cpu", tokenizer=tok, ckpt=ckpt)
    return model, ckpt, tok


def export_hf(checkpoint: PathLike, out: PathLike, tokenizer: Any = None, *, dtype: str = "float32") -> Path:
    """Write the HF folder ``out`` for ``checkpoint`` (see the module docstring); return it.

    ``tokenizer``: a Tokenizer or its folder (default: the run config's data.tokenizer);
    its fingerprint must be the checkpoint's. ``dtype``: float32, bfloat16 or float16.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model, _, tok = _load(checkpoint, tokenizer)
    cfg = model.config
    weights = {k: v.to(DTYPES[dtype]) for k, v in to_hf_state_dict(model).items()}
    files = {
        "config.json": _json(hf_config(cfg, tok, dtype)),
        "generation_config.json": _json({**_special_ids(tok), "do_sample": True, "temperature": 1.0, "top_k": 0}),
        "model.safetensors": _safetensors_bytes(weights, {}),
    }
    special_ids = [(s, tok.special_token_ids[s]) for s in tok.special_tokens]
    files.update(
        tf.directory_files(tok.vocab, tok.merges, special_ids, tok.pattern, tok.fingerprint, cfg.context_length)
    )
    return atomic_write_dir(out, files, owned=MODEL_FILES + tf.TOKENIZER_FILES)


def export_safetensors(checkpoint: PathLike, out: PathLike) -> Path:
    """Write the model weights of ``checkpoint`` to the safetensors file ``out`` under
    ferrolm's names; the metadata holds the model config and the tokenizer fingerprint
    (``ferrolm.lm.generate.load_model`` reads such a file)."""
    from ferrolm.lm.generate import load_model

    model, ckpt = load_model(checkpoint, "cpu")
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight")  # the same tensor as the embedding; safetensors stores it once
    meta = {"ferrolm_model_config": json.dumps(model.config.to_dict())}
    if ckpt.get("tokenizer_fingerprint"):
        meta["tokenizer_fingerprint"] = str(ckpt["tokenizer_fingerprint"])
    out = Path(out)
    atomic_write_bytes(out, _safetensors_bytes(sd, meta))
    return out

"""Hugging Face interop for the model: ferrolm's Transformer as HF's ``LlamaForCausalLM``
(``Qwen3ForCausalLM`` for a model with QK-norm, transformers' ``NanoChatForCausalLM`` for one
with ReLU², QK-norm and ``embed_norm``) and back, for folders ferrolm exported and for those
transformers saved.

    hf_architecture(cfg)            "llama", "qwen3" or "nanochat"; ValueError naming what none has
    to_hf_state_dict(model)         weights under HF's names (q/k rows permuted: equal logits)
    from_hf_llama_state_dict(sd, cfg)   the inverse
    hf_config(cfg, tokenizer)       config.json out (``ferrolm.lm.export`` writes the folder)
    read_hf_folder(path)            config.json and model.safetensors in (``load_model`` and
                                    ``initial_weights`` read a folder through it)

The tokenizer's HF files are ``ferrolm.bpe.hf``'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ferrolm.bpe import files as tf
from ferrolm.bpe.hf import hf_special_roles
from ferrolm.lm.config import ModelConfig

__all__ = [
    "hf_architecture",
    "to_hf_state_dict",
    "to_hf_llama_state_dict",
    "from_hf_llama_state_dict",
    "hf_config",
    "llama_config",
    "hf_special_ids",
    "ARCHITECTURES",
    "is_hf_folder",
    "model_config_from_hf",
    "read_hf_folder",
    "folder_checkpoint",
    "safetensors_open",
]

# --------------------------------------------------------------------------------------
# Architectures and weights, both ways
# --------------------------------------------------------------------------------------


def _llama_differences(cfg: ModelConfig) -> list[str]:
    """Each setting of ``cfg`` that Llama's computation lacks (QK-norm and GQA aside), by name."""
    wanted = {
        "norm": "rms",
        "norm_position": "pre",
        "positions": "rope",
        "ffn": "swiglu",
        "logit_softcap": 0.0,
        "value_embeds": False,
        "x0_mix": False,
        "embed_norm": False,
        "unet_skips": False,
        "attn_gate": False,
        "short_window": 0,
        "smear": False,
        "bigram_buckets": 0,
    }
    return [f"model.{k} = {getattr(cfg, k)!r}" for k, v in wanted.items() if getattr(cfg, k) != v]


def _nanochat_differences(cfg: ModelConfig) -> list[str]:
    """Each setting of ``cfg`` that transformers' nanochat computes otherwise, by name
    (soft-capping, GQA and tying it has either way)."""
    wanted = {
        "norm": "rms",
        "norm_position": "pre",
        "positions": "rope",
        "ffn": "relu2",
        "qk_norm": True,
        "qk_norm_gain": False,
        "embed_norm": True,
        "value_embeds": False,
        "x0_mix": False,
        "unet_skips": False,
        "attn_gate": False,
        "short_window": 0,
        "smear": False,
        "bigram_buckets": 0,
    }
    return [f"model.{k} = {getattr(cfg, k)!r}" for k, v in wanted.items() if getattr(cfg, k) != v]


def hf_architecture(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that computes ``cfg``'s logits: "llama", "qwen3" with
    ``qk_norm`` (Qwen3's per-head q_norm/k_norm, exported with unit weights), or "nanochat"
    (transformers' own: ReLU², QK-norm after RoPE, normalized embeddings, weightless norms,
    optional soft-capping). Raise ValueError naming each setting none of them expresses.

    Qwen3 normalizes q and k before RoPE where ferrolm does after; RoPE rotates pairs and so
    keeps each head's norm, and with unit weights the two orders give the same vectors.
    Grouped-query attention maps to num_key_value_heads, tying to tie_word_embeddings;
    zero_init_output is only an initialization; doc_mask changes nothing for a sequence
    with no end-of-text token after its first position (HF attends across documents).
    """
    if not _nanochat_differences(cfg):
        return "nanochat"
    bad = _llama_differences(cfg)
    if bad:
        raise ValueError(
            f"{', '.join(bad)}: the Hugging Face architectures ferrolm exports to (Llama, and Qwen3 for "
            "model.qk_norm) have only RMSNorm, pre-norm, RoPE, SwiGLU, uncapped logits and neither value "
            "embeddings, x0 mixing, token smearing nor bigram embeddings, and transformers' nanochat differs in "
            f"{', '.join(_nanochat_differences(cfg))}, so this model cannot be exported"
        )
    return "qwen3" if cfg.qk_norm else "llama"


def _qk_rows(cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """Rows of W_Q and W_K in HF's halves order: per head, ferrolm's even rows then its odd ones."""
    dh = cfg.d_head
    perm = torch.cat([torch.arange(0, dh, 2), torch.arange(1, dh, 2)])
    q_rows = torch.cat([h * dh + perm for h in range(cfg.num_heads)])
    k_rows = torch.cat([h * dh + perm for h in range(cfg.kv_heads)])
    return q_rows, k_rows


def _flip_second_halves(w: Tensor, d_head: int) -> Tensor:
    """``w`` (heads * d_head, d) with the second half of each head's rows negated (its own inverse).

    nanochat's rotate_half is (x2, -x1), a rotation by minus the angle: with the second half
    of q and k negated it is ferrolm's rotation, and the negation cancels in every q.k."""
    heads = w.view(-1, 2, d_head // 2, w.shape[-1])
    sign = torch.tensor([1.0, -1.0], dtype=w.dtype, device=w.device).view(1, 2, 1, 1)
    return (heads * sign).reshape(w.shape)


def to_hf_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The weights of ``model`` (a ``TransformerLM``) under HF ``LlamaForCausalLM``'s names (``Qwen3ForCausalLM``'s,
    which adds ``self_attn.{q,k}_norm.weight``, with ``qk_norm``), for a config with
    hidden_size = d_model, intermediate_size = d_ff, num_key_value_heads = the model's
    key/value heads, head_dim = d_head, rms_norm_eps = norm_eps, rope theta = rope_theta,
    no biases, and tie_word_embeddings = tie_embeddings (a tied model has no
    ``lm_head.weight``: HF ties it to the embedding). See ``hf_architecture``.

    HF rotates halves of each head (x[i], x[i + d_head/2]) where ferrolm rotates pairs
    (x[2i], x[2i+1]), so each head's rows of W_Q and W_K are permuted, evens then odds:
    the logits are equal. Load with ``hf.load_state_dict(sd, strict=False)`` (HF's rotary
    buffers are not weights).
    """
    cfg = model.config
    sd = model.state_dict()
    if hf_architecture(cfg) == "nanochat":
        return _to_nanochat_state_dict(sd, cfg)
    dh = cfg.d_head
    device = sd["lm_head.weight"].device
    q_rows, k_rows = (r.to(device) for r in _qk_rows(cfg))
    perm = q_rows[:dh]
    out = {"model.embed_tokens.weight": sd["token_embeddings.weight"], "model.norm.weight": sd["ln_final.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    names = {
        "self_attn.v_proj": "attn.v_proj",
        "self_attn.o_proj": "attn.output_proj",
        "mlp.gate_proj": "ffn.w1",
        "mlp.up_proj": "ffn.w3",
        "mlp.down_proj": "ffn.w2",
        "input_layernorm": "ln1",
        "post_attention_layernorm": "ln2",
    }
    unit = sd["ln_final.weight"].new_ones(dh)
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out[theirs + "self_attn.q_proj.weight"] = sd[ours + "attn.q_proj.weight"][q_rows]
        out[theirs + "self_attn.k_proj.weight"] = sd[ours + "attn.k_proj.weight"][k_rows]
        for hf_name, name in names.items():
            out[theirs + hf_name + ".weight"] = sd[ours + name + ".weight"]
        for norm in ("q_norm", "k_norm") if cfg.qk_norm else ():
            # qk_norm_gain is Qwen3's own (its gains in halves order); without it unit gains
            gain = sd.get(ours + f"attn.{norm}.weight")
            out[theirs + f"self_attn.{norm}.weight"] = unit.clone() if gain is None else gain[perm.to(device)]
    return out


to_hf_llama_state_dict = to_hf_state_dict  # the name from when Llama was the only target


def from_hf_llama_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The inverse of ``to_hf_state_dict``: HF ``LlamaForCausalLM`` (or, with ``qk_norm``,
    ``Qwen3ForCausalLM``) weights under ferrolm's names, each head's q/k rows put back from
    halves order into pairs order. A tied model's ``lm_head.weight`` is the embedding.
    Qwen3's q_norm/k_norm gains become ``qk_norm_gain``'s (pairs order); without that switch
    they must be ones. Raises KeyError on a missing weight, ValueError on gains other than
    ones for a config without ``qk_norm_gain``."""
    if hf_architecture(cfg) == "nanochat":
        return _from_nanochat_state_dict(sd, cfg)
    q_rows, k_rows = _qk_rows(cfg)
    embed = sd["model.embed_tokens.weight"]
    out = {"token_embeddings.weight": embed, "ln_final.weight": sd["model.norm.weight"]}
    out["lm_head.weight"] = embed if cfg.tie_embeddings else sd["lm_head.weight"]
    names = {
        "attn.v_proj": "self_attn.v_proj",
        "attn.output_proj": "self_attn.o_proj",
        "ffn.w1": "mlp.gate_proj",
        "ffn.w3": "mlp.up_proj",
        "ffn.w2": "mlp.down_proj",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
    }
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for proj, rows in (("q_proj", q_rows), ("k_proj", k_rows)):
            hf_weight = sd[theirs + f"self_attn.{proj}.weight"]
            w = torch.empty_like(hf_weight)
            w[rows.to(w.device)] = hf_weight  # export took w[rows]; this undoes it
            out[ours + f"attn.{proj}.weight"] = w
        for name, hf_name in names.items():
            out[ours + name + ".weight"] = sd[theirs + hf_name + ".weight"]
        for norm in ("q_norm", "k_norm") if cfg.qk_norm else ():
            gain = sd[theirs + f"self_attn.{norm}.weight"]
            if cfg.qk_norm_gain:
                out[ours + f"attn.{norm}.weight"] = gain[torch.argsort(q_rows[: cfg.d_head])]
            elif not bool((gain == 1).all()):
                raise ValueError(
                    f"{theirs}self_attn.{norm}.weight is not all ones: a model with learned QK-norm gains "
                    "loads with model.qk_norm_gain"
                )
    return out


def _to_nanochat_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """ferrolm's weights under transformers' nanochat names. nanochat's norms have no weight:
    each RMSNorm gain g is folded into the matrices that read the norm's output (W diag(g)),
    which a tied LM head cannot take unless the final gain is all ones."""
    dh = cfg.d_head
    final = sd["ln_final.weight"]
    if cfg.tie_embeddings and not bool((final == 1).all()):
        raise ValueError(
            "ln_final.weight is not all ones and the LM head is tied to the embedding: transformers' nanochat "
            "has weightless norms, so this gain has nowhere to go"
        )
    q_rows, k_rows = (r.to(final.device) for r in _qk_rows(cfg))
    out = {"model.embed_tokens.weight": sd["token_embeddings.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"] * final
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}.self_attn."
        g1, g2 = sd[ours + "ln1.weight"], sd[ours + "ln2.weight"]
        out[theirs + "q_proj.weight"] = _flip_second_halves(sd[ours + "attn.q_proj.weight"][q_rows] * g1, dh)
        out[theirs + "k_proj.weight"] = _flip_second_halves(sd[ours + "attn.k_proj.weight"][k_rows] * g1, dh)
        out[theirs + "v_proj.weight"] = sd[ours + "attn.v_proj.weight"] * g1
        out[theirs + "o_proj.weight"] = sd[ours + "attn.output_proj.weight"]
        out[f"model.layers.{i}.mlp.fc1.weight"] = sd[ours + "ffn.w1.weight"] * g2
        out[f"model.layers.{i}.mlp.fc2.weight"] = sd[ours + "ffn.w2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _from_nanochat_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """transformers' nanochat weights under ferrolm's names (the inverse of
    ``_to_nanochat_state_dict`` with unit gains: nanochat's norms have none)."""
    embed = sd["model.embed_tokens.weight"]
    ones = embed.new_ones(cfg.d_model)
    out = {"token_embeddings.weight": embed, "ln_final.weight": ones.clone()}
    out["lm_head.weight"] = embed if cfg.tie_embeddings else sd["lm_head.weight"]
    q_rows, k_rows = _qk_rows(cfg)
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}.self_attn."
        for proj, rows in (("q_proj", q_rows), ("k_proj", k_rows)):
            hf_weight = _flip_second_halves(sd[theirs + f"{proj}.weight"], cfg.d_head)
            w = torch.empty_like(hf_weight)
            w[rows] = hf_weight
            out[ours + f"attn.{proj}.weight"] = w
        out[ours + "attn.v_proj.weight"] = sd[theirs + "v_proj.weight"]
        out[ours + "attn.output_proj.weight"] = sd[theirs + "o_proj.weight"]
        out[ours + "ffn.w1.weight"] = sd[f"model.layers.{i}.mlp.fc1.weight"]
        out[ours + "ffn.w2.weight"] = sd[f"model.layers.{i}.mlp.fc2.weight"]
        out[ours + "ln1.weight"], out[ours + "ln2.weight"] = ones.clone(), ones.clone()
    return out


# --------------------------------------------------------------------------------------
# Config out: config.json and the special token ids
# --------------------------------------------------------------------------------------


def hf_special_ids(tokenizer: Any) -> dict[str, int | None]:
    """bos/eos/pad ids for HF: ferrolm starts a document after eos, so eos is the bos too."""
    roles = hf_special_roles(tokenizer.special_tokens)
    ids = tokenizer.special_token_ids
    eos = ids.get(roles.get("eos_token", ""))
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": ids.get(roles.get("pad_token", ""))}


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "nanochat": "NanoChatForCausalLM"}


def hf_config(cfg: ModelConfig, tokenizer: Any, dtype: str = "float32") -> dict:
    """config.json for the HF architecture of ``cfg`` (``hf_architecture``): its shape, RoPE
    theta, key/value heads and tying."""
    arch = hf_architecture(cfg)
    config = {
        "architectures": [ARCHITECTURES[arch]],
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
        **hf_special_ids(tokenizer),
    }
    if arch == "llama":
        config["mlp_bias"] = False
    elif arch == "nanochat":
        config.update(hidden_act="relu2", intermediate_size=cfg.ffn_hidden)
        config["final_logit_softcapping"] = cfg.logit_softcap or None
        del config["head_dim"]  # nanochat's is hidden_size / num_attention_heads
    else:  # Qwen3: every layer full attention
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
        config["layer_types"] = ["full_attention"] * cfg.num_layers
    return config


def llama_config(cfg: ModelConfig, tokenizer: Any, dtype: str = "float32") -> dict:
    """config.json for LlamaForCausalLM; refuses a model that needs another architecture."""
    if hf_architecture(cfg) != "llama":
        raise ValueError("this model has model.qk_norm: its HF architecture is Qwen3 (hf_config)")
    return hf_config(cfg, tokenizer, dtype)


# --------------------------------------------------------------------------------------
# In: an exported folder (config.json, model.safetensors)
# --------------------------------------------------------------------------------------


def is_hf_folder(path: Path) -> bool:
    """Whether ``path`` is a folder of HF model files (config.json and safetensors weights)."""
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def safetensors_open():
    """safetensors' ``safe_open``; an ImportError saying how to install it when it is missing."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError(
            "reading .safetensors weights needs the safetensors package: pip install safetensors"
        ) from None
    return safe_open


_HF_TYPES = ("llama", "qwen3", "nanochat")


def _hf_refusals(hf: dict) -> list[str]:
    """The settings of an HF config.json that ferrolm's model has no equivalent of, by name."""
    act = "relu2" if hf["model_type"] == "nanochat" else "silu"
    rope = hf.get("rope_parameters") or {}
    checks = (
        ("hidden_act", hf.get("hidden_act", act) == act),
        ("attention_bias", not hf.get("attention_bias", False)),
        ("mlp_bias", not hf.get("mlp_bias", False)),
        ("rope_scaling", not hf.get("rope_scaling")),
        ("rope_parameters", rope.get("rope_type", "default") == "default"),
        ("use_sliding_window", not hf.get("use_sliding_window", False)),
    )
    return [f"{k} = {hf.get(k)!r}" for k, ok in checks if not ok]


def model_config_from_hf(hf: dict, path: Path) -> ModelConfig:
    """The ModelConfig of the HF config.json dict ``hf`` read from the folder ``path`` (Llama,
    Qwen3 with QK-norm, or transformers' nanochat); ValueError naming what ferrolm's model
    cannot be."""
    if not isinstance(hf, dict):
        raise ValueError(f"{path / 'config.json'} is not a JSON object (a {type(hf).__name__})")
    kind = hf.get("model_type")
    if kind not in _HF_TYPES:
        raise ValueError(f"{path}: only Llama, Qwen3 and transformers' nanochat models load; config.json says {kind!r}")
    odd = _hf_refusals(hf)
    if odd:
        raise ValueError(f"{path}: ferrolm's model has no equivalent of {', '.join(odd)}")
    heads = hf.get("num_attention_heads")
    rope = hf.get("rope_parameters") or {}
    nanochat = kind == "nanochat"
    try:
        cfg = ModelConfig(
            vocab_size=hf["vocab_size"],
            context_length=hf["max_position_embeddings"],
            d_model=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            qk_norm=kind != "llama",
            d_ff=hf["intermediate_size"],
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6 if nanochat else 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **(_nanochat_switches(hf) if nanochat else {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path / 'config.json'}: not a usable {kind} config ({type(e).__name__}: {e})") from None
    if hf.get("head_dim", cfg.d_head) != cfg.d_head:
        raise ValueError(f"{path}: head_dim {hf['head_dim']} is not hidden_size / num_attention_heads")
    return cfg


def _nanochat_switches(hf: dict) -> dict[str, Any]:
    """ferrolm's switches for transformers' nanochat: ReLU² of width intermediate_size,
    normalized embeddings, soft-capped logits (15 when the config leaves it out, as transformers)."""
    cap = hf.get("final_logit_softcapping", 15.0)
    return {"ffn": "relu2", "d_ff_ungated": hf["intermediate_size"], "embed_norm": True, "logit_softcap": cap or 0.0}


def _has_learned_qk_gains(sd: dict[str, Tensor]) -> bool:
    """Whether a Qwen3 state dict's q_norm/k_norm gains are anything but ones (ferrolm exports
    its weightless QK-norm as ones, and such a folder loads back as the model it was)."""
    return any(k.endswith(("q_norm.weight", "k_norm.weight")) and not bool((v == 1).all()) for k, v in sd.items())


def read_hf_folder(path: Path) -> dict[str, Any]:
    """A checkpoint dict (config, model weights under ferrolm's names, the tokenizer
    fingerprint) from a Hugging Face folder: one ``ferrolm export`` wrote (Llama, Qwen3 for a
    model with QK-norm, nanochat), or a Llama, Qwen3 or transformers' nanochat model saved by
    transformers. ValueError naming the file and what is wrong with it."""
    safe_open = safetensors_open()
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{path}: weights split over several files are not supported (no model.safetensors)")
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / 'config.json'} is not readable JSON ({e})") from None
    cfg = model_config_from_hf(hf, path)
    try:
        with safe_open(os.fspath(path / "model.safetensors"), framework="pt") as f:
            hf_sd = {k: f.get_tensor(k) for k in f.keys()}
        if cfg.qk_norm and _has_learned_qk_gains(hf_sd):
            cfg = dataclasses.replace(cfg, qk_norm_gain=True)
        sd = from_hf_llama_state_dict(hf_sd, cfg)
    except KeyError as e:
        raise ValueError(f"{path / 'model.safetensors'} lacks the weight {e}") from None
    except ValueError as e:
        raise ValueError(f"{path / 'model.safetensors'}: {e}") from None
    except Exception as e:
        raise ValueError(f"{path / 'model.safetensors'} is not readable ({type(e).__name__}: {e})") from None
    return folder_checkpoint(path, cfg, sd)


def folder_checkpoint(path: Path, cfg: ModelConfig, sd: dict[str, Tensor]) -> dict[str, Any]:
    """The checkpoint dict of a model folder's config and weights (ferrolm's names), with the
    fingerprint of the tokenizer recorded beside them (None when there is no record)."""
    fingerprint = None  # the tokenizer record beside the weights says which tokenizer they need
    try:
        fingerprint = json.loads((path / tf.RECORD_FILE).read_text(encoding="utf-8")).get("fingerprint")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        pass
    return {"config": {"model": cfg.to_dict()}, "model": sd, "iteration": None, "tokenizer_fingerprint": fingerprint}

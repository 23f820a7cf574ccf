"""Export a checkpoint as one GGUF file, the format of llama.cpp and the tools built on it
(ollama, LM Studio, llama-cpp-python, ...), written with the ``gguf`` package (llama.cpp's
own writer; ``pip install "ferrolm[gguf]"``):

    export_gguf("runs/x/best.pt", "model.gguf")      # tokenizer: the run's data.tokenizer
    llama-cli -m model.gguf -p "Once upon a time"

A model is written as one of two llama.cpp architectures, both ferrolm's default block
(RMSNorm, pre-norm, RoPE, SwiGLU, no biases), grouped-query attention as head_count_kv:

- "llama" without QK-norm. Its RoPE rotates consecutive pairs (x[2i], x[2i+1]) as ferrolm's
  does, so the q/k rows are written as they are (llama.cpp's own converter undoes the
  permutation of a Hugging Face Llama).
- "qwen3" with QK-norm (the ``portable`` preset's models): attn_q_norm/attn_k_norm are
  ferrolm's weightless norms as unit weights. Qwen3 normalizes before RoPE where ferrolm does
  after; RoPE keeps each head's norm, so with unit weights the two give the same vectors
  (``ferrolm.lm.hf.hf_architecture``). Its RoPE rotates halves (x[i], x[i + d_head/2]), as
  Hugging Face's does, so each head's q/k rows are in the order of the Hugging Face export.

Switches neither computes (value embeddings, x0 mixing, ReLU^2 or SiLU MLPs, soft-capped
logits, post-norm, ...) are refused by name, with the presets that train a model they can.

``dtype``: the matrices as f32, f16, bf16 or q8_0 (llama.cpp's blocks of 32 int8s with one
float16 scale, quantized by the ``gguf`` package's copy of llama.cpp's rounding; a matrix
whose rows are not whole blocks is written f16, as llama.cpp's converter does). Norm gains
and other vectors stay f32, as llama.cpp reads them.

The tokenizer goes in as a GPT-2-style byte-level BPE (``tokenizer.ggml.model = "gpt2"``):
tokens in GPT-2's byte-to-unicode form (as in vocab.json), merges in merges.txt's form,
special tokens typed CONTROL, ids past the tokenizer's (a rounded-up vocab_size) as UNUSED
placeholders. llama.cpp knows pre-tokenizers by name, each with its own copy of the regex:
ferrolm's gpt2, cl100k and o200k patterns map to its "gpt-2", "llama-bpe" and "gpt-4o"; a
custom pattern has no name there and is refused. The end-of-text token is both eos and bos
(a document starts after it) and no bos is added to a prompt, as in ``ferrolm generate``.

The file is written whole or not at all (a temporary name beside it, then a rename).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Any, Union

import numpy as np

from ferrolm import __version__
from ferrolm._util import check_out, fsync_dir
from ferrolm.bpe import patterns
from ferrolm.bpe.fileformat import token_to_str
from ferrolm.lm.hf import _llama_differences, to_hf_state_dict
from ferrolm.lm.model import ModelConfig

__all__ = [
    "export_gguf",
    "gguf_architecture",
    "gguf_dtype",
    "gguf_tensors",
    "encode_tensor",
    "is_ferrolm_gguf",
    "PRE_TOKENIZERS",
    "DTYPES",
    "DTYPE_ALIASES",
]

PathLike = Union[str, "os.PathLike[str]"]

# ferrolm's pattern -> the name llama.cpp gives its own copy of that pre-tokenizer regex
PRE_TOKENIZERS = {patterns.GPT2: "gpt-2", patterns.CL100K: "llama-bpe", patterns.O200K: "gpt-4o"}
# the matrices' type -> (its GGML type, the file type llama.cpp reports), by gguf's enum names
DTYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
}
DTYPE_ALIASES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # the names the HF export takes

MARKER_KEY = "ferrolm.version"  # the version that wrote the file: an export ferrolm may replace
INSTALL_HINT = 'exporting GGUF needs the gguf package: pip install "ferrolm[gguf]"'


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return gguf


def gguf_dtype(dtype: str) -> str:
    """The GGUF name (f32, f16, bf16, q8_0) of ``dtype``, which may also be float32, float16 or bfloat16."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or float32, float16, bfloat16), got {dtype!r}")
    return name


def gguf_architecture(cfg: ModelConfig) -> str:
    """llama.cpp's architecture for ``cfg``: "qwen3" with QK-norm, else "llama" (either with
    grouped-query attention). Raise ValueError naming each setting neither computes, and
    the presets that train a model they can."""
    bad = _llama_differences(cfg)
    if bad:
        raise ValueError(
            f"{', '.join(bad)}: llama.cpp's llama and qwen3 architectures, the ones ferrolm writes to GGUF, "
            "compute only RMSNorm, pre-norm, RoPE, SwiGLU and uncapped logits, with neither value embeddings, "
            "x0 mixing, token smearing nor bigram embeddings, so this model cannot be exported as GGUF; train "
            "with --config portable (cpu-small's recipe without those switches) or --config cs336 for a model "
            "that can"
        )
    return "qwen3" if cfg.qk_norm else "llama"


def pre_tokenizer_name(pattern: str) -> str:
    """llama.cpp's name for the pre-tokenizer ``pattern`` (a regex or a ferrolm name)."""
    name = PRE_TOKENIZERS.get(patterns.resolve(pattern))
    if name is None:
        raise ValueError(
            "the tokenizer's pre-tokenization pattern is a custom regex: llama.cpp knows pre-tokenizers only by "
            "name (ferrolm's gpt2, cl100k and o200k patterns map to them), so this model cannot be exported as GGUF"
        )
    return name


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """The weights of ``model`` under the tensor names of its llama.cpp architecture
    (``gguf_architecture``), as float32 numpy arrays in ferrolm's (out, in) layout (GGUF
    lists the dimensions the other way round), q/k rows in the order that architecture's
    RoPE pairs them. A model with tied embeddings has no ``output.weight``: llama.cpp then
    uses ``token_embd``."""
    gguf = _gguf()
    cfg: ModelConfig = model.config
    arch = gguf_architecture(cfg)
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    hf = {}
    if arch == "qwen3":  # its RoPE rotates halves, as Hugging Face's: the HF export's q/k rows
        hf = {k: v.detach().float().cpu().numpy() for k, v in to_hf_state_dict(model).items()}
        for i in range(cfg.num_layers):
            for proj in ("q_proj", "k_proj"):
                sd[f"layers.{i}.attn.{proj}.weight"] = hf[f"model.layers.{i}.self_attn.{proj}.weight"]
    out = {names[T.TOKEN_EMBD] + ".weight": sd["token_embeddings.weight"]}
    per_layer = {
        T.ATTN_NORM: "ln1",
        T.ATTN_Q: "attn.q_proj",
        T.ATTN_K: "attn.k_proj",
        T.ATTN_V: "attn.v_proj",
        T.ATTN_OUT: "attn.output_proj",
        T.FFN_NORM: "ln2",
        T.FFN_GATE: "ffn.w1",
        T.FFN_UP: "ffn.w3",
        T.FFN_DOWN: "ffn.w2",
    }
    for i in range(cfg.num_layers):
        for tensor, ours in per_layer.items():
            out[names[tensor].format(bid=i) + ".weight"] = sd[f"layers.{i}.{ours}.weight"]
        if arch == "qwen3":  # the HF export's gains: qk_norm_gain's in halves order, else ones
            for tensor, norm in ((T.ATTN_Q_NORM, "q_norm"), (T.ATTN_K_NORM, "k_norm")):
                out[names[tensor].format(bid=i) + ".weight"] = hf[f"model.layers.{i}.self_attn.{norm}.weight"]
    out[names[T.OUTPUT_NORM] + ".weight"] = sd["ln_final.weight"]
    if not cfg.tie_embeddings:
        out[names[T.OUTPUT] + ".weight"] = sd["lm_head.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def encode_tensor(array: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    """``array`` (float32) as the data and GGML type a GGUF file stores for ``dtype``: a
    vector stays F32 (llama.cpp reads norms so); a matrix whose rows are not whole blocks of
    the type (q8_0's 32) is F16, as llama.cpp's converter writes it."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    qtype = Q[DTYPES[gguf_dtype(dtype)][0]] if array.ndim > 1 else Q.F32
    if array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = Q.F16
    return gguf.quants.quantize(array, qtype), qtype


def _tokenizer_fields(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """tokens, token types and merges for ``vocab_size`` ids (``vocab_size`` >= the tokenizer's)."""
    gguf = _gguf()
    special = {i: s for s, i in tokenizer.special_token_ids.items()}
    vocab = tokenizer.vocab
    tokens, types = [], []
    for i in range(vocab_size):
        if i in special:
            tokens.append(special[i])
            types.append(gguf.TokenType.CONTROL)
        elif i in vocab:
            tokens.append(token_to_str(vocab[i]))
            types.append(gguf.TokenType.NORMAL)
        else:  # an id the tokenizer lacks: a placeholder the text never produces
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [f"{token_to_str(a)} {token_to_str(b)}" for a, b in tokenizer.merges]
    return {"tokens": tokens, "types": types, "merges": merges}


def export_gguf(
    checkpoint: PathLike,
    out: PathLike,
    tokenizer: Any = None,
    *,
    dtype: str = "f32",
    name: str = "",
    force: bool = False,
) -> Path:
    """Write ``checkpoint`` as the GGUF file ``out`` (see the module docstring); return it.

    ``tokenizer``: a Tokenizer or its folder (default: the run config's data.tokenizer);
    its fingerprint must be the checkpoint's. ``dtype``: the matrices' type, f32, f16, bf16
    or q8_0 (float32, float16 and bfloat16 are taken too). ``name``: general.name (default:
    the file's stem). An existing ``out`` is replaced only when ferrolm wrote it (its
    ``ferrolm.version`` field) or with ``force``; never when it is what the export reads.
    """
    gguf = _gguf()
    dtype = gguf_dtype(dtype)
    from ferrolm.lm.checkpoint import load_model
    from ferrolm.lm.export import export_inputs

    model, tok, info = load_model(checkpoint, "cpu", tokenizer=tokenizer, require_tokenizer=True)
    arch = gguf_architecture(model.config)
    inputs = export_inputs(checkpoint, tokenizer, info)
    out = check_out(out, inputs, force=force, judge=_judge_gguf, example="model.gguf")
    pre = pre_tokenizer_name(tok.pattern)
    if tok.eos_id is None:
        raise ValueError("the tokenizer has no <|endoftext|> special token: GGUF needs it as eos")
    if not tok.merges:
        raise ValueError("the tokenizer has no merges: llama.cpp loads a BPE vocabulary only with its merges")
    tensors = gguf_tensors(model)

    w = gguf.GGUFWriter(None, arch)
    w.add_name(name or out.stem)
    w.add_string(MARKER_KEY, __version__)
    w.add_file_type(gguf.LlamaFileType[DTYPES[dtype][1]])
    _add_model_fields(w, model.config)
    _add_tokenizer_fields(w, tok, model.config.vocab_size, pre)
    for key, array in tensors.items():
        data, qtype = encode_tensor(array, dtype)
        w.add_tensor(key, data, raw_dtype=qtype)
    _write(w, out)
    return out


def _add_model_fields(w: Any, cfg: ModelConfig) -> None:
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_dimension_count(cfg.d_head)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.norm_eps))


def _add_tokenizer_fields(w: Any, tok: Any, vocab_size: int, pre: str) -> None:
    fields = _tokenizer_fields(tok, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(fields["tokens"])
    w.add_token_types(fields["types"])
    w.add_token_merges(fields["merges"])
    w.add_bos_token_id(tok.eos_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)


def _write(w: Any, out: Path) -> None:
    """The file of writer ``w`` at ``out``, whole or not at all (a temporary name beside it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException as e:
        w.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename == os.fspath(tmp):  # name the file asked for
            raise type(e)(e.errno, e.strerror, os.fspath(out)) from None
        raise
    fsync_dir(out.parent)


def is_ferrolm_gguf(path: PathLike) -> bool:
    """Whether ``path`` is a GGUF file whose metadata says ferrolm wrote it."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":  # not GGUF at all: no need to map it
                return False
        return MARKER_KEY in _gguf().GGUFReader(path, "r").fields
    except Exception:  # a damaged or foreign file is not ours, whatever the reader raises
        return False


def _judge_gguf(path: Path) -> str | None:
    if is_ferrolm_gguf(path):
        return None
    return "exists and is not a GGUF file written by ferrolm; choose a new file name"

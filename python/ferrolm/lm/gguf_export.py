"""Export a checkpoint as one GGUF file, the format of llama.cpp and the tools built on it
(ollama, LM Studio, llama-cpp-python, ...), written with the ``gguf`` package (llama.cpp's
own writer; ``pip install "ferrolm[gguf]"``):

    export_gguf("runs/x/best.pt", "model.gguf")      # tokenizer: the run's data.tokenizer
    llama-cli -m model.gguf -p "Once upon a time"

The model is written as llama.cpp's "llama" architecture, which is ferrolm's default
recipe (RMSNorm, pre-norm, RoPE, SwiGLU, no biases); switches it has no field for are
refused by name. llama.cpp's "llama" RoPE rotates consecutive pairs (x[2i], x[2i+1]) as
ferrolm does, so the q/k rows are written as they are (the Hugging Face export permutes
them for HF's rotate-halves; llama.cpp's own converter undoes that permutation).

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
from ferrolm.lm.hf import check_llama_compatible
from ferrolm.lm.model import ModelConfig

__all__ = ["export_gguf", "gguf_tensors", "is_ferrolm_gguf", "PRE_TOKENIZERS", "DTYPES"]

PathLike = Union[str, "os.PathLike[str]"]

# ferrolm's pattern -> the name llama.cpp gives its own copy of that pre-tokenizer regex
PRE_TOKENIZERS = {patterns.GPT2: "gpt-2", patterns.CL100K: "llama-bpe", patterns.O200K: "gpt-4o"}
DTYPES = ("float32", "float16")  # of the matrices; norm gains stay float32, as llama.cpp wants

MARKER_KEY = "ferrolm.version"  # the version that wrote the file: an export ferrolm may replace
INSTALL_HINT = 'exporting GGUF needs the gguf package: pip install "ferrolm[gguf]"'


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return gguf


def pre_tokenizer_name(pattern: str) -> str:
    """llama.cpp's name for the pre-tokenizer ``pattern`` (a regex or a ferrolm name)."""
    name = PRE_TOKENIZERS.get(patterns.resolve(pattern))
    if name is None:
        raise ValueError(
            "the tokenizer's pre-tokenization pattern is a custom regex: llama.cpp knows pre-tokenizers only by "
            "name (ferrolm's gpt2, cl100k and o200k patterns map to them), so this model cannot be exported as GGUF"
        )
    return name


def gguf_tensors(model: Any, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The weights of ``model`` under llama.cpp's "llama" tensor names, as numpy arrays in
    ferrolm's (out, in) layout (GGUF lists the dimensions the other way round). A model
    with tied embeddings has no ``output.weight``: llama.cpp then uses ``token_embd``."""
    gguf = _gguf()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    cfg: ModelConfig = model.config
    check_llama_compatible(cfg)
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    matrix = np.float16 if dtype == "float16" else np.float32

    def mat(key: str) -> np.ndarray:
        return np.ascontiguousarray(sd[key].astype(matrix))

    out = {names[T.TOKEN_EMBD] + ".weight": mat("token_embeddings.weight")}
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
            key = f"layers.{i}.{ours}.weight"
            gain = tensor in (T.ATTN_NORM, T.FFN_NORM)
            out[names[tensor].format(bid=i) + ".weight"] = sd[key].astype(np.float32) if gain else mat(key)
    out[names[T.OUTPUT_NORM] + ".weight"] = sd["ln_final.weight"].astype(np.float32)
    if not cfg.tie_embeddings:
        out[names[T.OUTPUT] + ".weight"] = mat("lm_head.weight")
    return out


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
    dtype: str = "float32",
    name: str = "",
    force: bool = False,
) -> Path:
    """Write ``checkpoint`` as the GGUF file ``out`` (see the module docstring); return it.

    ``tokenizer``: a Tokenizer or its folder (default: the run config's data.tokenizer);
    its fingerprint must be the checkpoint's. ``dtype``: float32 or float16 (the matrices).
    ``name``: general.name (default: the file's stem). An existing ``out`` is replaced only
    when ferrolm wrote it (its ``ferrolm.version`` field) or with ``force``; never when it is
    what the export reads.
    """
    gguf = _gguf()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    from ferrolm.lm.checkpoint import load_model
    from ferrolm.lm.export import export_inputs

    model, tok, info = load_model(checkpoint, "cpu", tokenizer=tokenizer, require_tokenizer=True)
    cfg = model.config
    check_llama_compatible(cfg)
    inputs = export_inputs(checkpoint, tokenizer, info)
    out = check_out(out, inputs, force=force, judge=_judge_gguf, example="model.gguf")
    pre = pre_tokenizer_name(tok.pattern)
    if tok.eos_id is None:
        raise ValueError("the tokenizer has no <|endoftext|> special token: GGUF needs it as eos")
    if not tok.merges:
        raise ValueError("the tokenizer has no merges: llama.cpp loads a BPE vocabulary only with its merges")
    tensors = gguf_tensors(model, dtype)
    fields = _tokenizer_fields(tok, cfg.vocab_size)

    w = gguf.GGUFWriter(None, "llama")
    w.add_name(name or out.stem)
    w.add_string(MARKER_KEY, __version__)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "float16" else gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_heads)
    w.add_rope_dimension_count(cfg.d_head)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.norm_eps))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(fields["tokens"])
    w.add_token_types(fields["types"])
    w.add_token_merges(fields["merges"])
    w.add_bos_token_id(tok.eos_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for key, array in tensors.items():
        w.add_tensor(key, array)

    _write(w, out)
    return out


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

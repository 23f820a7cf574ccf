"""ferrolm.lm.gguf_export: the GGUF file read back with the gguf package's own reader holds
every weight and tokenizer field as llama.cpp's "llama" and "qwen3" architectures name them,
in each dtype (q8_0 within its rounding bound); a forward pass written from llama.cpp's
graph of each architecture over the file's tensors gives ferrolm's logits; llama.cpp itself
(llama-cpp-python, when installed) tokenizes as ferrolm does and greedily continues a prompt
with ferrolm's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import ferrolm

gguf = pytest.importorskip("gguf")

from tiny_lm import tiny_run

from ferrolm.bpe.fileformat import token_to_str
from ferrolm.lm.checkpoint import load_model
from ferrolm.lm.generate import generate
from ferrolm.lm.gguf_export import export_gguf, gguf_architecture, is_ferrolm_gguf

torch.set_num_threads(1)
PROMPT = "The parser reads the command line and"
Q = gguf.GGMLQuantizationType
# llama: untied; llama with grouped-query attention, tied; qwen3: QK-norm with grouped-query attention
RUNS = {
    "llama": {},
    "llama-gqa-tied": {"tie_embeddings": True, "num_kv_heads": 2},
    "qwen3-gqa": {"qk_norm": True, "num_kv_heads": 2, "zero_init_output": True},
    "qwen3-gains": {"qk_norm": True, "qk_norm_gain": True},  # Qwen3's learned q/k norm gains
}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp(request.param), **RUNS[request.param])


def _fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def _values(t) -> np.ndarray:
    """A tensor of the file as float32 in ferrolm's (out, in) order, dequantized by gguf's own code."""
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))


def _halves(w: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows of ``w``, evens then odds: the order in which NEOX RoPE pairs (i, i + d/2)
    rotate what ferrolm's pairs (2i, 2i + 1) do."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)


def _expected_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> ferrolm's weight as the file should hold it (float32)."""
    cfg = model.config
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    qwen3 = cfg.qk_norm
    want = {"token_embd.weight": sd["token_embeddings.weight"], "output_norm.weight": sd["ln_final.weight"]}
    if not cfg.tie_embeddings:
        want["output.weight"] = sd["lm_head.weight"]
    ours = {
        "attn_norm": "ln1",
        "attn_v": "attn.v_proj",
        "attn_output": "attn.output_proj",
        "ffn_norm": "ln2",
        "ffn_gate": "ffn.w1",
        "ffn_up": "ffn.w3",
        "ffn_down": "ffn.w2",
    }
    for i in range(cfg.num_layers):
        for theirs, name in ours.items():
            want[f"blk.{i}.{theirs}.weight"] = sd[f"layers.{i}.{name}.weight"]
        q, k = sd[f"layers.{i}.attn.q_proj.weight"], sd[f"layers.{i}.attn.k_proj.weight"]
        # llama's RoPE rotates pairs as ferrolm's does: rows as they are; qwen3's rotates halves
        want[f"blk.{i}.attn_q.weight"] = _halves(q, cfg.num_heads) if qwen3 else q
        want[f"blk.{i}.attn_k.weight"] = _halves(k, cfg.kv_heads) if qwen3 else k
        for norm in ("q_norm", "k_norm") if qwen3 else ():  # the gains (ones without them), in halves order
            gain = sd.get(f"layers.{i}.attn.{norm}.weight", np.ones(cfg.d_head, "f4"))
            want[f"blk.{i}.attn_{norm}.weight"] = _halves(gain[:, None], 1)[:, 0]
    return want


def _check_values(key: str, got: np.ndarray, w: np.ndarray, qtype) -> None:
    if qtype == Q.F32:
        np.testing.assert_array_equal(got, w, err_msg=key)
    elif qtype == Q.F16:
        np.testing.assert_array_equal(got, w.astype(np.float16).astype(np.float32), err_msg=key)
    elif qtype == Q.BF16:  # round to nearest even, as torch rounds
        np.testing.assert_array_equal(got, torch.from_numpy(w).bfloat16().float().numpy(), err_msg=key)
    else:  # q8_0: each block of 32 is round(x / d) * d, d = max|x| / 127 stored as float16
        blocks, got_blocks = w.reshape(-1, 32), got.reshape(-1, 32)
        d = np.abs(blocks).max(axis=1, keepdims=True) / 127
        assert (np.abs(got_blocks - blocks) <= d * (0.5 + 127 * 2.0**-11) + 1e-12).all(), key
        assert (np.abs(got_blocks - blocks) > 0).any(), key  # quantized, not stored as floats


DTYPE_TYPES = {"f32": Q.F32, "float16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
FILE_TYPES = {"f32": 0, "float16": 1, "bf16": 32, "q8_0": 7}


@pytest.mark.parametrize("dtype", list(DTYPE_TYPES))
def test_gguf_reads_back_every_tensor_and_field(run, tmp_path, dtype):
    ckpt, tok, _ = run
    out = export_gguf(ckpt, tmp_path / "m.gguf", dtype=dtype)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary left
    model, _, _ = load_model(ckpt, tokenizer=False)
    cfg = model.config
    reader = gguf.GGUFReader(out)
    f = _fields(reader)

    arch = "qwen3" if cfg.qk_norm else "llama"
    special = {i: s for s, i in tok.special_token_ids.items()}
    tokens = [special.get(i) or token_to_str(tok.vocab[i]) for i in range(cfg.vocab_size)]
    want = {
        "general.architecture": arch,
        "general.name": "m",
        "ferrolm.version": ferrolm.__version__,
        "general.file_type": FILE_TYPES[dtype],
        f"{arch}.vocab_size": cfg.vocab_size,
        f"{arch}.context_length": cfg.context_length,
        f"{arch}.embedding_length": cfg.d_model,
        f"{arch}.block_count": cfg.num_layers,
        f"{arch}.feed_forward_length": cfg.d_ff,
        f"{arch}.attention.head_count": cfg.num_heads,
        f"{arch}.attention.head_count_kv": cfg.num_kv_heads or cfg.num_heads,
        f"{arch}.rope.dimension_count": cfg.d_model // cfg.num_heads,
        f"{arch}.rope.freq_base": pytest.approx(cfg.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": pytest.approx(cfg.norm_eps),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if i in special else 1 for i in range(cfg.vocab_size)],
        "tokenizer.ggml.merges": [token_to_str(a) + " " + token_to_str(b) for a, b in tok.merges],
        "tokenizer.ggml.bos_token_id": tok.eos_id,
        "tokenizer.ggml.eos_token_id": tok.eos_id,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
    }
    assert {k: v for k, v in f.items() if not k.startswith("GGUF.")} == want
    assert tokens[tok.eos_id] == "<|endoftext|>" and len(f["tokenizer.ggml.merges"]) == len(tok.merges) > 0

    expected = _expected_tensors(model)
    tensors = {t.name: t for t in reader.tensors}
    assert sorted(tensors) == sorted(expected)
    for key, w in expected.items():
        t = tensors[key]
        assert t.tensor_type == (DTYPE_TYPES[dtype] if w.ndim > 1 else Q.F32), key  # vectors stay float32
        assert t.shape.tolist() == list(reversed(w.shape)), key  # GGUF lists the innermost dimension first
        _check_values(key, _values(t), w, t.tensor_type)


def _rope(x: np.ndarray, theta: float, halves: bool) -> np.ndarray:
    """llama.cpp's RoPE of x (tokens, heads, d) at positions 0..T-1: NORM mode rotates pairs
    (2i, 2i + 1), NEOX mode (i, i + d/2), each by the angle p * theta^(-2i/d)."""
    T, _, d = x.shape
    angle = np.arange(T)[:, None, None] * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(angle), np.sin(angle)
    first, second = (np.s_[..., : d // 2], np.s_[..., d // 2 :]) if halves else (np.s_[..., 0::2], np.s_[..., 1::2])
    a, b = x[first], x[second]
    out = np.empty_like(x)
    out[first], out[second] = a * cos - b * sin, a * sin + b * cos
    return out


def _gguf_logits(path: Path, ids: list[int]) -> np.ndarray:
    """The logits of llama.cpp's llama or qwen3 graph over the file's tensors, in float64:
    qwen3 RMS-normalizes each head's q and k (times attn_q_norm / attn_k_norm) before its
    NEOX RoPE; query head h reads key/value head h // (head_count / head_count_kv)."""
    reader = gguf.GGUFReader(path)
    f = _fields(reader)
    arch = f["general.architecture"]
    W = {t.name: _values(t).astype(np.float64) for t in reader.tensors}
    heads, kv = f[f"{arch}.attention.head_count"], f[f"{arch}.attention.head_count_kv"]
    eps, theta = f[f"{arch}.attention.layer_norm_rms_epsilon"], f[f"{arch}.rope.freq_base"]

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    x = W["token_embd.weight"][ids]
    T, d = x.shape
    dh = d // heads
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(f[f"{arch}.block_count"]):
        blk = {name.split(".")[2]: w for name, w in W.items() if name.startswith(f"blk.{i}.")}.__getitem__
        h = rms(x, blk("attn_norm"))
        q, k, v = (h @ blk(n).T for n in ("attn_q", "attn_k", "attn_v"))
        q, k, v = q.reshape(T, heads, dh), k.reshape(T, kv, dh), v.reshape(T, kv, dh)
        if arch == "qwen3":
            q, k = rms(q, blk("attn_q_norm")), rms(k, blk("attn_k_norm"))
        q, k = _rope(q, theta, arch == "qwen3"), _rope(k, theta, arch == "qwen3")
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dh) + causal
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(T, d) @ blk("attn_output").T
        h = rms(x, blk("ffn_norm"))
        gate = h @ blk("ffn_gate").T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ blk("ffn_up").T)) @ blk("ffn_down").T
    return rms(x, W["output_norm.weight"]) @ W.get("output.weight", W["token_embd.weight"]).T


def test_llama_cpps_graph_over_the_file_gives_ferrolms_logits(run, tmp_path):
    ckpt, tok, _ = run
    model, _, _ = load_model(ckpt, tokenizer=False)
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0].double().numpy()
    got = _gguf_logits(export_gguf(ckpt, tmp_path / "m.gguf"), ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    q8 = _gguf_logits(export_gguf(ckpt, tmp_path / "q8.gguf", dtype="q8_0"), ids)
    assert np.abs(q8 - want).max() < 0.05 * np.abs(want).max()  # close, not equal: 8-bit weights
    assert (q8.argmax(-1) == want.argmax(-1)).mean() > 0.8


def test_the_portable_preset_trains_models_that_export_to_gguf_and_hugging_face(tmp_path):
    from ferrolm.lm.config import load_config
    from ferrolm.lm.hf import hf_architecture

    cfg = load_config("portable")
    m = cfg.model
    # cpu-small's recipe, less the switches llama.cpp lacks
    assert (m.ffn, m.qk_norm, m.zero_init_output, m.value_embeds, m.x0_mix, m.logit_softcap) == (
        "swiglu",
        True,
        True,
        False,
        False,
        0.0,
    )
    assert (cfg.optimizer.name, cfg.schedule.lr_schedule) == ("muon", "wsd")
    assert gguf_architecture(m) == hf_architecture(m) == "qwen3"
    with pytest.raises(ValueError, match="train with --config portable"):  # cpu-small itself names it
        gguf_architecture(load_config("cpu-small").model)

    # its switches at a tiny shape; d_ff 40: ffn_down's rows are no whole number of q8_0's blocks of 32
    shape = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta")
    ckpt, tok, _ = tiny_run(tmp_path / "run", steps=5, d_ff=40, **{k: v for k, v in vars(m).items() if k not in shape})
    model, _, _ = load_model(ckpt, tokenizer=False)
    out = export_gguf(ckpt, tmp_path / "portable.gguf", dtype="q8_0")
    reader = gguf.GGUFReader(out)
    assert _fields(reader)["general.architecture"] == "qwen3"
    tensors = {t.name: t for t in reader.tensors}
    expected = _expected_tensors(model)
    assert sorted(tensors) == sorted(expected)
    for key, w in expected.items():
        t = tensors[key]
        qtype = (
            Q.F32 if w.ndim == 1 else Q.F16 if key.endswith("ffn_down.weight") else Q.Q8_0
        )  # as llama.cpp's converter
        assert t.tensor_type == qtype, key
        _check_values(key, _values(t), w, qtype)
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0].double().numpy()
    got = _gguf_logits(export_gguf(ckpt, tmp_path / "f32.gguf"), ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_ferrolm_train_config_portable_then_export_gguf(tmp_path, capsys):
    """The preset's whole path at a tiny shape: train (Muon, WSD, QK-norm) and export, read back."""
    from tiny_lm import stdlib_text

    from ferrolm import Tokenizer
    from ferrolm.app.cli import main
    from ferrolm.bpe import shards

    text = stdlib_text()
    tok = Tokenizer.train(iter([text]), 320, ["<|endoftext|>"], progress=False)
    tokdir = tok.save(tmp_path / "tok")
    half = len(text) // 2
    for name, part in (("train", text[:half]), ("val", text[half:])):
        shards.encode_texts(tok, [part], tmp_path / name, progress=False)
    sets = {
        "model.d_model": 32,
        "model.num_heads": 4,
        "model.num_layers": 2,
        "model.d_ff": 64,
        "model.context_length": 32,
        "data.train": tmp_path / "train",
        "data.val": tmp_path / "val",
        "data.tokenizer": tokdir,
        "schedule.max_steps": 3,
        "schedule.warmup_steps": 1,
        "schedule.schedule_by": "steps",
        "schedule.max_time_s": 0,
        "schedule.batch_size": 2,
        "run.out_dir": tmp_path / "run",
        "run.eval_every": 3,
        "run.eval_batches": 1,
        "run.checkpoint_every": 0,
        "run.progress": "false",
        "run.num_threads": 1,
        "run.autocast_bf16": "false",
    }
    argv = ["train", "--config", "portable"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    assert main(argv) == 0, capsys.readouterr().err
    out = tmp_path / "m.gguf"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out), "--format", "gguf"]) == 0
    model, _, _ = load_model(tmp_path / "run", tokenizer=False)
    assert _fields(gguf.GGUFReader(out))["general.architecture"] == "qwen3"
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0].double().numpy()
    np.testing.assert_allclose(_gguf_logits(out, ids), want, atol=1e-4, rtol=0)


def test_gguf_refuses_what_llama_cpp_cannot_express(tmp_path):
    from ferrolm import Tokenizer
    from ferrolm.lm.checkpoint import save_checkpoint
    from ferrolm.lm.model import TransformerLM

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    model = TransformerLM(300, 16, 32, 1, 4, 64, norm_position="post")
    save_checkpoint(model, None, 0, tmp_path / "post.pt", config={"model": model.config.to_dict()})
    with pytest.raises(ValueError, match="model.norm_position = 'post'"):
        export_gguf(tmp_path / "post.pt", tmp_path / "post.gguf", tok)
    # each switch by name, in llama.cpp's terms, with the presets that train an exportable model
    for switches, names in (
        ({"ffn": "relu2", "qk_norm": True}, "model.ffn = 'relu2'"),
        ({"x0_mix": True, "num_kv_heads": 2}, "model.x0_mix = True"),
        ({"value_embeds": True, "logit_softcap": 15.0}, "model.logit_softcap = 15.0, model.value_embeds = True"),
    ):
        model = TransformerLM(300, 16, 32, 1, 4, 64, **switches)
        save_checkpoint(model, None, 0, tmp_path / "s.pt", config={"model": model.config.to_dict()})
        with pytest.raises(ValueError) as e:
            export_gguf(tmp_path / "s.pt", tmp_path / "s.gguf", tok)
        message = str(e.value)
        assert message.startswith(names + ": llama.cpp's llama and qwen3 architectures, the ones ferrolm writes")
        assert "cannot be exported as GGUF; train with --config portable" in message and "--config cs336" in message
        assert "Hugging Face" not in message
    (tmp_path / "s.pt").unlink()
    model = TransformerLM(300, 16, 32, 1, 4, 64)
    save_checkpoint(model, None, 0, tmp_path / "ok.pt", config={"model": model.config.to_dict()})
    custom = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"], pattern=r"\w+|\s+|[^\w\s]+")
    with pytest.raises(ValueError, match="custom regex"):
        export_gguf(tmp_path / "ok.pt", tmp_path / "custom.gguf", custom)
    for bad in ("q4_0", "float64", "F16"):
        with pytest.raises(ValueError, match=f"dtype must be one of f32, f16, bf16, q8_0 .*got '{bad}'"):
            export_gguf(tmp_path / "ok.pt", tmp_path / "bad.gguf", tok, dtype=bad)
    with pytest.raises(ValueError, match="the tokenizer has no merges"):
        export_gguf(tmp_path / "ok.pt", tmp_path / "no-merges.gguf", tok)
    vocab = {**{i: bytes([i]) for i in range(256)}, 256: b"ab"}
    cl100k = Tokenizer(vocab, [(b"a", b"b")], ["<|endoftext|>"], pattern="cl100k")
    out = export_gguf(tmp_path / "ok.pt", tmp_path / "cl100k.gguf", cl100k)
    f = _fields(gguf.GGUFReader(out))
    assert f["tokenizer.ggml.pre"] == "llama-bpe" and f["tokenizer.ggml.merges"] == ["a b"]
    # the model has 300 ids, the tokenizer 258: the rest are placeholders typed UNUSED
    assert f["tokenizer.ggml.tokens"][256:] == ["ab", "<|endoftext|>"] + [f"[PAD{i}]" for i in range(258, 300)]
    assert f["tokenizer.ggml.token_type"][255:] == [1, 1, 3] + [5] * 42
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cl100k.gguf", "ok.pt", "post.pt"]


def test_gguf_export_replaces_only_its_own_files_and_never_its_input(run, tmp_path, capsys):
    from ferrolm.app.cli import main

    ckpt, _, _ = run

    def export(out, *extra):
        code = main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--format", "gguf", *extra])
        return code, capsys.readouterr().err

    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    code, err = export(precious)
    assert code == 2 and precious.read_text() == "mine"
    assert f"--out {precious} exists and is not a GGUF file written by ferrolm" in err and "--force" in err
    foreign = tmp_path / "foreign.gguf"  # a GGUF of someone else's: no ferrolm.version field
    w = gguf.GGUFWriter(foreign, "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert export(foreign)[0] == 2 and not is_ferrolm_gguf(foreign)
    out = tmp_path / "m.gguf"
    assert export(out)[0] == 0 and is_ferrolm_gguf(out)
    assert export(out, "--dtype", "float16")[0] == 0  # an earlier export: replaced
    assert export(precious, "--force")[0] == 0 and is_ferrolm_gguf(precious)
    before = ckpt.read_bytes()
    code, err = export(ckpt, "--force")  # its own input: never, even forced
    assert code == 2 and ckpt.read_bytes() == before
    assert f"--out {ckpt} is {ckpt}, which this command reads" in err
    folder = tmp_path / "full"
    (folder / "sub").mkdir(parents=True)
    for where in (folder, "."):  # a folder: the message names it and what to give
        code, err = export(where)
        assert (
            code == 2 and f"--out {where} is a folder: give a file name, e.g. --out {Path(where) / 'model.gguf'}" in err
        )
        assert ".tmp" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign.gguf", "full", "m.gguf", "precious.txt"]


def test_export_cli_gguf(run, tmp_path, capsys):
    from ferrolm.app.cli import main

    ckpt, _, _ = run
    out = tmp_path / "cli.gguf"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--format", "gguf"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    arch = "qwen3" if load_model(ckpt, tokenizer=False)[0].config.qk_norm else "llama"
    assert _fields(gguf.GGUFReader(out))["general.architecture"] == arch
    argv = ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x.gguf"), "--format", "gguf"]
    for dtype, qtype in (("q8_0", Q.Q8_0), ("bfloat16", Q.BF16), ("f16", Q.F16)):
        assert main(argv + ["--dtype", dtype]) == 0
        tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "x.gguf").tensors}
        assert tensors["blk.0.attn_q.weight"].tensor_type == qtype
    with pytest.raises(SystemExit) as e:  # argparse's own error: the allowed values named
        main(argv + ["--dtype", "int4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --dtype: invalid choice: 'int4'" in err and "q8_0" in err
    hf = ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]
    assert main(hf + ["--dtype", "q8_0"]) == 2  # GGUF's alone
    assert "dtype must be one of float32, bfloat16, float16, got 'q8_0'" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert main(hf + ["--dtype", "bf16"]) == 0  # a short name is the HF export's long one
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_llama_cpp_runs_the_files_with_ferrolms_tokens_and_logits(tmp_path):
    """Every run's file in llama.cpp itself (one test: one skip where it is not installed)."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp)"
    )
    for name, switches in RUNS.items():
        _check_in_llama_cpp(llama_cpp, *tiny_run(tmp_path / name, **switches)[:2], tmp_path / f"{name}.gguf")


def _check_in_llama_cpp(llama_cpp, ckpt, tok, path):
    out = export_gguf(ckpt, path)
    model, _, _ = load_model(ckpt, tokenizer=False)
    L = model.config.context_length
    f32 = llama_cpp.GGML_TYPE_F32  # llama.cpp's KV cache is float16 unless told: logits would differ by ~1e-3
    llm = llama_cpp.Llama(
        model_path=str(out), n_ctx=L, n_batch=L, n_threads=1, logits_all=True, type_k=f32, type_v=f32, verbose=False
    )
    ids = tok.encode(PROMPT)
    assert llm.tokenize(PROMPT.encode(), add_bos=False) == ids
    assert llm.detokenize(ids).decode() == PROMPT

    want = list(generate(model, ids, L - len(ids), temperature=0.0, eos_id=tok.eos_id))
    got = []
    llm.reset()
    llm.eval(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].numpy()
    np.testing.assert_allclose(np.asarray(llm.scores[: len(ids)]), logits, atol=1e-4, rtol=0)
    while len(got) < len(want):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        got.append(t)
        if t == tok.eos_id:
            break
        llm.eval([t])
    llm.close()
    assert got == want and len(want) > 10

"""ferrolm.lm.gguf_export: the GGUF file read back with the gguf package's own reader holds
every weight and tokenizer field as llama.cpp's "llama" architecture names them; llama.cpp
itself (llama-cpp-python, when installed) tokenizes as ferrolm does and greedily continues
a prompt with ferrolm's tokens."""

from __future__ import annotations

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
from ferrolm.lm.gguf_export import export_gguf, is_ferrolm_gguf

torch.set_num_threads(1)
PROMPT = "The parser reads the command line and"


@pytest.fixture(scope="module", params=["untied", "tied"])
def run(request, tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp(request.param), tie_embeddings=request.param == "tied")


def _fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gguf_reads_back_every_tensor_and_field(run, tmp_path, dtype):
    ckpt, tok, _ = run
    out = export_gguf(ckpt, tmp_path / "m.gguf", dtype=dtype)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary left
    model, _, _ = load_model(ckpt, tokenizer=False)
    cfg = model.config
    reader = gguf.GGUFReader(out)
    f = _fields(reader)

    special = {i: s for s, i in tok.special_token_ids.items()}
    tokens = [special.get(i) or token_to_str(tok.vocab[i]) for i in range(cfg.vocab_size)]
    want = {
        "general.architecture": "llama",
        "general.name": "m",
        "ferrolm.version": ferrolm.__version__,
        "general.file_type": 1 if dtype == "float16" else 0,
        "llama.vocab_size": cfg.vocab_size,
        "llama.context_length": cfg.context_length,
        "llama.embedding_length": cfg.d_model,
        "llama.block_count": cfg.num_layers,
        "llama.feed_forward_length": cfg.d_ff,
        "llama.attention.head_count": cfg.num_heads,
        "llama.attention.head_count_kv": cfg.num_heads,
        "llama.rope.dimension_count": cfg.d_model // cfg.num_heads,
        "llama.rope.freq_base": pytest.approx(cfg.rope_theta),
        "llama.attention.layer_norm_rms_epsilon": pytest.approx(cfg.norm_eps),
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

    sd = model.state_dict()
    names = {"token_embd.weight": "token_embeddings.weight", "output_norm.weight": "ln_final.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    ours = {
        "attn_norm": "ln1",
        "attn_q": "attn.q_proj",  # as it is: llama.cpp's "llama" RoPE rotates pairs, as ferrolm's does
        "attn_k": "attn.k_proj",
        "attn_v": "attn.v_proj",
        "attn_output": "attn.output_proj",
        "ffn_norm": "ln2",
        "ffn_gate": "ffn.w1",
        "ffn_up": "ffn.w3",
        "ffn_down": "ffn.w2",
    }
    for i in range(cfg.num_layers):
        for theirs, name in ours.items():
            names[f"blk.{i}.{theirs}.weight"] = f"layers.{i}.{name}.weight"
    tensors = {t.name: t for t in reader.tensors}
    assert sorted(tensors) == sorted(names)
    for key, name in names.items():
        t, w = tensors[key], sd[name].numpy()
        gain = w.ndim == 1
        expect = gguf.GGMLQuantizationType.F16 if dtype == "float16" and not gain else gguf.GGMLQuantizationType.F32
        assert t.tensor_type == expect, key
        assert list(t.shape) == list(reversed(w.shape)), key  # GGUF lists the innermost dimension first
        data = np.asarray(t.data).reshape(w.shape)
        np.testing.assert_array_equal(data, w.astype(data.dtype), err_msg=key)


def test_gguf_refuses_what_llama_cpp_cannot_express(tmp_path):
    from ferrolm import Tokenizer
    from ferrolm.lm.checkpoint import save_checkpoint
    from ferrolm.lm.model import TransformerLM

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    model = TransformerLM(300, 16, 32, 1, 4, 64, norm_position="post")
    save_checkpoint(model, None, 0, tmp_path / "post.pt", config={"model": model.config.to_dict()})
    with pytest.raises(ValueError, match="model.norm_position = 'post'"):
        export_gguf(tmp_path / "post.pt", tmp_path / "post.gguf", tok)
    # each switch by name, in llama.cpp's terms, with the preset that trains an exportable model
    for switches, names in (
        ({"qk_norm": True}, "model.qk_norm = True"),
        ({"num_kv_heads": 2}, "model.num_kv_heads = 2"),
        ({"value_embeds": True, "logit_softcap": 15.0}, "model.logit_softcap = 15.0, model.value_embeds = True"),
    ):
        model = TransformerLM(300, 16, 32, 1, 4, 64, **switches)
        save_checkpoint(model, None, 0, tmp_path / "s.pt", config={"model": model.config.to_dict()})
        with pytest.raises(ValueError) as e:
            export_gguf(tmp_path / "s.pt", tmp_path / "s.gguf", tok)
        message = str(e.value)
        assert message.startswith(names + ": llama.cpp's llama architecture, the one ferrolm writes to GGUF")
        assert "cannot be exported as GGUF; train with --config cs336" in message and "Hugging Face" not in message
    (tmp_path / "s.pt").unlink()
    model = TransformerLM(300, 16, 32, 1, 4, 64)
    save_checkpoint(model, None, 0, tmp_path / "ok.pt", config={"model": model.config.to_dict()})
    custom = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"], pattern=r"\w+|\s+|[^\w\s]+")
    with pytest.raises(ValueError, match="custom regex"):
        export_gguf(tmp_path / "ok.pt", tmp_path / "custom.gguf", custom)
    with pytest.raises(ValueError, match="dtype must be one of float32, float16"):
        export_gguf(tmp_path / "ok.pt", tmp_path / "bf16.gguf", tok, dtype="bfloat16")
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
    assert _fields(gguf.GGUFReader(out))["general.architecture"] == "llama"
    argv = ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x.gguf"), "--format", "gguf"]
    assert main(argv + ["--dtype", "bfloat16"]) == 2
    assert "dtype must be one of float32, float16" in capsys.readouterr().err


def test_llama_cpp_runs_the_file_with_ferrolms_tokens_and_logits(run, tmp_path):
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp)"
    )
    ckpt, tok, _ = run
    out = export_gguf(ckpt, tmp_path / "m.gguf")
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

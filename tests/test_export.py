"""ferrolm.lm.export: an exported folder runs in transformers with no ferrolm code, with
ferrolm's logits and greedy tokens; the safetensors weights file loads back in ferrolm."""

from __future__ import annotations

import json

import pytest
import torch
from shard_util import trained_run

from ferrolm.lm.checkpoint import load_model
from ferrolm.lm.config import load_config
from ferrolm.lm.export import _is_ferrolm_safetensors, export_hf
from ferrolm.lm.generate import generate

torch.set_num_threads(1)
# The Llama-shaped recipe at the cpu-small size (the cpu-small preset itself has value
# embeddings, which no exported architecture computes)
CS336 = {k: v for k, v in vars(load_config("cs336").model).items() if k != "vocab_size"}
TINY_TIED = dict(
    context_length=32, d_model=32, num_layers=2, num_heads=4, d_ff=64, rope_theta=5000.0, tie_embeddings=True
)
# Llama with grouped-query attention, tied; Qwen3 for QK-norm (with GQA and zero-initialised outputs)
MODELS = {
    "cs336": CS336,
    "tiny-tied-gqa": {**TINY_TIED, "num_kv_heads": 2},
    "tiny-qk-norm": {
        **TINY_TIED,
        "tie_embeddings": False,
        "num_kv_heads": 1,
        "qk_norm": True,
        "zero_init_output": True,
    },
}


@pytest.fixture(scope="module", params=list(MODELS))
def run(request, tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp(request.param), MODELS[request.param], steps=3)


def test_export_loads_in_transformers_with_equal_logits_and_greedy_text(run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    run_dir, tok, _ = run
    ckpt = run_dir / "best.pt"
    if load_model(ckpt)[0].config.qk_norm and not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip("transformers before 4.51 has no Qwen3")
    out = export_hf(ckpt, tmp_path / "hf")  # the tokenizer comes from the run's config
    ours, _, _ = load_model(ckpt)
    cfg = ours.config
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    arch = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    assert type(hf).__name__ == arch and hf.config.tie_word_embeddings == cfg.tie_embeddings
    assert hf.config.num_key_value_heads == cfg.kv_heads
    assert hf.config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf_tok.model_max_length == cfg.context_length and hf_tok.eos_token_id == tok.eos_id
    text = "Once upon a time, there was a little girl named Lily. She liked to play"
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    with torch.no_grad():
        x = torch.tensor([ids])
        assert (ours(x) - hf(x).logits).abs().max().item() < 1e-5
        n = cfg.context_length - len(ids)
        want = list(generate(ours, ids, n, temperature=0.0, eos_id=tok.eos_id))
        got = hf.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
    assert got[0, len(ids) :].tolist() == want
    from ferrolm.app.cli import main

    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(ckpt), "--prompt", text, "--temperature", "0", "--max-new-tokens", str(n)]
    assert main(argv + ["--seed", "0", "--device", "cpu"]) == 0  # no --tokenizer: the run's config names it
    printed = capsys.readouterr().out
    assert printed == text + tok.decode([t for t in want if t != tok.eos_id]) + "\n"
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["architectures"] == [arch]
    assert cfg_json["max_position_embeddings"] == cfg.context_length


def test_export_refuses_by_name_what_no_exported_architecture_expresses(tmp_path):
    from ferrolm.lm.checkpoint import save_checkpoint
    from ferrolm.lm.model import TransformerLM

    model = TransformerLM(300, 16, 32, 1, 4, 64, norm_position="post")
    save_checkpoint(model, None, 0, tmp_path / "post.pt", config={"model": model.config.to_dict()})
    from ferrolm import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    # without remote code (by default such a model gets ferrolm's modeling file: tests/test_hf_remote.py)
    with pytest.raises(ValueError, match="model.norm_position = 'post'"):
        export_hf(tmp_path / "post.pt", tmp_path / "out", tok, remote_code=False)
    assert not (tmp_path / "out").exists()
    for switch, name in (
        ({"ffn": "relu2"}, "model.ffn = 'relu2'"),
        ({"logit_softcap": 30.0}, "model.logit_softcap = 30.0"),
    ):
        model = TransformerLM(300, 16, 32, 1, 4, 64, qk_norm=True, **switch)
        save_checkpoint(model, None, 0, tmp_path / "s.pt", config={"model": model.config.to_dict()})
        with pytest.raises(ValueError, match=f"{name}.*cannot be exported without remote code"):
            export_hf(tmp_path / "s.pt", tmp_path / "out", tok, remote_code=False)
        assert not (tmp_path / "out").exists()


def test_export_cli_and_safetensors_roundtrip(run, tmp_path):
    from ferrolm.app.cli import main

    run_dir, tok, _ = run
    ckpt = run_dir / "best.pt"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "merges.txt", "vocab.json", "tokenizer.json"]
        + ["tokenizer_config.json", "special_tokens_map.json", "ferrolm_tokenizer.json"]
    )
    assert (
        main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "w.safetensors"), "--format", "safetensors"])
        == 0
    )
    a, _, _ = load_model(ckpt)
    b, _, _ = load_model(tmp_path / "w.safetensors", tokenizer=tok)
    ids = torch.tensor([tok.encode("The cat sat.")])
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))
    # an existing folder with other files is never replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "mine")]) == 2


def test_export_replaces_only_an_earlier_export_of_the_same_model(tmp_path, capsys):
    from ferrolm import Tokenizer
    from ferrolm.app.cli import main
    from ferrolm.lm.checkpoint import save_checkpoint
    from ferrolm.lm.model import TransformerLM

    for name, d_model in (("a.pt", 32), ("b.pt", 64)):
        model = TransformerLM(300, 16, d_model, 1, 4, 64)
        save_checkpoint(model, None, 0, tmp_path / name, config={"model": model.config.to_dict()})
    tokdir = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tmp_path / "tok")
    before = {p.name: p.read_bytes() for p in tokdir.iterdir()}

    def export(ckpt, out, *extra):
        argv = ["export", "--checkpoint", str(tmp_path / ckpt), "--out", str(out), "--tokenizer", str(tokdir)]
        code = main(argv + list(extra))
        return code, capsys.readouterr().err

    other_tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tmp_path / "tok2")
    code, err = export("a.pt", other_tok)  # over a tokenizer folder: refused, the folder untouched
    assert code == 2 and "holds a tokenizer folder" in err and "--force" in err
    for extra in ((), ("--force",)):  # over the tokenizer folder it reads: never
        code, err = export("a.pt", tokdir, *extra)
        assert code == 2 and f"--out {tokdir} is {tokdir}, which this command reads" in err
    assert {p.name: p.read_bytes() for p in tokdir.iterdir()} == before
    out = tmp_path / "hf"
    assert export("a.pt", out)[0] == 0
    assert export("a.pt", out, "--dtype", "bfloat16")[0] == 0  # an earlier export of the same model
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    code, err = export("b.pt", out)  # another model
    assert code == 2 and "holds an export of another model or tokenizer" in err
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32
    with pytest.raises(FileExistsError, match="force=True"):
        export_hf(tmp_path / "b.pt", out, tokdir)
    assert export("b.pt", out, "--force")[0] == 0
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
    assert export_hf(tmp_path / "a.pt", other_tok, tokdir, force=True) == other_tok  # the API's keyword
    (out / "notes.txt").write_text("mine")  # files an export does not write: never replaced
    code, err = export("b.pt", out, "--force")
    assert code == 2 and "notes.txt" in err and (out / "notes.txt").exists()


def test_exports_never_replace_their_input_nor_a_file_they_did_not_write(tmp_path, capsys, monkeypatch):
    from ferrolm.app.cli import main

    (tmp_path / "m").mkdir()
    run_dir, _, _ = trained_run(tmp_path / "m", TINY_TIED, steps=1)
    (best,) = (run_dir / "checkpoints").iterdir()  # what loading the run folder reads
    before = best.read_bytes()

    def export(out, *extra):
        code = main(["export", "--checkpoint", str(run_dir), "--out", str(out), *extra])
        return code, capsys.readouterr().err

    # the checkpoint inside the run folder it was given, and the run folder itself: never
    for out, fmt in ((best, "safetensors"), (best, "hf"), (run_dir, "hf")):
        code, err = export(out, "--format", fmt, "--force")
        assert code == 2 and "which this command reads" in err and "--force never replaces" in err
    assert best.read_bytes() == before
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    code, err = export(precious, "--format", "safetensors")
    assert code == 2 and precious.read_text() == "mine"
    assert f"--out {precious} exists and is not a safetensors file written by ferrolm" in err and "--force" in err
    weights = tmp_path / "new" / "w.safetensors"  # its folder is made
    assert export(weights, "--format", "safetensors")[0] == 0
    assert export(weights, "--format", "safetensors")[0] == 0  # an earlier export: replaced
    assert export(precious, "--format", "safetensors", "--force")[0] == 0
    assert _is_ferrolm_safetensors(precious)
    code, err = export(weights.parent, "--format", "safetensors")
    assert (
        code == 2
        and f"--out {weights.parent} is a folder: give a file name, e.g. --out {weights.parent / 'model.safetensors'}"
        in err
    )
    # --out . names the folder given and what to do, never a hidden temporary path
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    code, err = export(".")
    assert code == 2 and "--out . is the current folder" in err and "--out hf_model" in err and ".tmp" not in err
    assert list(empty.iterdir()) == []
    monkeypatch.chdir(weights.parent)  # not empty
    code, err = export(".")
    assert code == 2 and "--out . is the current folder" in err

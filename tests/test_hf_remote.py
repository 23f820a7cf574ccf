"""Hugging Face export through ferrolm's own modeling file: a model that no transformers
architecture computes (every switch the presets turn on) loads with trust_remote_code=True
and gives ferrolm's logits and greedy tokens, with and without transformers' cache; the
folder loads back in ferrolm."""

from __future__ import annotations

import ast
import dataclasses
import json

import pytest
import torch
from tiny_lm import tiny_run

from ferrolm.lm.checkpoint import CheckpointError, load_model, save_checkpoint
from ferrolm.lm.config import ModelConfig, load_config
from ferrolm.lm.export import export_hf
from ferrolm.lm.generate import generate
from ferrolm.lm.hf_remote import MODELING_FILE, is_remote_folder, modeling_source
from ferrolm.lm.model import TransformerLM

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

_SHAPE = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta")
# The switches the cpu-small preset turns on (tinystories and owt: the same less the bigram
# table), the bigram table at a test's size
PRESET = {k: v for k, v in vars(load_config("cpu-small").model).items() if k not in _SHAPE} | {"bigram_buckets": 512}
COMBOS = {
    "presets": PRESET,
    "presets-gqa-tied": {**PRESET, "num_kv_heads": 2, "tie_embeddings": True},
    "post-norm-silu-value-embeds": {"norm_position": "post", "ffn": "silu", "d_ff_ungated": 48, "value_embeds": True},
    "no-norm-no-positions": {"norm": "none", "positions": "none", "x0_mix": True, "logit_softcap": 30.0},
    "swiglu-softcap-mqa-mtp": {
        "logit_softcap": 15.0,
        "num_kv_heads": 1,
        "qk_norm": True,
        "mtp_weight": 0.5,
        "mtp_depth": 2,
    },
    # the transformer preset's parts (its width aside)
    "original-transformer": {
        **{k: v for k, v in vars(load_config("transformer").model).items() if k not in _SHAPE},
        "d_ff_ungated": 48,
    },
    "learned-positions-layernorm": {"positions": "learned", "norm": "layer", "ffn": "relu", "d_ff_ungated": 40},
    # the speedrun's U-net skip, attention gate and short window (layer 0 short, the last long)
    "presets-unet-gate-short-window": {**PRESET, "unet_skips": True, "attn_gate": True, "short_window": 5},
    "embed-norm-qk-gains-value-embeds": {
        "embed_norm": True,
        "qk_norm": True,
        "qk_norm_gain": True,
        "value_embeds": True,
    },
    "smear-bigram": {**PRESET, "smear": True, "bigram_buckets": 64},
}


def test_the_presets_switches_are_the_ones_tested():
    assert PRESET["value_embeds"] and PRESET["x0_mix"] and PRESET["ffn"] == "relu2"
    assert load_config("cpu-small").model.bigram_buckets > 0  # tested here with a smaller table
    for name in ("tinystories", "owt"):  # cpu-small's switches less the bigram table
        switches = {k: v for k, v in vars(load_config(name).model).items() if k not in _SHAPE}
        assert switches == PRESET | {"bigram_buckets": 0}, name


@pytest.fixture(scope="module", params=list(COMBOS))
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    switches = dict(COMBOS[request.param])
    tie = switches.pop("tie_embeddings", False)
    ckpt, tok, text = tiny_run(root, tie_embeddings=tie, **switches)
    return ckpt, tok, text, export_hf(ckpt, root / "hf"), request.param


def _cache_kwarg() -> str:
    """The name of generate's cache argument: "cache" in transformers 5, "past_key_values" before."""
    fields = {f.name for f in dataclasses.fields(transformers.modeling_outputs.CausalLMOutputWithPast)}
    return "cache" if "cache" in fields else "past_key_values"


def _hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), trust_remote_code=True, dtype=torch.float32
    ).eval()


def test_remote_code_export_gives_ferrolms_logits_and_greedy_tokens(exported):
    ckpt, tok, text, out, _ = exported
    ours = load_model(ckpt).model
    found = json.loads((out / "config.json").read_text())
    assert found["model_type"] == "ferrolm" and found["auto_map"]["AutoModelForCausalLM"].startswith(
        "modeling_ferrolm."
    )
    assert (out / MODELING_FILE).read_bytes() == modeling_source()
    hf = _hf(out)
    assert type(hf).__name__ == "FerroLMForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text[:200])["input_ids"] == tok.encode(text[:200])
    ids = tok.encode(text)[:60]
    with torch.no_grad():
        x = torch.tensor([ids])
        full = hf(x).logits
        assert (ours(x) - full).abs().max().item() < 1e-5
        # the cache path: a prefix, then the rest against its cache, is the whole
        first = hf(x[:, :40], use_cache=True)
        rest = hf(x[:, 40:], use_cache=True, **{_cache_kwarg(): getattr(first, _cache_kwarg())}).logits
        assert (rest - full[:, 40:]).abs().max().item() < 1e-5
        prompt = ids[:10]
        want = list(generate(ours, prompt, 20, temperature=0.0))
        cache = transformers.DynamicCache()
        args = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_id)
        cached = hf.generate(torch.tensor([prompt]), **args, **{_cache_kwarg(): cache})
        uncached = hf.generate(torch.tensor([prompt]), **args, use_cache=False)
        static = hf.generate(torch.tensor([prompt]), **args, cache_implementation="static")
    assert cache.get_seq_length() == len(prompt) + 20 - 1  # every step but the last token went through it
    assert cached[0, len(prompt) :].tolist() == want == uncached[0, len(prompt) :].tolist()
    assert static[0, len(prompt) :].tolist() == want
    # ferrolm reads the folder back: the same model
    back, back_tok, info = load_model(out)
    assert back_tok.fingerprint == tok.fingerprint and info["tokenizer_source"] == out
    assert back.config == ours.config
    with torch.no_grad():
        assert torch.equal(back(x), ours(x))


def test_left_padded_batch_generates_as_each_prompt_alone(exported):
    _, tok, text, out, _ = exported
    hf = _hf(out)
    ids = tok.encode(text)
    long, short = ids[:9], ids[20:25]
    batch = torch.tensor([long, [tok.eos_id] * 4 + short])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    args = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_id)
    with torch.no_grad():
        both = hf.generate(batch, attention_mask=mask, **args)
        alone = hf.generate(torch.tensor([short]), **args)
    assert both[1, 9:].tolist() == alone[0, 5:].tolist()


def test_value_embeddings_sit_in_the_last_layer_and_every_second_before_it(tmp_path):
    from ferrolm import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    torch.manual_seed(0)
    model = TransformerLM(300, 32, 32, 3, 4, 64, **PRESET)
    with torch.no_grad():  # away from the zero and unit starts, which would hide a misplaced weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    save_checkpoint(model, None, 0, tmp_path / "m.pt", config={"model": model.config.to_dict()})
    out = export_hf(tmp_path / "m.pt", tmp_path / "hf", tok)
    hf = _hf(out)
    assert sorted(hf.value_embeddings.keys()) == ["0", "2"]
    x = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model.eval()(x) - hf(x).logits).abs().max().item() < 1e-5
        # labels give the mean next-token loss, as ferrolm's targets do
        assert abs(hf(x, labels=x).loss.item() - model(x[:, :-1], targets=x[:, 1:]).item()) < 1e-5
        with pytest.raises(ValueError, match="needs input_ids"):
            hf(inputs_embeds=torch.zeros(1, 4, 32))
    # what transformers saves of it (after fine-tuning there, say) loads back in ferrolm
    hf.save_pretrained(tmp_path / "resaved")
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "resaved", tokenizer=False).model(x), model(x))


def test_smear_and_bigram_embeddings_in_every_generation_path(tmp_path):
    from ferrolm import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    torch.manual_seed(0)
    model = TransformerLM(300, 32, 32, 2, 4, 64, smear=True, bigram_buckets=37, embed_norm=True).eval()
    with torch.no_grad():  # away from the zero starts, which would hide a term left out
        for name in ("smear_gate", "smear_lambda", "bigram_embeddings.weight"):
            p = model.get_parameter(name)
            p.copy_(torch.randn_like(p))
    save_checkpoint(model, None, 0, tmp_path / "m.pt", config={"model": model.config.to_dict()})
    hf = _hf(export_hf(tmp_path / "m.pt", tmp_path / "hf", tok))
    x = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    args = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        full = hf(x).logits
        assert (model(x) - full).abs().max().item() < 1e-5
        first = hf(x[:, :9], use_cache=True)  # the rest against the cache: the token before it is the cache's
        rest = hf(x[:, 9:], use_cache=True, **{_cache_kwarg(): getattr(first, _cache_kwarg())}).logits
        assert (rest - full[:, 9:]).abs().max().item() < 1e-5
        prompt = x[:1, :7]
        want = list(generate(model, prompt[0].tolist(), 12, temperature=0.0))
        plain = TransformerLM(300, 32, 32, 2, 4, 64, embed_norm=True).eval()
        plain.load_state_dict(model.state_dict(), strict=False)  # the same model less the new terms
        assert (plain(x) - full).abs().max().item() > 0.1
        for how in (dict(use_cache=True), dict(use_cache=False), dict(cache_implementation="static")):
            assert hf.generate(prompt, **args, **how)[0, 7:].tolist() == want, how
        # a left-padded row: its first real token has no previous token, as when alone
        batch = torch.cat([x[1:, :7], torch.cat([torch.zeros(1, 3, dtype=torch.long), x[1:, :4]], dim=1)])
        mask = torch.ones_like(batch)
        mask[1, :3] = 0
        both = hf.generate(batch, attention_mask=mask, **args)
        assert both[1, 7:].tolist() == hf.generate(x[1:, :4], **args)[0, 4:].tolist()
        assert both[1, 7:].tolist() == list(generate(model, x[1, :4].tolist(), 12, temperature=0.0))
        beams = hf.generate(prompt, **args, num_beams=3, use_cache=True)
        assert beams[0, 7:].tolist() == hf.generate(prompt, **args, num_beams=3, use_cache=False)[0, 7:].tolist()


def test_cli_says_trust_remote_code_and_refuses_with_no_remote_code(exported, tmp_path, capsys):
    from ferrolm.app.cli import main

    ckpt, tok, text, _, combo = exported
    out = tmp_path / "hf"
    argv = ["export", "--checkpoint", str(ckpt), "--out", str(out)]
    capsys.readouterr()
    assert main(argv + ["--no-remote-code"]) == 2
    err = capsys.readouterr().err
    assert "cannot be exported without remote code" in err and not out.exists()
    names = ("norm", "norm_position", "positions", "ffn", "logit_softcap", "value_embeds", "x0_mix", "smear")
    for name in (*names, "bigram_buckets"):
        if COMBOS[combo].get(name, getattr(ModelConfig(), name)) != getattr(ModelConfig(), name):
            assert f"model.{name} = {COMBOS[combo][name]!r}" in err
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == str(out) and "trust_remote_code=True" in printed.err
    assert main(argv + ["--dtype", "bfloat16"]) == 0  # an earlier export of the same model is replaced
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert is_remote_folder(out) and (out / MODELING_FILE).is_file()
    assert main(argv) == 0
    capsys.readouterr()
    # ferrolm generate reads the folder as it reads the checkpoint
    gen = ["generate", "--prompt", text[:40], "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    assert main(gen + ["--checkpoint", str(ckpt)]) == 0
    want = capsys.readouterr().out
    assert main(gen + ["--checkpoint", str(out)]) == 0
    assert capsys.readouterr().out == want


def test_a_native_model_still_exports_as_llama(tmp_path):
    from ferrolm import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    model = TransformerLM(300, 16, 32, 1, 4, 64)
    save_checkpoint(model, None, 0, tmp_path / "m.pt", config={"model": model.config.to_dict()})
    out = export_hf(tmp_path / "m.pt", tmp_path / "hf", tok)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert not (out / MODELING_FILE).exists() and not is_remote_folder(out)


def test_a_damaged_remote_folder_is_refused_by_name(exported, tmp_path):
    import shutil

    _, _, _, out, _ = exported
    copy = shutil.copytree(out, tmp_path / "copy")
    found = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**found, "ffn": "gelu"}))
    with pytest.raises(CheckpointError, match=r"config.json: not a usable ferrolm model config.*model\.ffn"):
        load_model(copy)
    (copy / "config.json").write_text(json.dumps(found))
    (copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(CheckpointError, match="model.safetensors is not readable"):
        load_model(copy)


def test_the_modeling_file_needs_no_ferrolm_and_knows_every_model_setting():
    tree = ast.parse(modeling_source())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported and not any(name.split(".")[0] == "ferrolm" for name in imported), imported
    (fields,) = [
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "FERROLM_FIELDS"
    ]
    # a new switch of ferrolm's model must be computed (or knowingly ignored) by the modeling file
    assert fields == ModelConfig(vocab_size=0).to_dict()

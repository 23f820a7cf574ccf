"""Starting a run from weights (run.init_from, --init-from) and Hugging Face import/export for
Llama, Qwen3 and transformers' nanochat.

A tiny ferrolm pipeline (a tokenizer trained on generated stories, shards encoded with it, a
source run of a few steps) is shared by the module; transformers models are built tiny and
random with transformers itself, saved with ``save_pretrained``, and held to equal logits.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from shard_util import write_shard
from texts import stories_text

from ferrolm import Tokenizer
from ferrolm.bpe import shards as shard_writer
from ferrolm.lm.chat import CHAT_TOKENS, has_chat_tokens
from ferrolm.lm.checkpoint import CheckpointError, initial_weights, load_model, read_checkpoint, save_checkpoint
from ferrolm.lm.config import ConfigError, TrainConfig
from ferrolm.lm.data import ShardError
from ferrolm.lm.hf import hf_architecture
from ferrolm.lm.metrics import read_metrics
from ferrolm.lm.model import ModelConfig, TransformerLM
from ferrolm.lm.train import setup_distributed, setup_run, train

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)
SOURCE_MODEL = {"context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}
RUN = {
    "device": "cpu",
    "autocast_bf16": False,
    "compile": False,
    "eval_every": 4,
    "eval_batches": 1,
    "log_every": 2,
    "checkpoint_every": 4,
    "progress": False,
    "num_threads": 1,
    "seed": 3,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(root, tokenizer): root holds tok/, train and val shards, and src/, a 4-step run."""
    root = tmp_path_factory.mktemp("init")
    text = stories_text(60_000)
    (root / "train.txt").write_text(text[:50_000], encoding="utf-8")
    (root / "val.txt").write_text(text[50_000:], encoding="utf-8")
    tok = Tokenizer.train(str(root / "train.txt"), 300, ["<|endoftext|>"], progress=False)
    tok.save(root / "tok")
    for name in ("train", "val"):
        shard_writer.encode(tok, [root / f"{name}.txt"], root / name, progress=False)
    cfg = TrainConfig()
    cfg.update(
        {
            "model": {"vocab_size": tok.vocab_size, **SOURCE_MODEL},
            "data": {"train": str(root / "train"), "val": str(root / "val"), "tokenizer": str(root / "tok")},
            "schedule": {"max_steps": 4, "warmup_steps": 1, "batch_size": 2},
            "run": {**RUN, "out_dir": str(root / "src")},
        }
    )
    assert train(cfg.validate()).status == "done"
    return root, tok


def init_config(base, out, source, **sections) -> TrainConfig:
    """A run from ``source``: data and run settings only, the model left to the source."""
    root, _ = base
    cfg = TrainConfig()
    cfg.update(
        {
            "data": {"train": str(root / "train"), "val": str(root / "val")},
            "schedule": {"max_steps": 8, "warmup_steps": 1, "batch_size": 2},
            "run": {**RUN, "out_dir": str(out), "init_from": str(source)},
        }
    )
    cfg.update(sections)
    return cfg.validate()


def started(cfg: TrainConfig):
    """(model state dict, run state, optimizer state) of a run set up but not stepped."""
    run, state = setup_run(cfg, setup_distributed("cpu"), None)
    try:
        return run.raw_model.state_dict(), state, run.optimizer.state_dict()["state"]
    finally:
        run.batches.close()
        run.loggers.close()


def weights_of(path) -> dict:
    return load_model(path, tokenizer=False).model.state_dict()


def assert_same_weights(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------ source kinds ------------


def _source(kind: str, base, tmp_path) -> Path:
    from ferrolm.lm.export import export_hf, export_safetensors

    src = base[0] / "src"
    if kind == "run folder":
        return src
    if kind == "checkpoint file":
        return src / "checkpoints" / "step_00000004.pt"
    if kind == "safetensors":
        return export_safetensors(src / "best.pt", tmp_path / "w.safetensors")
    return export_hf(src, tmp_path / "hf")  # an exported Hugging Face folder


@pytest.mark.parametrize("kind", ["run folder", "checkpoint file", "safetensors", "exported HF folder"])
def test_each_source_kind_starts_a_new_run_from_its_weights(base, tmp_path, kind):
    root, tok = base
    source = _source(kind, base, tmp_path)
    cfg = init_config(base, tmp_path / "run", source)
    weights, state, opt_state = started(cfg)
    assert_same_weights(weights, weights_of(root / "src"))
    assert state.step == 0 and opt_state == {}  # a fresh optimizer and schedule
    want = ModelConfig(vocab_size=tok.vocab_size, **SOURCE_MODEL, num_kv_heads=cfg.model.num_kv_heads)
    assert cfg.model.to_dict() == want.to_dict() and cfg.model.kv_heads == 2  # an HF folder says 2, not 0
    # the run folder carries the tokenizer; its config names it
    assert Path(cfg.data.tokenizer) == tmp_path / "run" / "tokenizer"
    assert Tokenizer.load(cfg.data.tokenizer).fingerprint == tok.fingerprint


def test_a_run_from_weights_trains_and_its_model_finds_the_tokenizer(base, tmp_path):
    root, tok = base
    summary = train(init_config(base, tmp_path / "run", root / "src", schedule={"max_steps": 2}))
    assert summary.status == "done" and summary.step == 2
    first = read_metrics(tmp_path / "run")[0]
    source_val = read_metrics(root / "src")[-1]["val_loss"]
    assert first["step"] == 0 and first["val_loss"] == pytest.approx(source_val, abs=1e-6)  # the source's model
    model, found, info = load_model(tmp_path / "run")
    assert found.fingerprint == tok.fingerprint and Path(info["tokenizer_source"]).name == "tokenizer"
    ckpt = read_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000002.pt")
    assert ckpt["iteration"] == 2 and ckpt["config"]["run"]["init_from"] == str(root / "src")


def test_data_tokenizer_that_is_the_sources_is_kept(base, tmp_path):
    root, _ = base
    cfg = init_config(base, tmp_path / "run", root / "src", data={"tokenizer": str(root / "tok")})
    started(cfg)
    assert cfg.data.tokenizer == str(root / "tok") and not (tmp_path / "run" / "tokenizer").exists()


# ------------------------------------------------------------ refusals ----------------


def test_a_model_value_that_contradicts_the_source_is_refused_by_name(base, tmp_path):
    root, _ = base
    cfg = init_config(base, tmp_path / "run", root / "src")
    cfg.set("model.d_model", 512)  # the default value, but given: it contradicts the source's 32
    with pytest.raises(ConfigError, match=rf"model.d_model = 512 contradicts 32 of {root / 'src'}"):
        train(cfg)
    cfg = init_config(base, tmp_path / "run", root / "src", model={"ffn": "relu2"})
    with pytest.raises(ConfigError, match="model.ffn = 'relu2' contradicts 'swiglu'"):
        train(cfg)
    cfg = init_config(base, tmp_path / "run", root / "src", model={"context_length": 32})
    with pytest.raises(ConfigError, match="model.context_length = 32 is longer than 16"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_training_only_model_settings_and_a_shorter_context_are_allowed(base, tmp_path):
    root, tok = base
    free = {
        "attention": "reference",
        "doc_mask": True,
        "zero_init_output": True,
        "dropout": 0.1,
        "label_smoothing": 0.1,
        "context_length": 8,
    }
    cfg = init_config(base, tmp_path / "run", root / "src", model={**free, "vocab_size": 0})
    weights, _, _ = started(cfg)
    assert_same_weights(weights, weights_of(root / "src"))  # zero_init_output: the weights win
    assert cfg.model.to_dict() == {**ModelConfig(vocab_size=tok.vocab_size, **SOURCE_MODEL).to_dict(), **free}


def test_shards_of_another_tokenizer_are_refused(base, tmp_path):
    root, _ = base
    for name in ("train", "val"):  # another fingerprint
        write_shard(tmp_path / name, list(range(1, 200)) * 20, vocab_size=300)
    other = {"train": str(tmp_path / "train"), "val": str(tmp_path / "val")}
    cfg = init_config(base, tmp_path / "run", root / "src", data=other)
    with pytest.raises(ShardError, match=rf"tokenizer mismatch: shards {tmp_path / 'train'}"):
        train(cfg)


def test_data_tokenizer_of_another_tokenizer_is_refused(base, tmp_path):
    root, _ = base
    other = Tokenizer.train(iter([stories_text(5_000)]), 280, ["<|endoftext|>"], progress=False).save(tmp_path / "t")
    cfg = init_config(base, tmp_path / "run", root / "src", data={"tokenizer": str(other)})
    with pytest.raises(ShardError, match="tokenizer mismatch"):  # the shards are the source's
        train(cfg)
    for name in ("train", "val"):  # raw token files record no tokenizer: data.tokenizer is the check
        shutil.copy(root / f"{name}.bin", tmp_path / f"{name}.bin")
    raw = {"train": str(tmp_path / "train.bin"), "val": str(tmp_path / "val.bin"), "dtype": "uint16"}
    cfg = init_config(base, tmp_path / "run", root / "src", data={**raw, "tokenizer": str(other)})
    with pytest.raises(ConfigError, match=rf"data.tokenizer {other} is another tokenizer than that of run.init_from"):
        train(cfg)


def test_a_missing_or_unusable_source_is_named(base, tmp_path):
    root, _ = base
    with pytest.raises(FileNotFoundError, match=rf"run.init_from {tmp_path / 'nowhere'}"):
        train(init_config(base, tmp_path / "run", tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint in this folder"):
        train(init_config(base, tmp_path / "run", tmp_path / "empty"))
    # a checkpoint that names no tokenizer
    model = TransformerLM.from_config(ModelConfig(vocab_size=300, **SOURCE_MODEL))
    save_checkpoint(model, None, 0, tmp_path / "bare.pt", config={"model": model.config.to_dict()})
    with pytest.raises(CheckpointError, match="names no tokenizer"):
        initial_weights(tmp_path / "bare.pt")


def test_cli_init_from_trains_and_errors_exit_2_naming_the_path(base, tmp_path):
    root, _ = base
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["--set", f"data.train={root / 'train'}", "--set", f"data.val={root / 'val'}"]
    common += ["--set", "schedule.max_steps=2", "--set", "schedule.batch_size=2", "--set", "schedule.warmup_steps=1"]
    common += ["--set", "run.device=cpu", "--set", "run.progress=false", "--set", "run.eval_batches=1"]

    def cli(*args):
        cmd = [sys.executable, "-m", "ferrolm", "train", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)

    out = cli("--init-from", str(root / "src"), *common, "--set", f"run.out_dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()
    missing = cli("--init-from", str(tmp_path / "nowhere"), *common, "--set", f"run.out_dir={tmp_path / 'r2'}")
    assert missing.returncode == 2 and str(tmp_path / "nowhere") in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = cli("--init-from", str(root / "src"), *common, "--set", "model.num_layers=3", "--set", "run.out_dir=x")
    assert bad.returncode == 2 and "model.num_layers = 3 contradicts 2" in bad.stderr
    shown = cli("--init-from", str(root / "src"), "--print-config")  # the model the run will have
    assert shown.returncode == 0 and "d_model = 32\n" in shown.stdout and "num_layers = 2\n" in shown.stdout
    helped = cli("--help")
    assert "--init-from" in helped.stdout and "Qwen3" in helped.stdout


# ------------------------------------------------------------ resume ------------------


def test_resume_of_a_run_from_weights_is_bit_exact_and_never_reads_the_source(base, tmp_path):
    root, _ = base
    source = tmp_path / "source"
    shutil.copytree(root / "src", source)
    straight = train(init_config(base, tmp_path / "straight", source))
    assert straight.status == "done" and straight.step == 8

    def stop_at_4(step, record):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    first = train(init_config(base, tmp_path / "resumed", source), on_step=stop_at_4)
    assert first.status == "interrupted" and first.step == 4
    shutil.rmtree(source)  # resume uses the run's own checkpoint, never the source
    second = train(init_config(base, tmp_path / "resumed", source), resume=tmp_path / "resumed")
    assert second.status == "done" and second.step == 8

    def losses(run):
        return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run)]

    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    a = read_checkpoint(tmp_path / "straight" / "checkpoints" / "step_00000008.pt")["model"]
    b = read_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_00000008.pt")["model"]
    assert_same_weights(a, b)


# ------------------------------------------------------------ chat tokens -------------


def test_chat_tokens_extend_the_tokenizer_and_grow_the_weights_keeping_old_logits(base, tmp_path):
    root, tok = base
    cfg, state, chat_tok = initial_weights(root / "src", chat_tokens=True)
    assert has_chat_tokens(chat_tok) and chat_tok.vocab_size == tok.vocab_size + len(CHAT_TOKENS)
    assert cfg.vocab_size == chat_tok.vocab_size and state["lm_head.weight"].shape[0] == cfg.vocab_size
    grown = TransformerLM.from_config(cfg)
    grown.load_state_dict(state)
    source = load_model(root / "src", tokenizer=False).model
    ids = torch.tensor([tok.encode("Once upon a time there was a cat.")[:16]])
    with torch.no_grad():
        torch.testing.assert_close(grown(ids)[..., : tok.vocab_size], source(ids), rtol=0, atol=0)
    # weights that already have the chat tokens: nothing to add or grow
    chat_tok.save(tmp_path / "chat_tok")
    save_checkpoint(
        grown,
        None,
        0,
        tmp_path / "chat.pt",
        config={"model": cfg.to_dict(), "data": {"tokenizer": str(tmp_path / "chat_tok")}},
        tokenizer_fingerprint=chat_tok.fingerprint,
    )
    again, again_state, again_tok = initial_weights(tmp_path / "chat.pt", chat_tokens=True)
    assert again.vocab_size == cfg.vocab_size and again_tok.fingerprint == chat_tok.fingerprint
    assert_same_weights(again_state, grown.state_dict())
    plain_cfg, _, plain_tok = initial_weights(root / "src")
    assert plain_cfg.vocab_size == tok.vocab_size and not has_chat_tokens(plain_tok)


# ------------------------------------------------------------ Hugging Face ------------


def tiny_hf_model(kind: str, vocab_size: int, *, tie: bool = False, seed: int = 0):
    """A random transformers model of ``kind``, its norm gains away from 1 so that they count."""
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, head_dim=8))
    else:
        model = transformers.NanoChatForCausalLM(transformers.NanoChatConfig(**shape, final_logit_softcapping=5.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # nanochat has none: its norms are weightless
                p.normal_(1.0, 0.3)
    return model.float().eval()


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "nanochat"])
def test_a_transformers_folder_computes_transformers_logits(base, tmp_path, kind, tie):
    _, tok = base
    hf = tiny_hf_model(kind, tok.vocab_size, tie=tie)
    hf.save_pretrained(tmp_path / "hf")
    tok.save_hf(tmp_path / "hf" / "tokenizer.json")  # the HF file alone: no ferrolm record
    cfg, state, found = initial_weights(tmp_path / "hf")
    assert found.fingerprint == tok.fingerprint  # loaded through Tokenizer.from_hf
    model = TransformerLM.from_config(cfg)
    model.load_state_dict(state)
    model.eval()
    ids = torch.tensor([tok.encode("Once upon a time, a little dog found a red ball in the park.")[:40]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_logits(hf, ids), rtol=1e-5, atol=1e-5)
    assert cfg.qk_norm == (kind != "llama") and cfg.qk_norm_gain == (kind == "qwen3")
    assert cfg.embed_norm == (kind == "nanochat") and cfg.ffn == ("relu2" if kind == "nanochat" else "swiglu")
    assert hf_architecture(cfg) == kind
    # and back: ferrolm's export of that model is the same transformers model
    from ferrolm.lm.export import export_hf

    tok.save(tmp_path / "tok")
    save_checkpoint(model, None, 0, tmp_path / "m.pt", config={"model": cfg.to_dict()})
    out = export_hf(tmp_path / "m.pt", tmp_path / "out", tokenizer=tmp_path / "tok")
    again = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    torch.testing.assert_close(hf_logits(again, ids), hf_logits(hf, ids), rtol=1e-5, atol=1e-5)


def test_a_run_starts_from_a_transformers_folder(base, tmp_path):
    root, tok = base
    hf = tiny_hf_model("qwen3", tok.vocab_size)
    hf.save_pretrained(tmp_path / "hf")
    tok.save_hf(tmp_path / "hf" / "tokenizer.json")
    cfg = init_config(base, tmp_path / "run", tmp_path / "hf", model={"context_length": 16})
    summary = train(cfg)
    assert summary.status == "done" and cfg.model.d_model == 32 and cfg.model.context_length == 16
    model, found, _ = load_model(tmp_path / "run")
    assert found.fingerprint == tok.fingerprint and model.config.qk_norm_gain


def test_foreign_folders_ferrolm_cannot_compute_are_refused_by_name(base, tmp_path):
    _, tok = base
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2))
    gpt2.save_pretrained(tmp_path / "gpt2")
    tok.save_hf(tmp_path / "gpt2" / "tokenizer.json")
    with pytest.raises(CheckpointError, match="config.json says 'gpt2'"):
        initial_weights(tmp_path / "gpt2")
    hf = tiny_hf_model("llama", tok.vocab_size)
    hf.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    hf.save_pretrained(tmp_path / "scaled")
    with pytest.raises(CheckpointError, match="rope_parameters"):
        initial_weights(tmp_path / "scaled")


def test_a_nanochat_shaped_ferrolm_model_exports_to_transformers_nanochat(base, tmp_path):
    """ReLU², QK-norm, normalized embeddings, soft-capping and GQA: transformers' own
    NanoChatForCausalLM computes the logits; ferrolm's learned norm gains are folded into
    the matrices that read them (nanochat's norms have none)."""
    from ferrolm.lm.export import export_hf

    _, tok = base
    switches = dict(ffn="relu2", qk_norm=True, embed_norm=True, logit_softcap=10.0, num_kv_heads=1)
    cfg = ModelConfig(vocab_size=tok.vocab_size, **SOURCE_MODEL, **switches)
    torch.manual_seed(5)
    model = TransformerLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.normal_(1.0, 0.3)
    tok.save(tmp_path / "tok")
    save_checkpoint(model, None, 0, tmp_path / "m.pt", config={"model": cfg.to_dict()})
    out = export_hf(tmp_path / "m.pt", tmp_path / "out", tokenizer=tmp_path / "tok")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(hf).__name__ == "NanoChatForCausalLM"
    ids = torch.tensor([tok.encode("The cat sat on the mat and looked at the bird.")[:16]])
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(hf, ids), model(ids), rtol=1e-5, atol=1e-5)
    tied = TransformerLM.from_config(ModelConfig(**{**cfg.to_dict(), "tie_embeddings": True}))
    with torch.no_grad():
        tied.ln_final.weight.fill_(2.0)
    with pytest.raises(ValueError, match="ln_final.weight is not all ones and the LM head is tied"):
        from ferrolm.lm.hf import to_hf_state_dict

        to_hf_state_dict(tied)
    with pytest.raises(ValueError, match=r"model.embed_norm = False"):
        hf_architecture(ModelConfig(**{**cfg.to_dict(), "embed_norm": False}))


# ------------------------------------------------------------ the two switches --------


def test_embed_norm_is_the_rms_normalized_embedding_row(base):
    """embed_norm: x = x0 = E[ids] / sqrt(mean(E[ids]^2) + eps), no weight. Looking up a
    normalized row is normalizing the looked-up row, so a plain model whose table holds the
    normalized rows computes the same logits."""
    cfg = ModelConfig(vocab_size=50, **SOURCE_MODEL, embed_norm=True, x0_mix=True)
    torch.manual_seed(1)
    model = TransformerLM.from_config(cfg).double()
    plain = TransformerLM.from_config(ModelConfig(**{**cfg.to_dict(), "embed_norm": False})).double()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        model.x0_scales.fill_(0.5)  # x0 is the normalized embedding too
        plain.x0_scales.fill_(0.5)
        E = model.token_embeddings.weight
        plain.token_embeddings.weight.copy_(E / torch.sqrt(E.pow(2).mean(-1, keepdim=True) + cfg.norm_eps))
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(ids), plain(ids))
    assert not torch.allclose(model(ids), TransformerLM.from_config(cfg).double()(ids))


def test_qk_norm_gain_is_qwen3s_qk_norm_written_out():
    """qk_norm_gain: q <- RMSNorm(q) g_q, k <- RMSNorm(k) g_k per head, then RoPE (Qwen3's
    order), against the equation by hand for one layer."""
    cfg = ModelConfig(vocab_size=40, **{**SOURCE_MODEL, "num_layers": 1}, qk_norm=True, qk_norm_gain=True)
    torch.manual_seed(4)
    model = TransformerLM.from_config(cfg).double()
    attn = model.layers[0].attn
    with torch.no_grad():
        attn.q_norm.weight.normal_(1.0, 0.5)
        attn.k_norm.weight.normal_(1.0, 0.5)
    assert {"layers.0.attn.q_norm.weight", "layers.0.attn.k_norm.weight"} <= set(model.state_dict())
    ids = torch.randint(0, 40, (1, 10), generator=torch.Generator().manual_seed(3))
    x = model.token_embeddings.weight[ids]
    h = model.layers[0].ln1(x)

    def heads(t):
        return t.view(1, 10, -1, attn.d_head).transpose(1, 2)

    def rms(t):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)

    q = rms(heads(h @ attn.q_proj.weight.T)) * attn.q_norm.weight
    k = rms(heads(h @ attn.k_proj.weight.T)) * attn.k_norm.weight
    pos = torch.arange(10)
    q, k, v = attn.rope(q, pos), attn.rope(k, pos), heads(h @ attn.v_proj.weight.T)
    scores = (q @ k.transpose(-1, -2)) / attn.d_head**0.5
    scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    mixed = torch.softmax(scores, dim=-1) @ v
    x = x + mixed.transpose(1, 2).reshape(1, 10, -1) @ attn.output_proj.weight.T
    x = x + model.layers[0].ffn(model.layers[0].ln2(x))
    want = model.ln_final(x) @ model.lm_head.weight.T
    torch.testing.assert_close(model(ids), want)
    ref = TransformerLM.from_config(ModelConfig(**{**cfg.to_dict(), "attention": "reference"})).double()
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(ref(ids), want)
    with torch.no_grad():  # decoding with the KV cache: the gains apply to each new position alone
        cache = model.make_kv_cache(1)
        steps = [model(ids[:, :4], kv_cache=cache)] + [model(ids[:, t : t + 1], kv_cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), want)
    with pytest.raises(ValueError, match="model.qk_norm_gain needs model.qk_norm"):
        ModelConfig(vocab_size=40, qk_norm_gain=True)

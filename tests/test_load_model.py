"""ferrolm.lm.checkpoint.load_model: one call loads a trained model and its tokenizer from a
run folder, a checkpoint file, a safetensors file or an exported folder, from any working
folder, and says what is wrong when the tokenizer is not found."""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest
import torch

from ferrolm import Tokenizer
from ferrolm.bpe import shards
from ferrolm.lm.checkpoint import CheckpointError, load_model, read_checkpoint, save_checkpoint
from ferrolm.lm.config import TrainConfig
from ferrolm.lm.model import TransformerLM
from ferrolm.lm.train import train

torch.set_num_threads(1)
TINY = dict(context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)


def _train_with_relative_paths(root: Path) -> None:
    """A 2-step run in ``root`` whose config names everything relative to ``root``, the
    folder training runs in (as a user typing ``--set data.tokenizer=tok`` does)."""
    text = inspect.getsource(shutil) * 2
    (root / "train.txt").write_text(text, encoding="utf-8")
    (root / "val.txt").write_text(text[:20_000], encoding="utf-8")
    tok = Tokenizer.train(str(root / "train.txt"), 300, ["<|endoftext|>"], progress=False)
    tok.save(root / "tok")
    for name in ("train", "val"):
        shards.encode(tok, [root / f"{name}.txt"], root / name, progress=False)
    cfg = TrainConfig()
    cfg.update(
        {
            "model": {"vocab_size": tok.vocab_size, **TINY},
            "data": {"train": "train", "val": "val", "tokenizer": "tok"},
            "schedule": {"max_steps": 2, "warmup_steps": 1, "batch_size": 2},
            "run": {
                "out_dir": "runs/x",
                "device": "cpu",
                "autocast_bf16": False,
                "eval_every": 1,
                "eval_batches": 1,
                "log_every": 1,
                "checkpoint_every": 2,
                "progress": False,
                "num_threads": 1,
            },
        }
    )
    train(cfg.validate())


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project folder holding tok/, shards and runs/x/, trained with it as working folder."""
    root = tmp_path_factory.mktemp("project")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        _train_with_relative_paths(root)
    return root


def _logits(model, ids=(5, 17, 260, 3)):
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).float()


def test_training_records_where_the_tokenizer_is(project):
    ckpt = read_checkpoint(project / "runs" / "x" / "best.pt")
    assert ckpt["config"]["data"]["tokenizer"] == "tok"  # as the user wrote it
    assert ckpt["tokenizer_dir"] == str((project / "tok").resolve())
    assert ckpt["tokenizer_dir_from_run"] == "../../tok"


def test_a_run_folder_a_checkpoint_safetensors_and_an_exported_folder_load_alike(project, tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    from ferrolm.lm.export import export_hf, export_safetensors

    monkeypatch.chdir(tmp_path)  # another working folder than the one training ran in
    run = project / "runs" / "x"
    model, tok, info = load_model(run)
    assert info["source"] == run / "best.pt" and info["tokenizer_source"] == (project / "tok").resolve()
    assert tok.fingerprint == Tokenizer.load(project / "tok").fingerprint == info["tokenizer_fingerprint"]
    assert info["iteration"] >= 1 and "model" not in info and "optimizer" not in info
    assert not model.training and model.config.d_model == 32
    want = _logits(model)

    step = run / "checkpoints" / "step_00000002.pt"
    for source in (step, export_safetensors(step, tmp_path / "w.safetensors"), export_hf(step, tmp_path / "hf")):
        m, t, i = load_model(source)
        assert t.fingerprint == tok.fingerprint, source
        assert i["source"] == Path(source)
        assert torch.allclose(_logits(m), _logits(load_model(step, tokenizer=False).model), atol=1e-6), source
    # the exported folder carries its own tokenizer
    assert load_model(tmp_path / "hf").info["tokenizer_source"] == tmp_path / "hf"
    # the best checkpoint is the run folder's choice; dtype and device are applied
    m16 = load_model(run, "cpu", "bfloat16").model
    assert {p.dtype for p in m16.parameters()} == {torch.bfloat16}
    assert torch.allclose(_logits(m16), want, atol=0.1)


def test_a_run_folder_without_best_gives_its_newest_step_checkpoint(project, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(project / "runs" / "x", run)
    (run / "best.pt").unlink()
    assert load_model(run, tokenizer=False).info["source"] == run / "checkpoints" / "step_00000002.pt"
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(FileNotFoundError, match="no checkpoint in this folder"):
        load_model(run)


def test_the_tokenizer_is_found_after_the_project_moves(project, tmp_path, monkeypatch):
    moved = tmp_path / "moved"
    shutil.copytree(project, moved)
    monkeypatch.chdir(tmp_path)
    # the recorded absolute path still points at the original: make it not exist
    saved = read_checkpoint(moved / "runs" / "x" / "best.pt")
    saved["tokenizer_dir"] = str(tmp_path / "gone")
    model = TransformerLM(**saved["config"]["model"])
    model.load_state_dict(saved["model"])
    extra = {k: v for k, v in saved.items() if k not in ("format", "format_version", "model", "optimizer")}
    extra.pop("iteration"), extra.pop("checksum")
    save_checkpoint(model, None, saved["iteration"], moved / "runs" / "x" / "best.pt", **extra)
    loaded = load_model(moved / "runs" / "x")
    assert loaded.info["tokenizer_source"] == moved / "runs" / "x" / "../../tok"
    # a checkpoint from before the paths were recorded: data.tokenizer relative to the checkpoint's folder
    del extra["tokenizer_dir"], extra["tokenizer_dir_from_run"]
    (moved / "elsewhere").mkdir()
    shutil.copytree(moved / "tok", moved / "elsewhere" / "tok")
    save_checkpoint(model, None, 1, moved / "elsewhere" / "old.pt", **extra)
    assert load_model(moved / "elsewhere" / "old.pt").info["tokenizer_source"] == moved / "elsewhere" / "tok"


def test_a_tokenizer_that_is_not_the_trained_one_is_never_picked(project, tmp_path, monkeypatch):
    saved = read_checkpoint(project / "runs" / "x" / "best.pt")
    model = TransformerLM(**saved["config"]["model"])
    model.load_state_dict(saved["model"])
    other = Tokenizer.train(iter(["a different text altogether"] * 50), 270, ["<|endoftext|>"], progress=False)
    other.save(tmp_path / "tok")
    extra = {
        "config": saved["config"],
        "tokenizer_fingerprint": saved["tokenizer_fingerprint"],
        "tokenizer_dir": str(tmp_path / "tok"),  # the right place, the wrong tokenizer
    }
    save_checkpoint(model, None, 1, tmp_path / "c.pt", **extra)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "c.pt")
    assert "--tokenizer" in str(e.value) and f"{tmp_path / 'tok'} (another tokenizer" in str(e.value)
    with pytest.raises(CheckpointError, match="do not belong together"):
        load_model(tmp_path / "c.pt", tokenizer=other)
    # given explicitly, the right one loads
    assert load_model(tmp_path / "c.pt", tokenizer=project / "tok").tokenizer.vocab_size == 300
    # the CLI says the same, exit 2 and no traceback
    from ferrolm.app.cli import main

    assert main(["generate", "--checkpoint", str(tmp_path / "c.pt"), "--prompt", "x", "--device", "cpu"]) == 2


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_model(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(tmp_path, dtype="float8")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="only Llama, Qwen3 and transformers. nanochat models"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text('["llama"]')
    with pytest.raises(CheckpointError, match=r"config\.json is not a JSON object \(a list\)"):
        load_model(tmp_path)
    (tmp_path / "w.safetensors").write_bytes(b"not safetensors")
    pytest.importorskip("safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_model(tmp_path / "w.safetensors")

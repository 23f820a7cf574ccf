"""ferrolm.lm.train: config, the loop, resume exactness, bad input, DDP, CLI and plots.

Every run here uses a tiny model (d_model 32, context 16) on synthetic shards, on the CPU
in fp32, so each takes a few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from shard_util import synthetic_corpus, write_shard

from ferrolm.app.plot import plot_run
from ferrolm.lm import gemm
from ferrolm.lm.checkpoint import CheckpointError, load_checkpoint, read_checkpoint
from ferrolm.lm.config import preset_names, to_toml
from ferrolm.lm.data import ShardError
from ferrolm.lm.metrics import read_metrics
from ferrolm.lm.model import TransformerLM
from ferrolm.lm.train import ConfigError, TrainConfig, apply_overrides, load_config, train

REPO = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)  # tiny models: threads only add overhead (and contention on a busy machine)
TINY_MODEL = dict(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64, rope_theta=10000.0)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    corpus = synthetic_corpus(30_000, vocab_size=64, seed=0)
    write_shard(d / "train", corpus[:25_000], vocab_size=64)
    write_shard(d / "val", corpus[25_000:], vocab_size=64)
    return d


def tiny_config(shards, out_dir, **sections) -> TrainConfig:
    cfg = TrainConfig()
    cfg.update(
        {
            "model": TINY_MODEL,
            "data": {"train": str(shards / "train"), "val": str(shards / "val")},
            "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
            "schedule": {"max_steps": 20, "warmup_steps": 2, "batch_size": 4},
            "run": {
                "out_dir": str(out_dir),
                "device": "cpu",
                "autocast_bf16": False,
                "compile": False,
                "eval_every": 5,
                "eval_batches": 2,
                "log_every": 5,
                "checkpoint_every": 5,
                "keep_last": 2,
                "progress": False,
                "seed": 7,
                "num_threads": 1,
            },
        }
    )
    cfg.update(sections)
    return cfg.validate()


def final_weights(run_dir: Path, step: int) -> dict:
    return read_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}.pt")["model"]


# ------------------------------------------------------------------- config ------------


def test_presets_load_and_have_the_documented_shapes():
    assert {"cs336", "cpu-small", "tinystories", "owt"} <= set(preset_names())
    ts = load_config("tinystories")
    m = ts.model
    # vocab_size 0: the model takes the shards' vocabulary.
    assert (m.vocab_size, m.context_length, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.rope_theta) == (
        0,
        256,
        512,
        4,
        16,
        1344,
        10000.0,
    )
    owt = load_config("owt")
    assert (owt.model.vocab_size, owt.model.context_length) == (0, 512)
    small = load_config("cpu-small")
    assert small.run.device == "cpu" and small.model.vocab_size == 0


def test_the_cs336_preset_is_the_assignments_recipe():
    """AdamW, SwiGLU, pre-norm RMSNorm, RoPE, untied head, cosine with warmup, random windows:
    every switch off, whatever the defaults become."""
    cfg = load_config("cs336")
    m = cfg.model
    assert (m.norm, m.norm_position, m.positions, m.ffn) == ("rms", "pre", "rope", "swiglu")
    switches = (m.tie_embeddings, m.kv_heads, m.qk_norm, m.logit_softcap, m.zero_init_output, m.doc_mask)
    assert switches == (False, m.num_heads, False, 0.0, False, False)
    assert (m.value_embeds, m.x0_mix) == (False, False)
    assert (cfg.optimizer.name, cfg.schedule.lr_schedule, cfg.data.batching) == ("adamw", "cosine", "random")
    assert (cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.weight_decay) == (0.9, 0.95, 0.1)


def test_typo_in_a_config_file_names_the_field(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[optimizer]\nlrr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"unknown config field 'optimizer.lrr' \(did you mean 'optimizer.lr'\?\)"):
        load_config(f)
    f.write_text("[optimiser]\nlr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"unknown config section \[optimiser\] \(did you mean 'optimizer'\?\)"):
        load_config(f)


def test_overrides_types_and_errors():
    cfg = load_config(
        "cpu-small",
        ["optimizer.lr=3e-2", "schedule.max_steps=1e3", "run.compile=true", "data.train=['a', 'b']", "seed=5"],
    )
    assert cfg.optimizer.lr == 3e-2 and cfg.schedule.max_steps == 1000 and cfg.run.compile == "true"
    assert cfg.data.train == ["a", "b"] and cfg.run.seed == 5
    with pytest.raises(ConfigError, match=r"unknown config field 'model.d_modle' \(did you mean 'model.d_model'\?\)"):
        load_config("cpu-small", ["model.d_modle=128"])
    with pytest.raises(ConfigError, match=r"schedule.batch_size must be an integer, got 'big'"):
        load_config("cpu-small", ["schedule.batch_size=big"])
    with pytest.raises(ConfigError, match=r"model.d_model \(100\) must be divisible by model.num_heads \(8\)"):
        load_config("cpu-small", ["model.d_model=100"])
    with pytest.raises(ConfigError, match="expected section.field=value"):
        load_config("cpu-small", ["optimizer.lr"])
    with pytest.raises(ConfigError, match="unknown preset 'cpu-smal'.*did you mean 'cpu-small'"):
        load_config("cpu-smal")


def test_model_switches_are_config_keys_that_build_the_model():
    from ferrolm.lm.model import ModelConfig
    from ferrolm.lm.train import build_model

    switches = ["model.num_kv_heads=2", "model.qk_norm=true", "model.ffn=relu2", "model.logit_softcap=30"]
    cfg = load_config("cpu-small", switches + ["model.zero_init_output=true", "model.vocab_size=300"])
    assert isinstance(cfg.model, ModelConfig)  # the [model] section is the model's config
    model = build_model(cfg.model)
    assert model.config == cfg.model and model.layers[0].attn.num_kv_heads == 2
    assert model.layers[0].ffn.w1.weight.shape == (round(3 * 683 / 2), 256)
    assert "qk_norm = true" in to_toml(cfg) and "logit_softcap = 30.0" in to_toml(cfg)


def test_config_round_trips_through_toml(tmp_path):
    cfg = load_config("tinystories", ["data.train=['x', 'y']", 'run.out_dir=some dir/with "quotes"'])
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    assert load_config(tmp_path / "c.toml").to_dict() == cfg.to_dict()


# ------------------------------------------------------------------- the loop ----------


def test_tiny_model_overfits_one_batch(tmp_path):
    # A shard of exactly context_length + 1 tokens has one window: every batch is that window.
    rng = np.random.default_rng(3)
    write_shard(tmp_path / "one", rng.integers(1, 64, size=17), vocab_size=64)
    cfg = tiny_config(tmp_path, tmp_path / "run")
    cfg.update(
        {
            "data": {"train": str(tmp_path / "one"), "val": str(tmp_path / "one")},
            "optimizer": {"lr": 1e-2, "min_lr": 1e-2, "weight_decay": 0.0},
            "schedule": {"max_steps": 100, "warmup_steps": 5},
            "run": {"eval_every": 0, "log_every": 20, "checkpoint_every": 0},
        }
    )
    summary = train(cfg)
    assert summary.status == "done"
    first, last = summary.records[0]["val_loss"], summary.final_val_loss
    assert first > 3.5  # ~ln 64 at init
    assert last < 0.05, f"val loss on the memorized window is {last}"


def test_vocab_size_defaults_to_the_shards(tmp_path):
    corpus = synthetic_corpus(3000, vocab_size=40, seed=1)
    write_shard(tmp_path / "t", corpus, vocab_size=40)
    cfg = tiny_config(tmp_path, tmp_path / "run")
    cfg.update(
        {
            "model": {"vocab_size": 0},
            "data": {"train": str(tmp_path / "t"), "val": str(tmp_path / "t")},
            "schedule": {"max_steps": 2, "warmup_steps": 0},
            "run": {"eval_every": 0, "checkpoint_every": 0},
        }
    )
    summary = train(cfg.validate())
    assert summary.status == "done"
    assert read_checkpoint(summary.last_checkpoint)["model"]["token_embeddings.weight"].shape[0] == 40
    assert "vocab_size = 40" in (summary.run_dir / "config.toml").read_text()


def test_a_sidecar_less_nanogpt_bin_trains_with_its_dtype(tmp_path):
    corpus = synthetic_corpus(3000, vocab_size=64, seed=2)
    np.asarray(corpus, dtype="<u2").tofile(tmp_path / "train.bin")
    cfg = tiny_config(tmp_path, tmp_path / "run")
    cfg.update(
        {
            "data": {"train": str(tmp_path / "train.bin"), "val": str(tmp_path / "train.bin"), "dtype": "uint16"},
            "schedule": {"max_steps": 2, "warmup_steps": 0},
            "run": {"eval_every": 0, "checkpoint_every": 0},
        }
    )
    assert train(cfg.validate()).status == "done"
    cfg.update({"model": {"vocab_size": 0}, "run": {"out_dir": str(tmp_path / "run2")}})
    with pytest.raises(ConfigError, match="model.vocab_size is not set"):
        train(cfg.validate())


MUON = {"name": "muon", "lr": 0.02, "min_lr": 0.002, "muon_momentum_warmup_steps": 12}


@pytest.mark.parametrize("optimizer", [{}, MUON], ids=["adamw", "muon"])
def test_resume_after_sigterm_is_exact(shards, tmp_path, optimizer):
    def tiny_config(shards, out_dir):
        return globals()["tiny_config"](shards, out_dir, optimizer=optimizer)

    straight = train(tiny_config(shards, tmp_path / "straight"))
    assert straight.status == "done" and straight.step == 20

    def kill_at_10(step, record):
        if step == 8:
            # A real signal, handled by the trainer: it finishes the step in flight (9), saves, stops.
            os.kill(os.getpid(), signal.SIGTERM)

    first = train(tiny_config(shards, tmp_path / "resumed"), on_step=kill_at_10)
    assert first.status == "interrupted" and first.step == 9
    assert "SIGTERM" in first.message
    second = train(tiny_config(shards, tmp_path / "resumed"), resume=tmp_path / "resumed")
    assert second.status == "done" and second.step == 20

    def losses(run):
        return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run)]

    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert len(losses(tmp_path / "straight")) == 5  # steps 0, 5, 10, 15, 20
    a, b = final_weights(tmp_path / "straight", 20), final_weights(tmp_path / "resumed", 20)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # keep_last = 2: only steps 15 and 20 remain, plus best.pt
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()) == [
        "step_00000015.pt",
        "step_00000020.pt",
    ]
    assert (tmp_path / "resumed" / "best.pt").is_file()


def test_document_batches_resume_bit_exact(shards, tmp_path):
    """data.batching = "documents" with model.doc_mask: the loader's state (stream position and
    buffer) is in the checkpoint, so 6 steps + resume + 6 equal 12 straight."""
    doc = {"data": {"batching": "documents", "doc_buffer": 16}, "schedule": {"max_steps": 12}}
    doc["run"] = {"eval_every": 3, "log_every": 3, "checkpoint_every": 3}

    def config(out):
        cfg = tiny_config(shards, out, **doc)
        cfg.update({"model": {"doc_mask": True}})
        return cfg.validate()

    straight = train(config(tmp_path / "straight"))
    assert straight.status == "done" and straight.step == 12

    def stop_at_6(step, record):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    first = train(config(tmp_path / "resumed"), on_step=stop_at_6)
    assert first.status == "interrupted" and first.step == 6
    ckpt = read_checkpoint(first.last_checkpoint)
    assert ckpt["batching"] == "documents" and ckpt["sampler_states"][0].dtype == torch.int64
    second = train(config(tmp_path / "resumed"), resume=tmp_path / "resumed")
    assert second.step == 12

    def losses(run):
        return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run)]

    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    a, b = final_weights(tmp_path / "straight", 12), final_weights(tmp_path / "resumed", 12)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the same run with random windows learns from other batches
    random_run = train(tiny_config(shards, tmp_path / "random", **{**doc, "data": {}}))
    assert read_metrics(tmp_path / "random")[1]["train_loss"] != losses(tmp_path / "straight")[1][1]
    assert random_run.status == "done"


@pytest.mark.skipif(not gemm.onednn_available(), reason="this torch build has no oneDNN")
def test_a_resumed_run_keeps_the_cpu_kernel_its_checkpoint_records(shards, tmp_path, monkeypatch):
    """cpu_matmul = "auto" times BLAS against oneDNN at the start; a resumed run must not time
    again (a busy machine could choose the other kernel, whose sums differ in the last bits)."""
    cfg = tiny_config(shards, tmp_path / "run", run={"cpu_matmul": "auto"})
    kernels = []

    def stop_at_4(step, record):
        kernels.append(gemm.using_onednn())
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        monkeypatch.setattr(gemm, "_probe_speedup", lambda: 10.0)  # oneDNN wins the first timing
        first = train(cfg, on_step=stop_at_4)
        assert first.status == "interrupted" and read_checkpoint(first.last_checkpoint)["cpu_matmul"] == "onednn"
        monkeypatch.setattr(gemm, "_probe_speedup", lambda: 0.5)  # and would lose a second one
        second = train(cfg, resume=tmp_path / "run", on_step=lambda step, record: kernels.append(gemm.using_onednn()))
        assert second.status == "done" and kernels and all(kernels)
        fresh = train(tiny_config(shards, tmp_path / "fresh", run={"cpu_matmul": "auto"}))
        assert not gemm.using_onednn() and read_checkpoint(fresh.last_checkpoint)["cpu_matmul"] == "blas"
    finally:
        gemm.choose("blas")  # the choice is process-wide


def test_existing_run_dir_needs_resume(shards, tmp_path):
    cfg = tiny_config(shards, tmp_path / "r", schedule={"max_steps": 5})
    train(cfg)
    with pytest.raises(FileExistsError, match="--resume"):
        train(tiny_config(shards, tmp_path / "r", schedule={"max_steps": 5}))


def test_resume_with_a_different_model_is_refused(shards, tmp_path):
    train(tiny_config(shards, tmp_path / "r", schedule={"max_steps": 5}))
    cfg = tiny_config(shards, tmp_path / "r", model={"d_model": 64}, schedule={"max_steps": 10})
    with pytest.raises(CheckpointError, match="different model config.*d_model"):
        train(cfg, resume=tmp_path / "r")


def test_resume_with_another_optimizer_is_refused(shards, tmp_path):
    train(tiny_config(shards, tmp_path / "r", schedule={"max_steps": 5}))
    cfg = tiny_config(shards, tmp_path / "r", optimizer=MUON, schedule={"max_steps": 10})
    with pytest.raises(CheckpointError, match="optimizer.name = 'adamw', not 'muon'"):
        train(cfg, resume=tmp_path / "r")


def test_muon_run_builds_its_groups_from_the_config(shards, tmp_path):
    from ferrolm.lm.optim import Muon
    from ferrolm.lm.train import build_model, build_optimizer, set_hyperparameters

    cfg = tiny_config(shards, tmp_path / "m", optimizer=dict(MUON, embedding_lr=0.3, head_lr=0.006, scalar_lr=0.03))
    cfg.optimizer.muon_weight_decay = 0.05
    cfg.model.vocab_size = 64
    opt = build_optimizer(build_model(cfg.model), cfg.optimizer)
    assert isinstance(opt, Muon)
    width = (768 / 32) ** 0.5  # the AdamW lrs are given for width 768; d_model is 32
    by_role = {g["role"]: g for g in opt.param_groups}
    assert by_role["matrix"]["lr"] == 0.02 and by_role["matrix"]["weight_decay"] == 0.05
    assert by_role["embedding"]["lr"] == pytest.approx(0.3 * width)
    assert by_role["head"]["lr"] == pytest.approx(0.006 * width) and by_role["head"]["weight_decay"] == 0.1
    assert by_role["scalar"]["lr"] == pytest.approx(0.03 * width)
    set_hyperparameters(opt, cfg.optimizer, 6, 0.01)  # half the peak, half-way through the momentum warm-up
    assert by_role["matrix"]["lr"] == 0.01 and by_role["embedding"]["lr"] == pytest.approx(0.15 * width)
    assert by_role["matrix"]["momentum"] == pytest.approx(0.90)
    cfg.optimizer.width_lr_scale = False
    opt = build_optimizer(build_model(cfg.model), cfg.optimizer)
    assert {g["role"]: g["lr"] for g in opt.param_groups}["embedding"] == 0.3


def test_resume_skips_a_corrupt_latest_checkpoint_and_refuses_when_none_is_usable(shards, tmp_path):
    run = tmp_path / "r"
    train(tiny_config(shards, run, schedule={"max_steps": 10}))
    latest = run / "checkpoints" / "step_00000010.pt"
    latest.write_bytes(latest.read_bytes()[:1000])  # e.g. a copy cut short
    with pytest.warns(UserWarning, match="corrupt"):
        summary = train(tiny_config(shards, run, schedule={"max_steps": 10}), resume=run)
    assert summary.status == "done" and [r["step"] for r in summary.records] == [10]  # resumed from step 5
    for p in (run / "checkpoints").iterdir():
        p.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"), pytest.warns(UserWarning, match="trying the previous"):
        train(tiny_config(shards, run, schedule={"max_steps": 10}), resume=run)


def test_shard_tokenizer_mismatch_is_refused(shards, tmp_path):
    cfg = tiny_config(shards, tmp_path / "r", data={"tokenizer": "cd" * 32})
    with pytest.raises(ShardError, match="tokenizer mismatch"):
        train(cfg)
    write_shard(tmp_path / "other_val", synthetic_corpus(2000), vocab_size=64, fingerprint="cd" * 32)
    cfg = tiny_config(shards, tmp_path / "r", data={"val": str(tmp_path / "other_val")})
    with pytest.raises(ShardError, match="different tokenizers"):
        train(cfg)
    cfg = tiny_config(shards, tmp_path / "r", model={"vocab_size": 32})
    with pytest.raises(ConfigError, match="64-token vocabulary but model.vocab_size is 32"):
        train(cfg)
    with pytest.raises(FileNotFoundError, match="no shards found"):
        train(tiny_config(shards, tmp_path / "r", data={"train": str(tmp_path / "missing")}))
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(shards, tmp_path):
    def poison(step, record):
        if step == 7:
            model_params = poison.model  # set below through a weight hook
            with torch.no_grad():
                next(iter(model_params)).fill_(float("nan"))

    import ferrolm.lm.train as T

    real_build = T.build_model

    def build(cfg):
        m = real_build(cfg)
        poison.model = m.parameters()
        return m

    T.build_model, orig = build, T.build_model
    try:
        summary = train(tiny_config(shards, tmp_path / "r"), on_step=poison)
    finally:
        T.build_model = orig
    assert summary.status == "nan"
    assert "NaN" in summary.message and "step_00000005.pt" in summary.message
    ckpts = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert ckpts == ["step_00000005.pt"]
    state = read_checkpoint(tmp_path / "r" / "checkpoints" / ckpts[0])["model"]
    assert all(torch.isfinite(v).all() for v in state.values())


def test_a_dead_run_stops_with_its_own_status(shards, tmp_path):
    # Muon at lr 1e9 saturates the soft-capped logits within a few steps: every logit alike
    # (the loss of a uniform guess, ln 64), the gradient exactly 0, nothing more to learn.
    dead = tiny_config(
        shards,
        tmp_path / "dead",
        model={"qk_norm": True, "logit_softcap": 15.0},
        optimizer=dict(MUON, lr=1e9),
        schedule={"max_steps": 40},
    )
    summary = train(dead)
    assert summary.status == "dead" and summary.step < 15
    assert "the gradient has been exactly 0 since step" in summary.message
    assert "= ln(64), a uniform guess" in summary.message and "optimizer.lr = 1e+09" in summary.message
    # A healthy run (short, with warm-up, either optimizer) never trips the rule.
    for i, optimizer in enumerate(({}, MUON)):
        healthy = tiny_config(shards, tmp_path / f"ok{i}", optimizer=optimizer, schedule={"max_steps": 12})
        assert train(healthy).status == "done"


def test_disk_full_when_saving_keeps_the_previous_checkpoint(shards, tmp_path, monkeypatch, capsys):
    import ferrolm.lm.train as T

    real = T.save_checkpoint
    calls = {"n": 0}

    def full_at_step_10(model, opt, it, out, **extra):
        if str(out).endswith("step_00000010.pt"):
            calls["n"] += 1
            raise OSError(28, "No space left on device")
        return real(model, opt, it, out, **extra)

    monkeypatch.setattr(T, "save_checkpoint", full_at_step_10)
    # A periodic save fails: a warning, training goes on, the next save works.
    summary = train(tiny_config(shards, tmp_path / "a", schedule={"max_steps": 15}, run={"keep_last": 0}))
    assert summary.status == "done" and calls["n"] == 1
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == [
        "step_00000005.pt",
        "step_00000015.pt",
    ]
    # The final save fails: an error that says the previous checkpoint is intact, and it is.
    with pytest.raises(OSError, match=r"No space left on device; the previous checkpoint .*step_00000005.pt is intact"):
        train(tiny_config(shards, tmp_path / "b", schedule={"max_steps": 10}))
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step_00000005.pt"]
    assert load_checkpoint(tmp_path / "b" / "checkpoints" / "step_00000005.pt", TransformerLM(**TINY_MODEL), None) == 5


def test_disk_full_messages_say_whether_an_earlier_save_exists(shards, tmp_path, monkeypatch, capsys):
    import ferrolm.lm.train as T

    real = T.save_checkpoint
    saves: dict = {}
    failing: set = set()  # (file name, its n-th save) that find the disk full

    def disk_full(model, opt, it, out, **extra):
        name = Path(out).name
        saves[name] = saves.get(name, 0) + 1
        if (name, saves[name]) in failing:
            raise OSError(28, "No space left on device")
        return real(model, opt, it, out, **extra)

    monkeypatch.setattr(T, "save_checkpoint", disk_full)
    failing.update({("step_00000005.pt", 1), ("best.pt", 1)})  # the first save of each kind
    assert train(tiny_config(shards, tmp_path / "a", schedule={"max_steps": 10})).status == "done"
    err = capsys.readouterr().err
    assert "No space left on device; no checkpoint of this run was saved before (training continues)" in err
    assert "No space left on device (there is no best checkpoint yet; training continues)" in err
    assert "intact" not in err
    saves.clear()
    failing.clear()
    failing.add(("best.pt", 2))  # a later best, beside the first one
    assert train(tiny_config(shards, tmp_path / "b", schedule={"max_steps": 10})).status == "done"
    assert saves["best.pt"] == 2
    assert "No space left on device (the previous best is intact; training continues)" in capsys.readouterr().err


# ------------------------------------------------------------------- CLI, plot ---------


def run_cli(*args, cwd=None, timeout=120):
    # tests/ for its helper modules, before whatever path finds ferrolm (a source tree's python/)
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "ferrolm", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def test_cli_config_errors_and_print_config():
    out = run_cli("train", "--config", "cpu-small", "--set", "optimizer.lrr=1", "--print-config")
    assert out.returncode == 2
    assert "unknown config field 'optimizer.lrr'" in out.stderr
    out = run_cli("train", "--config", "cpu-small", "--set", "optimizer.lr=0.5", "--print-config")
    assert out.returncode == 0 and "lr = 0.5" in out.stdout


def cpu_small_tiny(shards) -> list:
    """`ferrolm train` arguments: the cpu-small recipe at a tiny shape, by steps."""
    return ["--config", "cpu-small"] + [
        f"--set={k}"
        for k in (
            "model.vocab_size=64",
            "model.context_length=16",
            "model.d_model=32",
            "model.num_layers=1",
            "model.num_heads=2",
            "model.d_ff=64",
            "model.bigram_buckets=1024",
            f"data.train={shards / 'train'}",
            f"data.val={shards / 'val'}",
            "schedule.max_steps=6",
            "schedule.schedule_by=steps",
            "schedule.max_time_s=0",
            "schedule.warmup_steps=1",
            "schedule.batch_size=4",
            "run.eval_every=3",
            "run.eval_batches=1",
            "run.log_every=3",
            "run.progress=false",
            "run.autocast_bf16=false",
        )
    ]


def test_plot_replaces_only_its_own_png_and_never_a_run_file(tmp_path, capsys):
    import json

    from ferrolm.app.cli import main
    from ferrolm.app.plot import is_ferrolm_plot

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "time_s": s, "tokens": 64 * s, "train_loss": 4 - s / 10, "val_loss": None} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics = (run / "metrics.jsonl").read_bytes()
    precious = tmp_path / "precious.png"
    precious.write_bytes(b"\x89PNG\r\n\x1a\n a photo of mine")

    def plot(*argv):
        code = main(["plot", str(run), *map(str, argv)])
        return code, capsys.readouterr().err

    code, err = plot("--out", precious)
    assert code == 2 and f"--out {precious} exists and is not a plot ferrolm wrote" in err and "--force" in err
    assert precious.read_bytes().endswith(b"a photo of mine")
    for out in (run / "metrics.jsonl", run):  # its input: never, even forced
        code, err = plot("--out", out, "--force")
        assert code == 2 and "which this command reads" in err
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert plot()[0] == 0 and is_ferrolm_plot(run / "loss_step.png")
    assert plot()[0] == 0  # its own earlier plot: replaced
    assert plot("--out", precious, "--force")[0] == 0 and is_ferrolm_plot(precious)
    assert sorted(p.name for p in run.iterdir()) == ["loss_step.png", "metrics.jsonl"]


def test_cli_a_dead_run_exits_4_and_says_so(shards, tmp_path):
    args = cpu_small_tiny(shards) + ["--set", "optimizer.lr=1e9", "--set", "schedule.max_steps=30"]
    out = run_cli("train", *args, "--set", f"run.out_dir={tmp_path / 'a'}")
    assert out.returncode == 4, out.stderr
    assert "the model has stopped learning" in out.stderr and "Traceback" not in out.stderr


def test_cli_train_resume_and_plot_two_runs(shards, tmp_path):
    common = cpu_small_tiny(shards)
    out = run_cli("train", *common, "--set", f"run.out_dir={tmp_path / 'a'}")
    assert out.returncode == 0, out.stderr
    assert "val loss" in out.stdout
    # extend the same run by 3 steps through --resume and an override
    out = run_cli("train", "--resume", str(tmp_path / "a"), "--set", "schedule.max_steps=9")
    assert out.returncode == 0, out.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "a")] == [0, 3, 6, 9]
    # a second run, in-process, to overlay
    train(tiny_config(shards, tmp_path / "b", schedule={"max_steps": 6}, optimizer={"lr": 1e-2}))
    png = tmp_path / "cmp.png"
    out = run_cli("plot", str(tmp_path / "a"), str(tmp_path / "b"), "--x", "tokens", "--out", str(png))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the Python API defaults to RUN_DIR/loss_<x>.png
    assert plot_run(tmp_path / "a", x="time") == tmp_path / "a" / "loss_time.png"


# ------------------------------------------------------------------- DDP ---------------


def test_ddp_two_cpu_processes(shards, tmp_path):
    cfg = tiny_config(
        shards,
        tmp_path / "ddp",
        schedule={"max_steps": 6},
        run={"eval_every": 3, "log_every": 3, "checkpoint_every": 0},
    )
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "ferrolm",
        "train",
        "--config",
        str(tmp_path / "c.toml"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    records = read_metrics(tmp_path / "ddp")
    assert [r["step"] for r in records] == [0, 3, 6], "rank 0 alone logs, once per log step"
    # 2 processes x batch 4 x context 16 per step
    assert records[-1]["tokens"] == 6 * 2 * 4 * 16
    ckpt = read_checkpoint(tmp_path / "ddp" / "checkpoints" / "step_00000006.pt")
    assert ckpt["world_size"] == 2 and len(ckpt["sampler_states"]) == 2
    assert not torch.equal(ckpt["sampler_states"][0], ckpt["sampler_states"][1]), "each rank draws its own batches"
    model = TransformerLM(**TINY_MODEL)
    assert load_checkpoint(tmp_path / "ddp" / "checkpoints" / "step_00000006.pt", model, None) == 6


def _torchrun(*args, nproc: int = 2, timeout: int = 300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("mode, optimizers", [("ddp", ["adamw", "muon"]), ("fsdp", ["adamw", "muon", "muon-loop"])])
def test_two_processes_give_the_losses_of_one_on_the_same_global_batch(mode, optimizers):
    # Muon under FSDP2 orthogonalises whole matrices from sharded momentum, as one process does
    script = str(REPO / "tests" / "dist_step.py")
    alone = subprocess.run([sys.executable, script, "single", *optimizers], capture_output=True, text=True, check=True)
    together = _torchrun(script, mode, *optimizers)
    for optimizer, one, two in zip(optimizers, alone.stdout.splitlines(), together.splitlines(), strict=True):
        values = [float(v) for v in one.split()], [float(v) for v in two.split()]
        assert len(values[0]) == len(values[1]) == 7  # six losses, then the weights' absolute sum
        assert values[1] == pytest.approx(values[0], abs=1e-5, rel=1e-6), (optimizer, values)
        assert values[0][5] < values[0][0]


def test_fsdp_run_saves_plain_checkpoints_and_resumes(shards, tmp_path):
    cfg = tiny_config(
        shards, tmp_path / "fsdp", schedule={"max_steps": 6}, run={"eval_every": 3, "log_every": 3, "parallel": "fsdp"}
    )
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    _torchrun("-m", "ferrolm", "train", "--config", str(tmp_path / "c.toml"))
    path = tmp_path / "fsdp" / "checkpoints" / "step_00000005.pt"
    model = TransformerLM(**TINY_MODEL)
    assert load_checkpoint(path, model, None) == 5  # full tensors under the usual keys
    ckpt = read_checkpoint(path)
    assert set(ckpt["optimizer"]["state"]) == set(range(len(list(model.parameters()))))
    # continue from step 5 sharded again (the full state is loaded into the shards)...
    cfg.run.out_dir = str(tmp_path / "again")
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    _torchrun("-m", "ferrolm", "train", "--config", str(tmp_path / "c.toml"), "--resume", str(path))
    again = read_checkpoint(tmp_path / "again" / "checkpoints" / "step_00000006.pt")
    assert again["iteration"] == 6 and all(torch.isfinite(v).all() for v in again["model"].values())
    # ...and in one process: the checkpoint is an ordinary one
    one = tiny_config(shards, tmp_path / "one", schedule={"max_steps": 6})
    with pytest.warns(UserWarning, match="reseeded"):
        summary = train(one, resume=path)
    assert summary.step == 6 and summary.status == "done"


# ------------------------------------------------------------------- schedule ----------


def test_lr_follows_steps_or_the_time_budget():
    from ferrolm.lm.train import lr_at

    cfg = load_config(
        "cs336",
        [
            "schedule.schedule_by=steps",
            "schedule.max_steps=100",
            "schedule.warmup_steps=10",
            "optimizer.lr=1e-3",
            "optimizer.min_lr=1e-4",
        ],
    )
    assert lr_at(cfg, 5, elapsed_s=999.0) == pytest.approx(5e-4)  # warmup, by step; time ignored
    assert lr_at(cfg, 10, 0.0) == pytest.approx(1e-3)
    assert lr_at(cfg, 100, 0.0) == pytest.approx(1e-4)
    cfg = load_config(
        "cs336",
        [
            "schedule.schedule_by=time",
            "schedule.max_time_s=600",
            "schedule.max_steps=100",
            "schedule.warmup_steps=10",
            "optimizer.lr=1e-3",
            "optimizer.min_lr=1e-4",
        ],
    )
    assert lr_at(cfg, 0, elapsed_s=30.0) == pytest.approx(5e-4)  # 30 s of 600 = step 5 of 100
    assert lr_at(cfg, 0, elapsed_s=60.0) == pytest.approx(1e-3)
    assert lr_at(cfg, 0, elapsed_s=330.0) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half-way through the cosine
    assert lr_at(cfg, 0, elapsed_s=5000.0) == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match="max_time_s > 0"):
        load_config("cs336", ["schedule.max_time_s=0"])


def test_wsd_schedule_by_steps_or_time():
    from ferrolm.lm.train import lr_at

    common = ["schedule.max_steps=100", "schedule.warmup_steps=10", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4"]
    cfg = load_config("cs336", [*common, "schedule.schedule_by=steps", "schedule.lr_schedule=wsd"])
    assert cfg.schedule.decay_frac == 0.2  # the warm-down takes steps 80..100
    assert lr_at(cfg, 5, 0.0) == pytest.approx(5e-4)
    assert lr_at(cfg, 50, 0.0) == lr_at(cfg, 80, 0.0) == 1e-3  # stable
    assert lr_at(cfg, 90, 0.0) == pytest.approx(1e-3 - 9e-4 * 10 / 20)
    assert lr_at(cfg, 100, 0.0) == pytest.approx(1e-4)
    cfg = load_config(
        "cs336", [*common, "schedule.lr_schedule=wsd", "schedule.decay_frac=0.5", "schedule.max_time_s=600"]
    )
    assert cfg.schedule.schedule_by == "time"  # the preset's
    assert lr_at(cfg, 0, elapsed_s=240.0) == 1e-3  # step 40: stable until 50
    assert lr_at(cfg, 0, elapsed_s=450.0) == pytest.approx(1e-3 - 9e-4 * 25 / 50)  # step 75
    cfg = load_config("cs336", [*common, "schedule.schedule_by=steps"])
    assert lr_at(cfg, 50, 0.0) < 1e-3  # cosine, as before


# ------------------------------------------------------------------- speed paths ---------


def test_compiled_training_equals_eager(shards, tmp_path, monkeypatch):
    # run.compile=true compiles model + loss as one graph; aot_eager runs that very graph
    # without generating C++, so the losses match eager's
    import functools

    import ferrolm.lm.train as T

    eager = train(tiny_config(shards, tmp_path / "eager", schedule={"max_steps": 6}))
    monkeypatch.setattr(T.torch, "compile", functools.partial(torch.compile, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    compiled = train(tiny_config(shards, tmp_path / "compiled", schedule={"max_steps": 6}, run={"compile": True}))
    losses = [[r["train_loss"] for r in s.records if r["train_loss"] is not None] for s in (eager, compiled)]
    assert len(losses[0]) >= 1
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_run_switches_resolve_per_device(monkeypatch):
    import ferrolm.lm.device as D

    cpu, meta = torch.device("cpu"), torch.device("meta")
    monkeypatch.setattr(D, "cpu_has_native_bf16", lambda: False)
    assert not D.use_bf16("auto", cpu) and D.use_bf16("true", cpu) and not D.use_bf16("false", cpu)
    monkeypatch.setattr(D, "cpu_has_native_bf16", lambda: True)
    assert D.use_bf16("auto", cpu) and not D.use_bf16(False, cpu) and not D.use_bf16("auto", meta)
    assert not D.use_compile("auto", cpu) and D.use_compile(True, cpu) and not D.use_compile("auto", meta)
    assert D.use_compile("auto", torch.device("cuda")) and not D.use_compile("false", torch.device("cuda"))


@pytest.mark.parametrize(
    "flags, capability, width",
    [
        ("fpu sse2 avx avx2 fma", "AVX2", "AVX2"),
        ("avx2 avx512f avx512bw", "AVX512", "AVX-512"),
        ("avx2 avx512f avx512_bf16", "AVX512", "AVX512-BF16"),
        ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "AVX512", "AMX"),
        ("", "AVX2", "AVX2"),  # no /proc/cpuinfo: torch's capability
        ("", "SVE256", "SVE256"),
        ("", "", "unknown"),
    ],
)
def test_cpu_vector_width_reads_the_widest_vectors(flags, capability, width):
    import ferrolm.lm.device as D

    assert D._vector_width(frozenset(flags.split()), capability) == width
    assert D.cpu_vector_width() == D._vector_width(D._cpu_flags(), D._torch_cpu_capability())
    assert D.cpu_has_native_bf16() == (D.cpu_vector_width() in ("AMX", "AVX512-BF16"))


def test_run_switch_config_values():
    cfg = apply_overrides(TrainConfig(), ["run.compile=true", "run.autocast_bf16=AUTO"])
    assert cfg.run.compile == "true" and cfg.run.autocast_bf16 == "auto"
    assert TrainConfig().run.compile == "auto"
    with pytest.raises(ConfigError, match="run.compile"):
        apply_overrides(TrainConfig(), ["run.compile=maybe"])


def test_flags_are_read_every_step_on_cpu_and_only_when_due_elsewhere():
    from types import SimpleNamespace

    from ferrolm.lm.train import _flags_due

    cfg = TrainConfig()
    cfg.update({"schedule": {"max_steps": 100}, "run": {"log_every": 10, "eval_every": 25, "checkpoint_every": 0}})
    gpu = SimpleNamespace(device=torch.device("cuda"), cfg=cfg)
    due = [step + 1 for step in range(100) if _flags_due(gpu, SimpleNamespace(step=step))]
    assert due == [10, 20, 25, 30, 40, 50, 60, 70, 75, 80, 90, 100]
    cpu = SimpleNamespace(device=torch.device("cpu"), cfg=cfg)
    assert all(_flags_due(cpu, SimpleNamespace(step=s)) for s in range(100))
    cfg.schedule.max_time_s = 60.0  # the clock steers the run: every step everywhere
    assert all(_flags_due(gpu, SimpleNamespace(step=s)) for s in range(100))


# ------------------------------------------------------------------- bad input ---------


@pytest.mark.parametrize(
    "override, message",
    [
        ("run.num_threads=-2", r"run.num_threads must be >= 0, got -2"),
        ("optimizer.min_lr=0.5", r"optimizer.min_lr \(0.5\) is above optimizer.lr"),
        ("schedule.tokens_per_step=7", r"tokens_per_step \(7\) is not a multiple of .* = 4096: use 4096 or 8192"),
        ("schedule.tokens_per_step=10000", r"use 8192 or 12288"),
        ("model.rope_theta=0", r"model.rope_theta must be a positive number, got 0"),
        ("model.rope_theta=-5", r"model.rope_theta must be a positive number"),
        ("optimizer.eps=0", r"optimizer.eps must be a positive number, got 0"),
        ("optimizer.name=sgd", r"optimizer.name must be one of \('adamw', 'muon'\), got 'sgd'"),
        ("optimizer.muon_ns_steps=0", r"optimizer.muon_ns_steps must be at least 1, got 0"),
        ("optimizer.muon_momentum=1", r"optimizer.muon_momentum must be in \[0, 1\), got 1"),
        ("optimizer.muon_momentum_start=-0.1", r"optimizer.muon_momentum_start must be in \[0, 1\)"),
        ("optimizer.head_lr=0", r"optimizer.head_lr must be a positive number, got 0"),
        ("optimizer.muon_weight_decay=-1", r"optimizer.muon_weight_decay must be >= 0"),
        ("optimizer.muon_momentum_warmup_steps=-1", r"optimizer.muon_momentum_warmup_steps must be >= 0"),
        ("schedule.lr_schedule=linear", r"schedule.lr_schedule must be one of \('cosine', 'wsd'\), got 'linear'"),
        ("schedule.decay_frac=0", r"schedule.decay_frac must be in \(0, 1\], got 0"),
        ("schedule.decay_frac=1.5", r"schedule.decay_frac must be in \(0, 1\], got 1.5"),
        ("model.num_kv_heads=3", r"model.num_kv_heads \(3\) must divide model.num_heads \(8\)"),
        ("model.ffn=gelu", r"model.ffn must be one of \('swiglu', 'silu', 'relu2', 'relu'\)"),
        ("model.logit_softcap=-1", r"model.logit_softcap must be >= 0"),
        ("data.batching=windows", r"data.batching must be one of \('random', 'documents'\)"),
        ("data.doc_buffer=0", r"data.doc_buffer must be positive"),
    ],
)
def test_nonsense_config_values_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("cpu-small", [override])


def test_cli_resume_of_a_missing_run_names_it(tmp_path):
    out = run_cli("train", "--resume", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert f"--resume {tmp_path / 'nope'}: no such run directory or checkpoint" in out.stderr
    assert "config.toml" not in out.stderr


def test_a_token_id_past_the_vocab_is_a_shard_error_before_the_model_sees_it(shards, tmp_path):
    # Without the check this is a bare IndexError from the embedding, steps into training.
    bad = synthetic_corpus(17, vocab_size=64, seed=1)
    bad[5] = 200
    write_shard(tmp_path / "bad", bad, vocab_size=64)
    cfg = tiny_config(shards, tmp_path / "r", data={"train": str(tmp_path / "bad")})
    with pytest.raises(ShardError, match=r"bad\.bin holds token id 200 at token 5, not below the vocab_size 64"):
        train(cfg)


def test_a_fresh_start_after_a_kill_before_the_first_checkpoint_logs_each_step_once(shards, tmp_path):
    class Killed(Exception):
        pass

    def kill_at_7(step, record):
        if step == 7:
            raise Killed  # as a kill -9 would: records for steps 0 and 5 written, no checkpoint

    cfg = dict(run={"checkpoint_every": 0})
    with pytest.raises(Killed):
        train(tiny_config(shards, tmp_path / "r", **cfg), on_step=kill_at_7)
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [0, 5]
    assert not (tmp_path / "r" / "checkpoints").exists()
    train(tiny_config(shards, tmp_path / "r", **cfg))  # no checkpoint to resume: a fresh start
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [0, 5, 10, 15, 20]


def test_a_start_removes_what_killed_saves_left(shards, tmp_path):
    run = tmp_path / "r"
    train(tiny_config(shards, run, schedule={"max_steps": 5}))
    # The names interrupted saves leave (an older writer's mkstemp names, and today's).
    orphans = [run / "checkpoints" / ".step_00000010.pt.x7_k2qpa.tmp", run / ".best.pt.0a1b2c3d.tmp"]
    for p in orphans:
        p.write_bytes(b"\0" * 1000)
    (run / "notes.txt").write_text("mine")
    train(tiny_config(shards, run, schedule={"max_steps": 10}), resume=run)
    assert not any(p.exists() for p in orphans)
    assert (run / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(os.name != "posix", reason="permission bits are POSIX")
def test_run_files_follow_the_umask(shards, tmp_path):
    old = os.umask(0o022)
    try:
        train(tiny_config(shards, tmp_path / "r", schedule={"max_steps": 5}))
    finally:
        os.umask(old)
    run = tmp_path / "r"
    for p in [run / "config.toml", run / "metrics.jsonl", run / "best.pt", run / "checkpoints" / "step_00000005.pt"]:
        assert oct(os.stat(p).st_mode & 0o777) == oct(0o644), p

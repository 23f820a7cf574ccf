"""The LM commands lose nothing and say what is wrong: a closed pipe never costs a
checkpoint, a full disk, an impossible model shape or a bad value is named in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from shard_util import synthetic_corpus, write_shard

torch.set_num_threads(1)
TINY_MODEL = dict(vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    corpus = synthetic_corpus(6_000, vocab_size=64, seed=0)
    write_shard(d / "train", corpus[:5_000], vocab_size=64)
    write_shard(d / "val", corpus[5_000:], vocab_size=64)
    return d


def _train_args(shards: Path, out_dir: Path, *extra: str) -> list[str]:
    model = [f"model.{k}={v}" for k, v in TINY_MODEL.items()] + ["model.bigram_buckets=1024"]  # a tiny table too
    sets = model + [
        f"data.train={shards / 'train'}",
        f"data.val={shards / 'val'}",
        f"run.out_dir={out_dir}",
        "run.device=cpu",
        "run.num_threads=1",
        "schedule.batch_size=2",
        "schedule.warmup_steps=1",
        *extra,
    ]
    return ["train", "--config", "cpu-small"] + [x for s in sets for x in ("--set", s)]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


# ------------------------------------------------ Ctrl-C of `ferrolm train 2>&1 | tee log` ---------


@pytest.mark.parametrize("stderr_too", [True, False], ids=["2>&1 | tee", "| tee"])
def test_ctrl_c_with_the_output_pipe_closed_still_saves_and_exits_130(shards, tmp_path, stderr_too):
    """The terminal interrupts the whole pipeline, so the reader of the pipe is gone before
    training handles the SIGINT: every later write to it meets a closed pipe."""
    out_dir = tmp_path / "run"
    argv = _train_args(
        shards,
        out_dir,
        "schedule.max_steps=1000000",
        "run.log_every=1",  # a line on stderr every step
        "run.eval_every=1000000",
        "run.checkpoint_every=0",  # the only checkpoint is the one the interrupt writes
        "run.progress=true",
    )
    read_end, write_end = os.pipe()
    err_file = open(tmp_path / "stderr.txt", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrolm", *argv],
        stdout=write_end,
        stderr=write_end if stderr_too else err_file,
        env=_env(),
    )
    os.close(write_end)
    try:
        deadline = time.monotonic() + 180
        metrics = out_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):  # steps are running
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        os.close(read_end)  # the reader goes away first, as `tee` does on Ctrl-C
        read_end = None
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        err_file.close()
        if read_end is not None:
            os.close(read_end)
        if proc.poll() is None:
            proc.kill()
    ckpts = sorted((out_dir / "checkpoints").glob("step_*.pt"))
    assert rc == 130 and ckpts, (rc, ckpts)  # 1 (a traceback) before, at times with no checkpoint
    step = int(ckpts[-1].stem.split("_")[1])
    last = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == step
    err = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in err
    if not stderr_too:  # stderr still reaches the terminal: the resume hint is there
        assert f"stopped by SIGINT after step {step}; checkpoint {ckpts[-1]}; continue with --resume {out_dir}" in err


# ------------------------------------------------------------------ a tiny trained run ---------


def _tiny_config(shards: Path, out_dir: Path, **run):
    from ferrolm.lm.config import TrainConfig

    cfg = TrainConfig()
    cfg.update(
        {
            "model": TINY_MODEL,
            "data": {"train": str(shards / "train"), "val": str(shards / "val")},
            "schedule": {"max_steps": 10, "warmup_steps": 1, "batch_size": 2},
            "run": {
                "out_dir": str(out_dir),
                "device": "cpu",
                "autocast_bf16": False,
                "compile": False,
                "eval_every": 5,
                "eval_batches": 1,
                "log_every": 5,
                "checkpoint_every": 5,
                "progress": False,
                "num_threads": 1,
                **run,
            },
        }
    )
    return cfg.validate()


# ------------------------------------------------------------------------ model shapes ---------


def test_the_memory_estimate_is_the_documented_sum():
    from ferrolm.lm.memory import training_memory_estimate
    from ferrolm.lm.model import ModelConfig

    cfg = ModelConfig(vocab_size=100, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=48)
    params = 100 * 16 + 2 * (4 * 16 * 16 + 3 * 16 * 48 + 2 * 16) + 16 + 100 * 16
    est = training_memory_estimate(cfg, batch_size=3)
    assert est["parameters"] == params == 9_936
    assert est["state"] == 16 * params
    assert est["activations"] == 4 * 3 * 8 * (2 * (10 * 16 + 4 * 48) + 100)
    assert est["total"] == est["state"] + est["activations"]
    assert training_memory_estimate(cfg, batch_size=3, shards=4)["state"] == 4 * params


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"num_layers": 99999999999999999999}},
        {"model": {"d_model": 2**40}},
        {"model": {"vocab_size": 4_000_000_000}},
        {"schedule": {"batch_size": 1_000_000}},
    ],
    ids=["layers", "width", "vocab", "batch"],
)
def test_a_shape_that_cannot_fit_is_refused_before_allocating(shards, tmp_path, change):
    from ferrolm.lm.memory import InsufficientMemoryError
    from ferrolm.lm.train import train

    cfg = _tiny_config(shards, tmp_path / "r")
    cfg.update(change)
    t0 = time.perf_counter()
    with pytest.raises(
        InsufficientMemoryError, match=r"needs an estimated [\d,.]+ [GM]B .* has [\d,.]+ [GM]B available"
    ):
        train(cfg)
    assert time.perf_counter() - t0 < 30  # refused, not built layer after layer


def test_the_memory_check_compares_with_what_is_available_and_can_be_skipped(shards, tmp_path, monkeypatch):
    import ferrolm.lm.memory as memory
    from ferrolm.lm.train import train

    monkeypatch.setattr(memory, "available_memory", lambda device: 100_000)  # 0.1 MB free
    with pytest.raises(memory.InsufficientMemoryError, match="cpu has 0.1 MB available.*FERROLM_MEMORY_CHECK=0"):
        train(_tiny_config(shards, tmp_path / "a"))
    monkeypatch.setenv("FERROLM_MEMORY_CHECK", "0")  # the way out when the estimate is wrong
    assert train(_tiny_config(shards, tmp_path / "b", eval_every=0)).status == "done"


def test_the_cli_says_the_estimate_in_one_line(shards, tmp_path, capsys):
    from ferrolm.app.cli import main

    argv = _train_args(shards, tmp_path / "r", "model.num_layers=99999999999999999999", "schedule.warmup_steps=0")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ferrolm train: error: this configuration needs an estimated") and err.count("\n") == 1


# ------------------------------------------------------------------- config values ---------


@pytest.mark.parametrize(
    "override, message",
    [
        ("schedule.max_time_s=nan", "schedule.max_time_s must be >= 0, got nan"),
        ("optimizer.grad_clip=nan", "optimizer.grad_clip must be >= 0, got nan"),
        (f"run.seed={2**70}", f"run.seed must be an int in [0, 2**63), got {2**70}"),
    ],
)
def test_values_no_run_can_use_are_named(override, message):
    from ferrolm.lm.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config("cpu-small", [override])
    assert str(e.value) == message


# ------------------------------------------------------------------------ disk full ---------


def _disk_full_after(limit: int, target_suffix: str, monkeypatch):
    """Make writes to checkpoint files ending in ``target_suffix`` fail with ENOSPC after
    ``limit`` bytes, as a full disk does, under the real torch.save and atomic write."""
    import contextlib
    import errno

    import ferrolm.lm.checkpoint as ck

    real = ck.atomic_open

    class FullDisk:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    @contextlib.contextmanager
    def atomic_open(path):
        with real(path) as f:
            yield FullDisk(f) if str(path).endswith(target_suffix) else f

    monkeypatch.setattr(ck, "atomic_open", atomic_open)


def test_a_full_disk_is_named_with_its_folder_and_earlier_checkpoints_stay(shards, tmp_path, monkeypatch, capsys):
    from ferrolm.app.cli import main
    from ferrolm.lm.checkpoint import read_checkpoint

    _disk_full_after(4096, "step_00000010.pt", monkeypatch)
    argv = _train_args(
        shards,
        tmp_path / "r",
        "schedule.max_steps=10",
        "schedule.warmup_steps=1",
        "run.checkpoint_every=5",
        "run.eval_every=5",
        "run.log_every=5",
        "run.progress=false",
        "run.compile=false",
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    ckpts = tmp_path / "r" / "checkpoints"
    assert f"No space left on device: the disk of {ckpts} is full" in err, err
    assert f"the previous checkpoint {ckpts / 'step_00000005.pt'} is intact" in err
    assert "inline_container" not in err and "Traceback" not in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000005.pt"]  # no temporary left
    assert read_checkpoint(ckpts / "step_00000005.pt")["iteration"] == 5


# ----------------------------------------------------------------------------- eval ---------


@pytest.fixture(scope="module")
def tiny_run(shards, tmp_path_factory):
    from ferrolm.lm.train import train

    out = tmp_path_factory.mktemp("run") / "r"
    train(_tiny_config(shards, out, eval_every=0, log_every=10, checkpoint_every=0))
    return out


def _eval(capsys, *argv):
    from ferrolm.app.cli import main

    capsys.readouterr()
    rc = main(["eval", "--device", "cpu", *map(str, argv)])
    return (rc, *capsys.readouterr())


def test_eval_shows_its_progress_on_stderr(shards, tiny_run, capsys):
    rc, out, err = _eval(capsys, "--checkpoint", tiny_run, "--data", shards / "val", "--batch-size", 4)
    assert rc == 0 and out.startswith("loss ")
    assert "eval" in err and "999/999" in err  # the bar counts predicted tokens: 1000 tokens, 999 predicted
    rc, out, err = _eval(capsys, "--checkpoint", tiny_run, "--data", shards / "val", "--no-progress")
    assert rc == 0 and err == ""


def test_eval_names_an_id_the_model_has_no_row_for(shards, tiny_run, tmp_path, capsys):
    from shard_util import FP

    tokens = synthetic_corpus(200, vocab_size=64, seed=1)
    tokens[123] = 70  # beyond the model's 64 ids, inside the sidecar's declared 100
    write_shard(tmp_path / "bad", tokens, vocab_size=64, fingerprint=FP)
    rc, out, err = _eval(capsys, "--checkpoint", tiny_run, "--data", tmp_path / "bad")
    assert rc == 2 and out == "" and "Traceback" not in err
    assert f"{tmp_path / 'bad'}: token 123 of the data is id 70, not below the model's vocab_size 64" in err
    write_shard(tmp_path / "wide", synthetic_corpus(200, vocab_size=64, seed=1), vocab_size=100, fingerprint=FP)
    rc, _, err = _eval(capsys, "--checkpoint", tiny_run, "--data", tmp_path / "wide")
    assert rc == 2 and "was encoded with a 100-token vocabulary, but the model in" in err and "has 64 tokens" in err


# ------------------------------------------------------------------------- generate ---------


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from ferrolm import Tokenizer
    from ferrolm.lm.checkpoint import save_checkpoint
    from ferrolm.lm.model import TransformerLM

    d = tmp_path_factory.mktemp("gen")
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(d / "tok")
    torch.manual_seed(0)
    m = TransformerLM(tok.vocab_size, 16, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    config = {"model": m.config.to_dict()}
    save_checkpoint(m, None, 1, d / "m.pt", config=config, tokenizer_fingerprint=tok.fingerprint)
    return d


def _generate(capsys, d, *argv):
    from ferrolm.app.cli import main

    capsys.readouterr()
    base = ["generate", "--checkpoint", str(d / "m.pt"), "--tokenizer", str(d / "tok"), "--device", "cpu"]
    rc = main(base + ["--max-new-tokens", "4", *map(str, argv)])
    return (rc, *capsys.readouterr())


def test_greedy_generation_reports_no_seed(model_and_tokenizer, capsys):
    rc, out, err = _generate(capsys, model_and_tokenizer, "--prompt", "ab", "--temperature", 0)
    assert rc == 0 and out.startswith("ab") and err == ""
    rc, out, err = _generate(capsys, model_and_tokenizer, "--prompt", "ab")
    assert rc == 0 and err.startswith("seed ")  # sampling: the seed that reproduces it


def test_generate_names_a_bad_seed_and_a_prompt_file_that_is_not_utf8(model_and_tokenizer, tmp_path, capsys):
    rc, out, err = _generate(capsys, model_and_tokenizer, "--prompt", "ab", "--seed", 2**70)
    assert rc == 2 and err == f"ferrolm generate: error: --seed must be an int in [0, 2**63), got {2**70}\n"
    (tmp_path / "p.txt").write_bytes(b"caf\xe9 au lait")  # Latin-1, not UTF-8
    rc, out, err = _generate(capsys, model_and_tokenizer, "--prompt-file", tmp_path / "p.txt")
    assert rc == 2 and out == ""
    assert err == f"ferrolm generate: error: --prompt-file {tmp_path / 'p.txt'}: not UTF-8 text (byte 3 is 0xe9)\n"


# ----------------------------------------------------------------------------- demo ---------


def test_the_demo_says_what_its_samples_can_show():
    from ferrolm.app.demo import what_to_expect

    assert what_to_expect(8.38, 4.25, 4096) == (
        "what to expect: a model that knows nothing scores ln(4096) = 8.32 nats/token; this one went from "
        "8.38 to 4.25, as unsure at each token as a pick among 70. At such a loss samples take on the look of "
        "the text (for the standard library's code: indentation, keywords, names, comments) but not its sense; "
        "the loss keeps falling with longer training (--minutes N, or a GPU)."
    )


def test_the_demo_docs_give_the_demo_s_own_figures():
    import re

    from ferrolm.app import demo

    usage = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text(encoding="utf-8")
    every = re.search(r'"run\.eval_every=(\d+)"', Path(demo.__file__).read_text(encoding="utf-8")).group(1)
    assert f"evaluated every {every} steps" in usage


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "t", "--limit", "-1"], "argument --limit: must be a finite number > 0, got -1"),
        (["--tasks", "t", "--limit", "0"], "argument --limit: must be a finite number > 0, got 0"),
        (["--tasks", "t", "--limit", "nan"], "argument --limit: must be a finite number > 0, got nan"),
        (["--tasks", "t", "--num-fewshot", "-1"], "argument --num-fewshot: must be an integer >= 0, got -1"),
        (["--data", "d", "--max-tokens", "-5"], "argument --max-tokens: must be an integer >= 2, got -5"),
        (["--data", "d", "--max-tokens", "1"], "argument --max-tokens: must be an integer >= 2, got 1"),
        (["--data", "d", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
        (["--data", "d", "--batch-size", "two"], "argument --batch-size: expected an integer >= 1, got 'two'"),
    ],
)
def test_eval_numbers_out_of_range_are_refused_naming_the_option_and_range(argv, message, capsys):
    from ferrolm.app.cli import main

    with pytest.raises(SystemExit) as e:  # refused while parsing: nothing is loaded
        main(["eval", "--checkpoint", "no-such-run", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err

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
    model = [f"model.{k}={v}" for k, v in TINY_MODEL.items()]
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

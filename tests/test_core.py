"""The compiled core under faults: a panic anywhere in it comes back as a Python exception
with the process alive and usable, and Ctrl-C during a long call is a prompt
KeyboardInterrupt.

Panics are injected through the hidden test hook ``ferrolm._core._arm_panic(site)``: the
site panics once, the next time it is reached. Each scenario runs in a child process with
a timeout, so that a hang fails the test instead of the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ferrolm import _core

# A child's common start: a small tokenizer trained on a built-in text (no shared data).
PRELUDE = """
import json, os, signal, subprocess, sys, time
from ferrolm import _core
from ferrolm.bpe.tokenizer import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog, 1234 times!\\n" * 50
# Trained from a file: training from an iterable batches its items with numpy, and one
# test needs numpy still unloaded here.
import tempfile
with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
    f.write(TEXT)
TOK = Tokenizer.train(f.name, 400, progress=False)
os.unlink(f.name)
BIG = ("Once upon a time there was a little girl. She liked to play. " * 40 + "<|endoftext|>") * 200

def failure(call):
    try:
        call()
    except BaseException as e:
        return type(e).__name__, str(e)
    return None
"""


def run_child(body: str, timeout: float = 120) -> dict:
    """Run PRELUDE + body in a new interpreter; body prints one JSON object last."""
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_injected(failed):
    assert failed is not None, "the call succeeded although a panic was armed"
    name, message = failed
    assert "fault injected" in message, failed
    assert name != "KeyboardInterrupt", failed


def test_unknown_fault_site_is_a_value_error():
    with pytest.raises(ValueError, match="train-merge"):
        _core._arm_panic("nowhere")


@pytest.mark.parametrize("site", ["train-count", "train-merge"])
def test_trainer_panic_is_an_exception_and_training_works_after(site, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("low lower lowest newer wider<|endoftext|>" * 200)
    got = run_child(
        f"""
        from ferrolm.bpe.trainer import train_bpe
        want = train_bpe({str(path)!r}, 300)
        _core._arm_panic({site!r})
        failed = failure(lambda: train_bpe({str(path)!r}, 300, num_threads=2))
        again = train_bpe({str(path)!r}, 300, num_threads=2)
        print(json.dumps(dict(failed=failed, same=again == want)))
        """
    )
    assert_injected(got["failed"])
    assert got["same"]


def test_encoder_panic_is_an_exception_on_every_path_and_the_encoder_works_after(tmp_path):
    path = tmp_path / "big.txt"
    got = run_child(
        f"""
        import numpy as np
        path = {str(path)!r}
        with open(path, "w", newline="") as f:
            f.write(BIG)
        calls = dict(
            small=lambda: TOK.encode("hello world"),
            large=lambda: TOK.encode(BIG),
            numpy_parallel=lambda: TOK.encode_to_numpy(BIG, num_threads=2).tolist(),
            numpy_serial=lambda: TOK.encode_to_numpy(BIG, num_threads=1).tolist(),
            batch=lambda: TOK.encode_batch([BIG, "x", BIG], num_threads=2),
            batch_numpy=lambda: [a.tolist() for a in TOK.encode_batch_to_numpy([BIG, "x"], num_threads=2)],
            file=lambda: TOK.encode_file(path, num_threads=2).tolist(),
            stream=lambda: list(TOK.encode_iterable([BIG[:5000], BIG[5000:]])),
        )
        out = {{}}
        for name, call in calls.items():
            want = call()
            _core._arm_panic("encode")
            failed = failure(call)
            _core._disarm_panics()
            out[name] = dict(failed=failed, same=call() == want)
        print(json.dumps(out))
        """
    )
    for name, r in got.items():
        assert_injected(r["failed"]), name
        assert r["same"], name


@pytest.mark.parametrize("site", ["encode", "shard-write"])
def test_shard_writer_panic_is_an_exception_and_a_rerun_completes(site, tmp_path):
    src = tmp_path / "in.txt"
    got = run_child(
        f"""
        from ferrolm.bpe import shards
        with open({str(src)!r}, "w") as f:
            f.write(BIG * 3)
        kw = dict(progress=False, chunk_size=1 << 16, threads=2)
        shards.encode(TOK, {str(src)!r}, {str(tmp_path / "clean")!r}, **kw)
        _core._arm_panic({site!r})
        failed = failure(lambda: shards.encode(TOK, {str(src)!r}, {str(tmp_path / "out")!r}, **kw))
        shards.encode(TOK, {str(src)!r}, {str(tmp_path / "out")!r}, **kw)
        print(json.dumps(dict(failed=failed)))
        """
    )
    assert_injected(got["failed"])
    assert (tmp_path / "out.bin").read_bytes() == (tmp_path / "clean.bin").read_bytes()


def test_ctrl_c_while_numpy_loads_is_a_keyboard_interrupt():
    # The first numpy-returning call loads numpy's C API; Ctrl-C during that import (sent
    # here by an import hook, at the moment numpy starts to load) must stay a
    # KeyboardInterrupt, and the next call must work.
    got = run_child(
        """
        import importlib.abc
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert "numpy" not in sys.modules

        class CtrlC(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "numpy":
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, CtrlC())
        failed = failure(lambda: TOK.encode_to_numpy("hello world"))
        again = TOK.encode_to_numpy("hello world").tolist()
        print(json.dumps(dict(failed=failed, same=again == TOK.encode("hello world"))))
        """
    )
    assert got["failed"] is not None and got["failed"][0] == "KeyboardInterrupt", got
    assert got["same"]


@pytest.mark.parametrize(
    ("call", "at"),
    [
        ("encode", 0.1),
        ("encode_to_numpy", 0.1),
        ("encode_batch", 0.1),
        # Half way through, encode_batch is filling its lists (most of the call, with the
        # GIL held): that part stops on Ctrl-C too.
        ("encode_batch", 0.5),
    ],
)
def test_ctrl_c_stops_one_long_encode_promptly(call, at):
    # One long call, timed whole first; then Ctrl-C a fraction `at` of the way in must stop
    # it long before it would have finished (the whole text is one call: without checks
    # inside the core, the interrupt waits for the end).
    got = run_child(
        f"""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # ~30 MB (~120 MB for the parallel numpy encode, which is that much faster): long
        # enough that the stop, within a poll of 50 ms, is a small part of the call.
        text = BIG * (240 if {call!r} == "encode_to_numpy" else 60)
        call = dict(
            encode=lambda: TOK.encode(text),
            encode_to_numpy=lambda: TOK.encode_to_numpy(text, num_threads=2),
            encode_batch=lambda: TOK.encode_batch([text[: len(text) // 2], text[len(text) // 2 :]], num_threads=2),
        )[{call!r}]
        TOK.encode_to_numpy("numpy loaded before the timing")
        # the faster of two runs: a first, colder run could outlast the interrupted one by
        # more than the interrupt's lead, so the signal would land after the call
        full = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            call()
            full = min(full, time.perf_counter() - t0)
        # Sent from outside, as a terminal's Ctrl-C is: a thread of this process could not
        # run while the core holds the GIL.
        t0 = time.perf_counter()
        sender = subprocess.Popen(["sh", "-c", f"sleep {{full * {at}:.3f}}; kill -INT {{os.getpid()}}"])
        failed = failure(call)
        stopped = time.perf_counter() - t0
        sender.wait()
        works = TOK.encode("hello world") == TOK.encode("hello world")
        print(json.dumps(dict(failed=failed, full=full, stopped=stopped, works=works)))
        """,
        timeout=300,
    )
    assert got["failed"] is not None and got["failed"][0] == "KeyboardInterrupt", got
    assert got["stopped"] < got["full"] * (at + 0.35), got
    assert got["works"]

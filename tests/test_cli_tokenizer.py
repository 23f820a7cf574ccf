"""`ferrolm train-tokenizer` and the corpus commands' help and errors, through the real CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import shared_file

from ferrolm.bpe.tokenizer import Tokenizer


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ferrolm", *map(str, args)], capture_output=True, text=True)


@pytest.mark.parametrize("command", ["train-tokenizer", "encode", "decode", "shards"])
def test_help_explains_each_command(command):
    r = run_cli(command, "--help")
    assert r.returncode == 0
    assert "usage: ferrolm " + command in r.stdout
    assert len(r.stdout) > 400  # a description, not just the usage line


def test_train_tokenizer_summary_and_output(tmp_path):
    src = shared_file("fixtures/tinystories_sample.txt")
    out = tmp_path / "tok"
    r = run_cli("train-tokenizer", "--input", src, "--vocab-size", 400, "--out", out, "--no-progress", "--threads", 1)
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.load(out)
    assert tok.vocab_size == 400 and len(tok.merges) == 400 - 256 - 1
    assert tok.special_tokens == ["<|endoftext|>"] and tok.eos_id is not None
    text = r.stdout
    for what in ("time", "peak memory", "MB (VmHWM)", "merges        143", "bytes/token", "longest tokens:"):
        assert what in text, (what, text)
    longest = text.split("longest tokens:\n")[1].strip().splitlines()
    assert len(longest) == 10
    lengths = [int(line.split()[0]) for line in longest]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == max(
        len(b) for b in tok.vocab.values() if b != b"<|endoftext|>"
    )
    # Its compression figure is that of the tokenizer on the sample.
    sample = src.read_bytes()[: 1 << 20].decode("utf-8", "ignore")
    bpt = len(sample.encode()) / len(tok.encode(sample))
    assert f"{bpt:.2f} bytes/token" in text


def test_train_tokenizer_special_tokens_and_pattern(tmp_path):
    src = shared_file("fixtures/tinystories_sample.txt")
    out = tmp_path / "tok"
    r = run_cli(
        "train-tokenizer",
        "--input",
        src,
        "--vocab-size",
        300,
        "--special-token",
        "<|endoftext|>",
        "--special-token",
        "<|pad|>",
        "--pattern",
        "cl100k",
        "--out",
        out,
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.load(out)
    assert tok.special_tokens == ["<|endoftext|>", "<|pad|>"] and tok.vocab_size == 300


def test_train_tokenizer_bad_input_is_a_clear_error(tmp_path):
    r = run_cli("train-tokenizer", "--input", tmp_path / "missing.txt", "--vocab-size", 300, "--out", tmp_path / "t")
    assert r.returncode == 2 and "missing.txt" in r.stderr and "not found" in r.stderr
    assert not (tmp_path / "t").exists()
    src = tmp_path / "in.txt"
    src.write_text("hello world " * 50)
    r = run_cli("train-tokenizer", "--input", src, "--vocab-size", 10, "--out", tmp_path / "t", "--no-progress")
    assert r.returncode == 2 and "vocab" in r.stderr.lower()
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("vocab_size", ["9223372036854775807", "4294967296"])
def test_train_tokenizer_vocab_size_beyond_32_bit_ids_is_a_clear_error(tmp_path, vocab_size):
    src = tmp_path / "in.txt"
    src.write_text("hello world " * 50)
    out = tmp_path / "t"
    r = run_cli("train-tokenizer", "--input", src, "--vocab-size", vocab_size, "--out", out, "--no-progress")
    assert r.returncode == 2 and "at most 4294967295" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_missing_required_arguments_exit_nonzero():
    r = run_cli("encode", "--input", "x.txt")
    assert r.returncode == 2 and "--tokenizer" in r.stderr

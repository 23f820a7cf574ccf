"""`ferrolm train-tokenizer` and the corpus commands' help and errors, through the real CLI."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from texts import fixture_file

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
    src = fixture_file("tinystories_sample.txt")
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
    src = fixture_file("tinystories_sample.txt")
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


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A tokenizer directory, its training text and a shard of it."""
    d = tmp_path_factory.mktemp("small")
    (d / "in.txt").write_text("the cat sat on the mat. " * 200 + "<|endoftext|>" + "a dog. " * 50)
    Tokenizer.train(iter([(d / "in.txt").read_text()]), 300, ["<|endoftext|>"], progress=False).save(d / "tok")
    r = run_cli("encode", "--tokenizer", d / "tok", "--input", d / "in.txt", "--out", d / "s", "--no-progress")
    assert r.returncode == 0, r.stderr
    return d


def assert_clear_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


@pytest.mark.parametrize("size", ["-1", "0", "1e30", "nan"])
def test_encode_chunk_size_out_of_range_is_a_clear_error(small, tmp_path, size):
    args = ["--tokenizer", small / "tok", "--input", small / "in.txt", "--out", tmp_path / "x", "--chunk-size", size]
    r = run_cli("encode", *args)
    assert_clear_error(r, "--chunk-size must be more than 0 and at most 4096 MB")
    assert not (tmp_path / "x.bin").exists()


def test_train_tokenizer_on_an_empty_directory_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    r = run_cli("train-tokenizer", "--input", tmp_path / "empty", "--vocab-size", 300, "--out", tmp_path / "t")
    assert_clear_error(r, "holds no files")


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("gpt3", "unknown pattern name 'gpt3' (did you mean 'gpt2'?)"),
        ("", "the pattern is empty"),
        (r"\p{Foo}+", "unknown property"),
    ],
)
def test_train_tokenizer_bad_pattern_names_the_problem(small, tmp_path, pattern, message):
    args = ["--input", small / "in.txt", "--vocab-size", 300, "--pattern", pattern, "--out", tmp_path / "t"]
    r = run_cli("train-tokenizer", *args)
    assert_clear_error(r, message)
    assert "corpus is empty" not in r.stderr and "error parsing pattern 0" not in r.stderr


def test_a_one_byte_special_token_is_refused_before_training(small, tmp_path):
    r = run_cli(
        "train-tokenizer",
        "--input",
        small / "in.txt",
        "--vocab-size",
        300,
        "--special-token",
        "a",
        "--out",
        tmp_path / "t",
    )
    assert_clear_error(r, "--special-token 'a' is a single byte")
    assert not (tmp_path / "t").exists()


def test_decode_of_an_odd_sized_bin_names_the_file(small, tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"abc")
    r = run_cli("decode", "--tokenizer", small / "tok", "--input", tmp_path / "odd.bin")
    assert_clear_error(r, "odd.bin: 3 bytes is not a whole number of uint16 tokens")


def test_shards_with_a_string_count_reports_it(small, tmp_path):
    import json

    for ext in (".bin", ".json"):
        (tmp_path / f"s{ext}").write_bytes((small / f"s{ext}").read_bytes())
    side = json.loads((tmp_path / "s.json").read_text())
    side["num_tokens"] = str(side["num_tokens"])
    (tmp_path / "s.json").write_text(json.dumps(side))
    r = run_cli("shards", tmp_path / "s")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "s.json: num_tokens must be a non-negative integer, got '" in r.stderr


def test_shards_without_deep_says_ids_were_not_read(small):
    r = run_cli("shards", small / "s")
    assert r.returncode == 0 and "token ids not read (--deep" in r.stdout
    r = run_cli("shards", small / "s", "--deep")
    assert r.returncode == 0 and "not read" not in r.stdout


def _jsonl_of(docs: list[str]) -> str:
    import json

    return "".join(json.dumps({"text": d}) + "\n" for d in docs)


def test_a_lone_surrogate_in_json_lines_costs_neither_summary_nor_exit_status(tmp_path):
    # "\ud800" alone is valid JSON but no Unicode: the trainer reads it as U+FFFD, so must the summary.
    src = tmp_path / "docs.jsonl"
    src.write_text(
        _jsonl_of([f"story {i}: a\ud800b the cat sat" for i in range(200)]), encoding="utf-8", errors="surrogatepass"
    )
    r = run_cli("train-tokenizer", "--input", src, "--vocab-size", 300, "--out", tmp_path / "tok", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "bytes/token" in r.stdout and "longest tokens:" in r.stdout
    assert Tokenizer.load(tmp_path / "tok").vocab_size == 300


def test_zst_input_without_zstandard_trains_and_skips_only_the_compression_line(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    src = tmp_path / "docs.jsonl.zst"
    data = _jsonl_of([f"story {i}: the cat sat on the mat" for i in range(300)]).encode("utf-8")
    src.write_bytes(zstandard.ZstdCompressor().compress(data))
    # The core reads .zst itself; only the summary's sample needs the Python package.
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['zstandard'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-m", "ferrolm", "train-tokenizer", "--input", str(src), "--vocab-size", "300"]
        + ["--out", str(tmp_path / "tok"), "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "compression not measured" in r.stderr and 'pip install "ferrolm[zstd]"' in r.stderr
    assert "bytes/token" not in r.stdout and "longest tokens:" in r.stdout
    assert Tokenizer.load(tmp_path / "tok").vocab_size == 300


def _subcommands():
    from ferrolm.app.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_shared_options_read_the_same_in_every_command():
    helps: dict = {}
    for name, sub in _subcommands().items():
        for action in sub._actions:
            for flag in ("--checkpoint", "--device", "--column"):
                if flag in action.option_strings:
                    helps.setdefault(flag, {})[name] = (action.help, action.default, action.metavar)
    assert set(helps["--checkpoint"]) == {"generate", "serve", "export", "eval", "chat"}
    assert set(helps["--device"]) == {"generate", "serve", "eval", "demo", "chat"}
    assert set(helps["--column"]) == {"encode", "train-tokenizer"}
    for flag, by_command in helps.items():
        assert len(set(by_command.values())) == 1, (flag, by_command)


def test_out_takes_its_short_form_in_every_command_that_writes():
    with_out = {name: sub for name, sub in _subcommands().items() if "--out" in sub._option_string_actions}
    assert {"plot", "train-tokenizer", "encode", "export", "demo", "download"} <= set(with_out)
    for name, sub in with_out.items():
        assert sub._option_string_actions["-o"] is sub._option_string_actions["--out"], name

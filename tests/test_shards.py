"""`ferrolm encode` / ferrolm.bpe.shards: exact ids, sidecars, parts, resume after kill -9, bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from texts import SEPARATOR, stories_text, write_corpus

from ferrolm.bpe import inputs, shards
from ferrolm.bpe.tokenizer import Tokenizer

EOT = "<|endoftext|>"


@pytest.fixture(scope="session")
def gpt2_tok(gpt2_vocab_merges):
    vocab, merges = gpt2_vocab_merges
    return Tokenizer(vocab, merges, [EOT])


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory, gpt2_tok):
    d = tmp_path_factory.mktemp("tok") / "gpt2"
    gpt2_tok.save(d)
    return d


def docs_text(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "it's", "Ünïcode", "数据", "123", "4567", "!!", "\n", "\n\n", "  ", "hello", "—", "don't"]
    out = []
    for _ in range(n):
        k = int(rng.integers(3, 60))
        out.append(" ".join(words[i] for i in rng.integers(0, len(words), k)))
    return "".join(f"{d}\n{EOT}\n" for d in out)


def read_bin(prefix, dtype="<u2") -> np.ndarray:
    return np.fromfile(f"{prefix}.bin", dtype=dtype)


def run_cli(*args, check=False, env=None, **kw):
    """The CLI in a subprocess (for kills, signals and process exit codes)."""
    return subprocess.run(
        [sys.executable, "-m", "ferrolm", *map(str, args)], capture_output=True, text=True, env=env, check=check, **kw
    )


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys):
    """The CLI in this process (`ferrolm.app.cli.main`), capturing its output."""
    from ferrolm.app.cli import main

    def run(*args, check=False):
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        if check:
            assert rc == 0, err
        return Result(rc, out, err)

    return run


# ------------------------------------------------------------------ exactness


def test_plain_text_equals_tiktoken_whole_file_encoding(tmp_path, gpt2_tok, tiktoken_gpt2):
    # Each document followed by the separator, as in TinyStories' files: no eos is added at the end.
    src = tmp_path / "stories.txt"
    src.write_bytes((stories_text(1_600_000).rstrip("\n") + SEPARATOR).encode("utf-8"))
    sc = shards.encode(gpt2_tok, [src], tmp_path / "ts", progress=False, chunk_size=64 << 10)
    text = src.read_text(encoding="utf-8")
    expected = tiktoken_gpt2.encode(text, allowed_special="all")
    ids = read_bin(tmp_path / "ts")
    assert ids.tolist() == expected
    assert sc["num_tokens"] == len(expected)
    assert sc["num_documents"] == expected.count(50256) == text.count(EOT)
    side = json.loads((tmp_path / "ts.json").read_text())
    assert side["format"] == "ferrolm-shard" and side["format_version"] == 1
    assert side["dtype"] == "uint16" and side["vocab_size"] == 50257 and side["eos_id"] == 50256
    assert side["tokenizer_fingerprint"] == gpt2_tok.fingerprint
    _, size, mtime_ns, sample = inputs.identity(src)
    assert side["inputs"] == [
        {
            "path": str(src),
            "bytes": size,
            "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
            "mtime_ns": mtime_ns,
            "sample_sha256": sample,
        }
    ]
    assert side["part"] is None and side["byte_range"] is None
    assert not (tmp_path / "ts.progress.json").exists() and not (tmp_path / "ts.bin.partial").exists()


def test_output_is_identical_for_any_threads_and_chunk_size(tmp_path, gpt2_tok):
    src = tmp_path / "in.txt"
    src.write_text(docs_text(400), encoding="utf-8")
    outs = []
    for i, (threads, chunk) in enumerate([(1, 1 << 20), (2, 1000), (3, 333), (2, 50)]):
        shards.encode(gpt2_tok, src, tmp_path / f"o{i}", threads=threads, chunk_size=chunk, progress=False)
        outs.append((tmp_path / f"o{i}.bin").read_bytes())
    assert all(o == outs[0] for o in outs)
    assert outs[0] == np.asarray(gpt2_tok.encode(src.read_text(encoding="utf-8")), dtype="<u2").tobytes()


def test_gz_zst_and_multiple_inputs(tmp_path, gpt2_tok):
    zstandard = pytest.importorskip("zstandard")
    a, b = docs_text(50, 1), docs_text(60, 2) + "last doc without separator"
    pa = tmp_path / "a.txt.gz"
    pa.write_bytes(gzip.compress(a.encode()))
    pb = tmp_path / "b.txt.zst"
    pb.write_bytes(zstandard.ZstdCompressor().compress(b.encode()))
    sc = shards.encode(gpt2_tok, [pa, pb], tmp_path / "c", progress=False)
    expected = gpt2_tok.encode(a) + gpt2_tok.encode(b) + [50256]
    assert read_bin(tmp_path / "c").tolist() == expected
    assert sc["num_documents"] == 111
    assert [r["sha256"] for r in sc["inputs"]] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in (pa, pb)]
    assert [r["uncompressed_bytes"] for r in sc["inputs"]] == [len(a.encode()), len(b.encode())]


def test_no_hash_records_null_and_writes_the_same_ids(tmp_path, gpt2_tok):
    src = tmp_path / "in.txt"
    src.write_text(docs_text(40, 13), encoding="utf-8")
    shards.encode(gpt2_tok, src, tmp_path / "h", progress=False)
    side = shards.encode(gpt2_tok, src, tmp_path / "n", progress=False, hash_inputs=False)
    assert side["inputs"][0]["sha256"] is None
    assert json.loads((tmp_path / "n.json").read_text())["inputs"][0]["sha256"] is None
    assert (tmp_path / "n.bin").read_bytes() == (tmp_path / "h.bin").read_bytes()


def test_jsonl_documents_are_ordinary_text_each_followed_by_eos(tmp_path, gpt2_tok):
    docs = ["Hello there.", "A doc mentioning <|endoftext|> literally", "über\nlines"]
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"id": i, "story": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    sc = shards.encode(gpt2_tok, p, tmp_path / "j", jsonl_field="story", progress=False)
    expected = [i for d in docs for i in gpt2_tok.encode_ordinary(d) + [50256]]
    assert read_bin(tmp_path / "j").tolist() == expected
    assert sc["num_documents"] == 3
    with pytest.raises(ValueError, match=r"docs.jsonl:1: .*\"text\""):
        shards.encode(gpt2_tok, p, tmp_path / "j2", progress=False)
    assert not (tmp_path / "j2.bin").exists() and not (tmp_path / "j2.json").exists()


def test_uint32_when_the_vocab_does_not_fit(tmp_path):
    # A sparse vocab whose end-of-text id is above 65535.
    vocab = {i: bytes([i]) for i in range(256)}
    vocab[70000] = EOT.encode()
    tok = Tokenizer(vocab, [], [EOT])
    src = tmp_path / "in.txt"
    src.write_text(f"ab{EOT}\ncd", encoding="utf-8")
    sc = shards.encode(tok, src, tmp_path / "u", progress=False)
    assert sc["dtype"] == "uint32"
    assert read_bin(tmp_path / "u", "<u4").tolist() == [97, 98, 70000, 10, 99, 100, 70000]
    with pytest.raises(ValueError, match="does not fit in uint16"):
        shards.encode(tok, src, tmp_path / "u16", dtype="uint16", progress=False)
    assert not list(tmp_path.glob("u16*"))


# ------------------------------------------------------------------ parts


def test_parts_concatenate_to_the_whole_and_validate(tmp_path, gpt2_tok, gpt2_dir, cli):
    a = tmp_path / "a.txt"
    a.write_text(docs_text(300, 3), encoding="utf-8")
    b = tmp_path / "b.txt.gz"
    b.write_bytes(gzip.compress(docs_text(40, 4).encode()))
    c = tmp_path / "c.txt"
    c.write_text(docs_text(200, 5), encoding="utf-8")
    inputs = [a, b, c]
    shards.encode(gpt2_tok, inputs, tmp_path / "whole", progress=False)
    n = 4
    for i in range(n):
        r = cli(
            "encode",
            "--tokenizer",
            gpt2_dir,
            "--input",
            *inputs,
            "--out",
            tmp_path / "p",
            "--part",
            f"{i}/{n}",
            "--no-progress",
        )
        assert r.returncode == 0, r.stderr
    cat = b"".join((tmp_path / f"p.part-{i}-of-{n}.bin").read_bytes() for i in range(n))
    assert cat == (tmp_path / "whole.bin").read_bytes()
    assert shards.validate_shards(tmp_path / "p", tokenizer=gpt2_tok) == []
    recs = shards.list_shards(tmp_path / "p")
    assert [r["part"] for r in recs] == [[i, n] for i in range(n)]
    assert recs[0]["byte_range"][0] == 0 and recs[-1]["byte_range"][1] == sum(p.stat().st_size for p in inputs)
    r = cli("shards", tmp_path / "p", "--tokenizer", gpt2_dir, "--deep")
    assert r.returncode == 0, r.stderr
    assert "p.part-3-of-4.bin" in r.stdout and "total" in r.stdout
    manifest = tmp_path / "m.json"
    manifest.write_text(
        json.dumps({"format": "ferrolm-shards-manifest", "parts": [f"p.part-{i}-of-{n}" for i in range(n)]})
    )
    assert [r["part"] for r in shards.list_shards(manifest)] == [[i, n] for i in range(n)]
    assert shards.validate_shards(manifest) == []
    # A missing part, a truncated .bin and another tokenizer are all reported.
    (tmp_path / "p.part-2-of-4.json").unlink()
    r = cli("shards", tmp_path / "p")
    assert r.returncode == 1 and "1 of 4 parts missing (part 2)" in r.stderr
    with open(tmp_path / "whole.bin", "r+b") as f:
        f.truncate(10)
    problems = shards.validate_shards(tmp_path / "whole", tokenizer="0" * 64)
    assert any("10 bytes" in p for p in problems) and any("fingerprint" in p for p in problems)


# ------------------------------------------------------------------ bad input


def test_missing_input_and_bad_tokenizer_dir(tmp_path, gpt2_dir, cli):
    r = run_cli("encode", "--tokenizer", gpt2_dir, "--input", tmp_path / "nope.txt", "--out", tmp_path / "o")
    assert r.returncode == 2 and "nope.txt" in r.stderr and "not found" in r.stderr
    bad = tmp_path / "badtok"
    bad.mkdir()
    (bad / "vocab.json").write_text("{not json")
    (bad / "merges.txt").write_text("#version: 0.2\n")
    src = tmp_path / "in.txt"
    src.write_text("hello")
    r = cli("encode", "--tokenizer", bad, "--input", src, "--out", tmp_path / "o")
    assert r.returncode == 2 and "incomplete tokenizer directory" in r.stderr  # a bare pair: no record
    r = cli("encode", "--tokenizer", tmp_path / "nodir", "--input", src, "--out", tmp_path / "o")
    assert r.returncode == 2 and "tokenizer directory not found" in r.stderr
    assert not list(tmp_path.glob("o.*"))


def test_invalid_utf8_names_file_and_offset_or_is_replaced(tmp_path, gpt2_dir, gpt2_tok, cli):
    good = docs_text(30, 6).encode()
    data = good + b"caf\xe9 au lait" + good
    src = tmp_path / "latin1.txt"
    src.write_bytes(data)
    r = cli("encode", "--tokenizer", gpt2_dir, "--input", src, "--out", tmp_path / "o", "--no-progress")
    assert r.returncode == 2
    assert (
        "latin1.txt" in r.stderr
        and f"invalid UTF-8 at byte offset {len(good) + 3}" in r.stderr
        and "--errors replace" in r.stderr
    )
    assert not list(tmp_path.glob("o.*"))  # no final files, no partial, no journal
    r = cli(
        "encode",
        "--tokenizer",
        gpt2_dir,
        "--input",
        src,
        "--out",
        tmp_path / "o",
        "--errors",
        "replace",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    assert read_bin(tmp_path / "o").tolist() == gpt2_tok.encode(data.decode("utf-8", "replace"))


def test_corrupt_gzip_is_a_clear_error(tmp_path, gpt2_dir, cli):
    blob = bytearray(gzip.compress(docs_text(200, 7).encode()))
    for i in range(30, 80):
        blob[i] ^= 0x55
    src = tmp_path / "broken.txt.gz"
    src.write_bytes(bytes(blob))
    r = cli("encode", "--tokenizer", gpt2_dir, "--input", src, "--out", tmp_path / "o", "--no-progress")
    assert r.returncode == 2 and "broken.txt.gz" in r.stderr and "corrupt or truncated gzip" in r.stderr
    assert "Traceback" not in r.stderr and "panicked" not in r.stderr
    assert not (tmp_path / "o.bin").exists()


def test_disk_full_hook_then_resume(tmp_path, gpt2_dir, gpt2_tok, cli, monkeypatch):
    """Write failure with ENOSPC (injected via FERROLM_TEST_FAIL_WRITE_AFTER): clear message, nothing at
    the final name; once space is back, rerunning resumes and gives the full output."""
    src = tmp_path / "in.txt"
    text = docs_text(3000, 8)
    src.write_text(text, encoding="utf-8")
    args = [
        "encode",
        "--tokenizer",
        gpt2_dir,
        "--input",
        src,
        "--out",
        tmp_path / "o",
        "--no-progress",
        "--chunk-size",
        "0.002",
        "--commit-interval",
        "0",
    ]
    monkeypatch.setenv("FERROLM_TEST_FAIL_WRITE_AFTER", "20000")
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    assert "no space left" in r.stderr and "o.bin.partial" in r.stderr
    assert not (tmp_path / "o.bin").exists() and not (tmp_path / "o.json").exists()
    monkeypatch.delenv("FERROLM_TEST_FAIL_WRITE_AFTER")
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert "resumed after" in r.stderr
    assert read_bin(tmp_path / "o").tolist() == gpt2_tok.encode(text)


def test_real_disk_full_on_a_tiny_tmpfs(tmp_path, gpt2_tok):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        src = tmp_path / "in.txt"
        src.write_text(docs_text(6000, 9), encoding="utf-8")  # ~1 MB of ids, 4x the tmpfs
        with pytest.raises(OSError, match="no space left") as e:
            shards.encode(gpt2_tok, src, mnt / "o", progress=False)
        assert e.value.errno == 28
        assert not (mnt / "o.bin").exists() and not (mnt / "o.json").exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ------------------------------------------------------------------ resume after kill


def _journal_tokens(path: Path) -> int:
    try:
        return json.loads(path.read_text()).get("tokens", 0)
    except (OSError, ValueError):
        return 0


def _start_and_kill(args, journal: Path, sig=signal.SIGKILL, min_tokens=1) -> int:
    """Start `ferrolm encode`, wait until its journal records progress, then send `sig`."""
    # SIGINT back to its default in the child: a test run started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then installs no handler.
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrolm", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if _journal_tokens(journal) >= min_tokens:
            proc.send_signal(sig)
            break
        time.sleep(0.002)
    out, err = proc.communicate()
    return proc.returncode, err


def test_kill_9_at_any_moment_then_rerun_gives_identical_bytes(tmp_path, gpt2_dir, gpt2_tok, cli):
    # 25 MB: large enough that the encode is still running at each kill.
    src = write_corpus(tmp_path / "code.txt", "stdlib", 25_000_000)
    shards.encode(gpt2_tok, src, tmp_path / "ref", progress=False)
    args = [
        "encode",
        "--tokenizer",
        gpt2_dir,
        "--input",
        src,
        "--out",
        tmp_path / "o",
        "--no-progress",
        "--chunk-size",
        "0.25",
        "--commit-interval",
        "0",
        "--threads",
        "2",
    ]
    journal = tmp_path / "o.progress.json"
    kills = 0
    for min_tokens in (1, 2_000_000):  # kill early, then kill the resumed run further on
        rc, err = _start_and_kill(args, journal, min_tokens=min_tokens)
        if rc == 0:
            break  # it finished before the kill landed (a very fast machine): the final check still holds
        assert rc == -signal.SIGKILL, err
        kills += 1
        assert not (tmp_path / "o.bin").exists() and not (tmp_path / "o.json").exists()
        assert (tmp_path / "o.bin.partial").exists()
    assert kills >= 1, "the encode finished before it could be killed; use a larger input"
    # Resume with other --threads and --chunk-size: neither changes the output.
    args = args[: args.index("--chunk-size")] + ["--chunk-size", "1.5", "--commit-interval", "0", "--threads", "1"]
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert "resumed after" in r.stderr
    assert (tmp_path / "o.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    ref_side = json.loads((tmp_path / "ref.json").read_text())
    side = json.loads((tmp_path / "o.json").read_text())
    for key in ("num_tokens", "num_documents", "inputs", "tokenizer_fingerprint", "dtype"):
        assert side[key] == ref_side[key], key
    assert not journal.exists() and not (tmp_path / "o.bin.partial").exists()


def test_ctrl_c_stops_cleanly_and_resumes(tmp_path, gpt2_dir, gpt2_tok, cli):
    src = tmp_path / "in.txt"
    text = docs_text(20000, 10) * 10  # ~24 MB: long enough that the signal lands before the end on a fast machine
    src.write_text(text, encoding="utf-8")
    args = [
        "encode",
        "--tokenizer",
        gpt2_dir,
        "--input",
        src,
        "--out",
        tmp_path / "o",
        "--no-progress",
        "--chunk-size",
        "0.01",
        "--commit-interval",
        "0",
        "--threads",
        "1",
    ]
    rc, err = _start_and_kill(args, tmp_path / "o.progress.json", sig=signal.SIGINT)
    assert rc == 130, err
    assert "interrupted" in err and "rerun the same command" in err and "Traceback" not in err
    assert not (tmp_path / "o.bin").exists()
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(read_bin(tmp_path / "o"), gpt2_tok.encode_to_numpy(text))


def test_changed_options_start_over(tmp_path, gpt2_tok):
    src = tmp_path / "in.txt"
    src.write_text(docs_text(500, 11), encoding="utf-8")
    calls = []

    # Interrupt through the progress callback (what Ctrl-C does), after the first chunk.
    def stop(*a):
        calls.append(a)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        shards._core.encode_shard(
            gpt2_tok._core,
            [str(src)],
            str(tmp_path / "o.bin"),
            dtype="uint32",
            eos=(EOT, 50256),
            chunk_size=2000,
            commit_interval=0.0,
            params="A",
            progress=stop,
            progress_interval=0.0,
        )
    assert calls and (tmp_path / "o.progress.json").exists()
    sc = shards.encode(gpt2_tok, src, tmp_path / "o", progress=False)  # other params: starts over
    assert sc["resumed_tokens"] == 0 and "differ" in sc["restart_reason"]
    assert read_bin(tmp_path / "o").tolist() == gpt2_tok.encode(src.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"dtype": "int8"}, ValueError, 'dtype must be uint16 or uint32, got "int8"'),
        ({"input_format": "csv"}, ValueError, 'input format must be auto, text or jsonl, got "csv"'),
        ({"errors": "ignore"}, ValueError, "ignore"),
        ({"commit_interval": -1.0}, ValueError, "commit_interval must be a non-negative number of seconds"),
        ({"commit_interval": float("nan")}, ValueError, "commit_interval must be a non-negative"),
        ({"chunk_sise": 10}, TypeError, "unexpected keyword argument 'chunk_sise'"),
        ({"chunk_size": "big"}, TypeError, ""),
    ],
)
def test_encode_shard_options_are_checked_by_name(tmp_path, gpt2_tok, options, error, message):
    src = tmp_path / "in.txt"
    src.write_text("a b c", encoding="utf-8")
    kwargs = {"dtype": "uint16", **options}
    with pytest.raises(error, match=re.escape(message)):
        shards._core.encode_shard(gpt2_tok._core, [str(src)], str(tmp_path / "o.bin"), **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_part_range_refuses_an_unknown_input_format(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a b c", encoding="utf-8")
    with pytest.raises(ValueError, match='input format must be auto, text or jsonl, got "csv"'):
        shards._core.shard_part_range([str(src)], 0, 2, input_format="csv")


# ------------------------------------------------------------------ decode CLI


def test_decode_cli_prints_a_slice(tmp_path, gpt2_dir, gpt2_tok, cli):
    src = tmp_path / "in.txt"
    text = docs_text(50, 12)
    src.write_text(text, encoding="utf-8")
    shards.encode(gpt2_tok, src, tmp_path / "o", progress=False)
    ids = read_bin(tmp_path / "o").tolist()
    r = cli("decode", "--tokenizer", gpt2_dir, "--input", tmp_path / "o.bin", "--offset", 7, "--count", 40, check=True)
    assert r.stdout == gpt2_tok.decode(ids[7:47]) + "\n"
    r = cli("decode", "--tokenizer", gpt2_dir, "--input", tmp_path / "o.bin", check=True)
    assert r.stdout == text + "\n"
    r = cli("decode", "--tokenizer", gpt2_dir, "--input", tmp_path / "o.bin", "--offset", len(ids) + 1)
    assert r.returncode == 2 and "outside" in r.stderr


# ------------------------------------------------------------------ parquet, iterables, globs, formats


def _parquet(path, docs, row_group_size=500, **extra_columns):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pa.table({"id": list(range(len(docs))), "text": docs, **extra_columns}), path, row_group_size=row_group_size
    )
    return path


def _docs(text: str) -> list[str]:
    """The documents of a text whose documents each end with EOT (what a reader of it sees)."""
    docs = text.split(EOT)
    assert not docs[-1].strip()
    return docs[:-1]


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    tok = Tokenizer.train(iter(_docs(docs_text(300, seed=5))), 400, [EOT], progress=False)
    d = tmp_path_factory.mktemp("tok") / "small"
    tok.save(d)
    return tok, d


def test_parquet_encodes_to_the_shard_of_the_same_documents_in_a_text_file(tmp_path, small_tok):
    tok, _ = small_tok
    docs = _docs(docs_text(1500, seed=6))
    (tmp_path / "d.txt").write_text(EOT.join(docs) + EOT, encoding="utf-8")
    ref = shards.encode(tok, tmp_path / "d.txt", tmp_path / "ref", progress=False)
    _parquet(tmp_path / "d.parquet", docs, row_group_size=211)
    for threads, chunk in ((1, None), (2, 4096)):
        side = shards.encode(
            tok, tmp_path / "d.parquet", tmp_path / f"p{threads}", threads=threads, chunk_size=chunk, progress=False
        )
        assert (tmp_path / f"p{threads}.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
        assert side["num_documents"] == ref["num_documents"] == len(docs)
    rec = side["inputs"][0]
    assert rec["sha256"] == hashlib.sha256((tmp_path / "d.parquet").read_bytes()).hexdigest()
    # Another column, nulls (no document) and a column that is not text.
    _parquet(tmp_path / "b.parquet", docs[:3] + [None], body=["x", "y", "z", "w"])
    side = shards.encode(tok, tmp_path / "b.parquet", tmp_path / "b", progress=False)
    assert side["num_documents"] == 3
    side = shards.encode(tok, tmp_path / "b.parquet", tmp_path / "c", column="body", progress=False)
    assert read_bin(tmp_path / "c").tolist() == sum((tok.encode(x) + [tok.eos_id] for x in "xyzw"), [])
    with pytest.raises(ValueError, match="not a string column"):
        shards.encode(tok, tmp_path / "b.parquet", tmp_path / "e", column="id", progress=False)
    with pytest.raises(ValueError, match="no column 'story'.*id, text, body"):
        shards.encode(tok, tmp_path / "b.parquet", tmp_path / "e", column="story", progress=False)


def test_parquet_resumes_after_kill_9(tmp_path, small_tok, cli):
    tok, tok_dir = small_tok
    docs = _docs(docs_text(40_000, seed=7))
    _parquet(tmp_path / "d.parquet", docs, row_group_size=3000)
    shards.encode(tok, tmp_path / "d.parquet", tmp_path / "ref", progress=False)
    args = ["encode", "--tokenizer", tok_dir, "--input", tmp_path / "d.parquet", "--out", tmp_path / "o"]
    args += ["--no-progress", "--chunk-size", "0.02", "--commit-interval", "0", "--threads", "1"]
    rc, err = _start_and_kill(args, tmp_path / "o.progress.json", min_tokens=1)
    if rc != 0:  # else it finished before the kill landed; the final check still holds
        assert rc == -signal.SIGKILL, err
        assert (tmp_path / "o.bin.partial").exists() and not (tmp_path / "o.bin").exists()
    r = cli(*args[:-4], "--threads", "2")
    assert r.returncode == 0, r.stderr
    assert rc != 0 and "resumed after" in r.stderr
    assert (tmp_path / "o.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()


def test_encode_texts_writes_the_shard_the_cli_writes(tmp_path, small_tok, cli):
    tok, tok_dir = small_tok
    docs = _docs(docs_text(800, seed=8)) + ["", "the last one"]
    with open(tmp_path / "d.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    r = cli(
        "encode", "--tokenizer", tok_dir, "--input", tmp_path / "d.jsonl", "--out", tmp_path / "cli", "--no-progress"
    )
    assert r.returncode == 0, r.stderr
    side = shards.encode_texts(tok, (d for d in docs), tmp_path / "api", progress=False)
    assert (tmp_path / "api.bin").read_bytes() == (tmp_path / "cli.bin").read_bytes()
    cli_side = json.loads((tmp_path / "cli.json").read_text())
    assert set(side) >= set(cli_side) - {"total_input_bytes"}
    assert side["num_documents"] == cli_side["num_documents"] == len(docs)
    assert side["inputs"][0]["path"] is None and side["inputs"][0]["documents"] == len(docs)
    assert shards.validate_shards(tmp_path / "api", tokenizer=tok) == []
    with pytest.raises(TypeError, match="iterable of documents"):
        shards.encode_texts(tok, "d.txt", tmp_path / "x")
    # A lone surrogate is U+FFFD, as Tokenizer.encode has it.
    shards.encode_texts(tok, ["a \ud800 b"], tmp_path / "s", progress=False)
    assert read_bin(tmp_path / "s").tolist() == tok.encode("a \ufffd b") + [tok.eos_id]


def test_globs_and_folders_are_expanded_sorted_and_recorded(tmp_path, small_tok):
    tok, _ = small_tok
    (tmp_path / "in" / "sub").mkdir(parents=True)
    texts = {
        "in/b.txt": docs_text(5, 1),
        "in/a.txt": docs_text(5, 2),
        "in/sub/c.txt": docs_text(5, 3),
        "in/.hidden": "x",
    }
    for name, t in texts.items():
        (tmp_path / name).write_text(t, encoding="utf-8")
    ordered = [tmp_path / "in/a.txt", tmp_path / "in/b.txt", tmp_path / "in/sub/c.txt"]
    ref = shards.encode(tok, ordered, tmp_path / "ref", progress=False)
    side = shards.encode(tok, str(tmp_path / "in" / "**" / "*.txt"), tmp_path / "g", progress=False)
    assert [i["path"] for i in side["inputs"]] == [str(p) for p in ordered]
    assert side["input_patterns"] == [str(tmp_path / "in" / "**" / "*.txt")]
    assert (tmp_path / "g.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    side = shards.encode(tok, tmp_path / "in", tmp_path / "f", progress=False)
    assert [i["path"] for i in side["inputs"]] == [str(p) for p in ordered]
    assert side["num_tokens"] == ref["num_tokens"]
    with pytest.raises(FileNotFoundError, match="no file matches"):
        shards.encode(tok, str(tmp_path / "*.parquet"), tmp_path / "n", progress=False)


def test_formats_by_content_and_unsupported_ones_by_name(tmp_path, small_tok, cli):
    import lzma

    tok, tok_dir = small_tok
    docs = ["first document", "second\n\nplus"]
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "d.json").write_text(lines, encoding="utf-8")  # what datasets' to_json writes
    side = shards.encode(tok, tmp_path / "d.json", tmp_path / "j", progress=False)
    assert side["num_documents"] == 2
    assert read_bin(tmp_path / "j").tolist() == sum((tok.encode(d) + [tok.eos_id] for d in docs), [])
    (tmp_path / "d.txt.xz").write_bytes(lzma.compress(b"hello"))
    _parquet(tmp_path / "renamed.bin", docs)
    enc = ["encode", "--tokenizer", tok_dir, "--no-progress", "--out", tmp_path / "x", "--input"]
    r = cli(*enc, tmp_path / "d.txt.xz")
    assert r.returncode == 2 and "xz-compressed" in r.stderr and "UTF-8" not in r.stderr, r.stderr
    # Parquet is recognised by its content, whatever the name or --format.
    r = cli(*enc, tmp_path / "renamed.bin", "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    assert read_bin(tmp_path / "x").tolist() == read_bin(tmp_path / "j").tolist()


def test_an_output_that_would_replace_an_input_is_refused(tmp_path, small_tok, cli):
    _, tok_dir = small_tok
    victim = tmp_path / "victim.bin"
    victim.write_text(docs_text(20), encoding="utf-8")
    before = victim.read_bytes()
    os.link(victim, tmp_path / "hard.txt")
    os.symlink(victim, tmp_path / "soft.json")
    enc = ["encode", "--tokenizer", tok_dir, "--no-progress"]
    for inp, out in (
        (victim, tmp_path / "victim"),
        (tmp_path / "hard.txt", tmp_path / "victim"),
        (victim, tmp_path / "soft"),
    ):
        r = cli(*enc, "--input", inp, "--out", out)
        assert r.returncode == 2 and "would replace the input" in r.stderr, r.stderr
    assert victim.read_bytes() == before


def _interrupt_at_first_report(tok, src, out):
    """Encode ``src`` to ``out`` and stop it (KeyboardInterrupt) at its first progress
    report, so part of the input is journaled."""

    def stop_soon(*a):
        raise KeyboardInterrupt

    bar = shards._Progress
    shards._Progress = lambda *a, **k: type("P", (), {"__call__": staticmethod(stop_soon), "close": lambda s: None})()
    try:
        with pytest.raises(KeyboardInterrupt):
            shards.encode(tok, src, out, chunk_size=4096, commit_interval=0, threads=1)
    finally:
        shards._Progress = bar


def test_an_input_edited_in_place_with_its_time_restored_is_not_resumed(tmp_path, small_tok):
    tok, _ = small_tok
    src = tmp_path / "d.txt"
    # Large enough that the run is still going at the first progress report, whatever the CPU.
    text = docs_text(40000, seed=9)
    src.write_text(text, encoding="utf-8")
    ref_edit = text.replace("the", "THE", 50)
    (tmp_path / "edited.txt").write_text(ref_edit, encoding="utf-8")
    shards.encode(tok, tmp_path / "edited.txt", tmp_path / "ref", progress=False)

    _interrupt_at_first_report(tok, src, tmp_path / "o")
    st = src.stat()
    with open(src, "r+", encoding="utf-8") as f:  # same size, same modification time
        f.write(ref_edit)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    side = shards.encode(tok, src, tmp_path / "o", progress=False)
    assert side["resumed_tokens"] == 0 and side["restart_reason"]
    assert (tmp_path / "o.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert side["inputs"][0]["sha256"] == hashlib.sha256(ref_edit.encode()).hexdigest()


def test_a_parquet_input_edited_in_place_is_not_resumed(tmp_path, small_tok):
    # The file's hash is taken beside the encoding: a journal is committed only with it.
    tok, _ = small_tok
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    src = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": _docs(docs_text(40000, seed=11))}), src, compression="none")
    raw = src.read_bytes()
    at = raw.rindex(b" the ")
    edited = raw[:at] + b" THE " + raw[at + 5 :]  # same size; uncompressed pages still read
    (tmp_path / "edited.parquet").write_bytes(edited)
    shards.encode(tok, tmp_path / "edited.parquet", tmp_path / "ref", progress=False)

    _interrupt_at_first_report(tok, src, tmp_path / "o")
    journal = json.loads((tmp_path / "o.progress.json").read_text())
    assert journal["tokens"] > 0 and journal["digest"]
    st = src.stat()
    src.write_bytes(edited)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    side = shards.encode(tok, src, tmp_path / "o", progress=False)
    assert side["resumed_tokens"] == 0 and side["restart_reason"]
    assert (tmp_path / "o.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()


def test_parquet_is_read_without_pyarrow(tmp_path, small_tok, cli, monkeypatch):
    tok, tok_dir = small_tok
    _parquet(tmp_path / "d.parquet", ["a document", "another one"])
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    r = cli(
        "encode", "--tokenizer", tok_dir, "--input", tmp_path / "d.parquet", "--out", tmp_path / "o", "--no-progress"
    )
    assert r.returncode == 0, r.stderr
    want = sum((tok.encode(d) + [tok.eos_id] for d in ["a document", "another one"]), [])
    assert read_bin(tmp_path / "o").tolist() == want


@pytest.mark.parametrize("victim", ["out.bin", "out.json", "out.progress.json"])
def test_encode_never_replaces_a_file_it_did_not_write_unless_forced(tmp_path, small_tok, cli, victim):
    _, tok_dir = small_tok
    src = tmp_path / "in.txt"
    src.write_text(docs_text(20), encoding="utf-8")
    precious = tmp_path / victim
    precious.write_bytes(b'{"mine": "not a shard"}\n')
    enc = ["encode", "--tokenizer", tok_dir, "--no-progress", "--input", src, "--out", tmp_path / "out"]
    r = cli(*enc)
    assert r.returncode == 2, r.stderr
    assert f"{precious} exists" in r.stderr and "--force" in r.stderr, r.stderr
    assert precious.read_bytes() == b'{"mine": "not a shard"}\n'
    assert not (tmp_path / "out.bin.partial").exists()
    r = cli(*enc, "--force")
    assert r.returncode == 0, r.stderr
    assert shards.read_sidecar(tmp_path / "out.json")["num_tokens"] == len(read_bin(tmp_path / "out"))


def test_encode_replaces_its_own_shard_and_resumes_its_own_journal(tmp_path, small_tok, cli):
    tok, tok_dir = small_tok
    src = tmp_path / "in.txt"
    src.write_text(docs_text(200), encoding="utf-8")
    out = tmp_path / "out"
    enc = ["encode", "--tokenizer", tok_dir, "--no-progress", "--input", src, "--out", out]
    cli(*enc, check=True)
    first = read_bin(out)
    cli(*enc, check=True)  # an earlier shard of ferrolm's is replaced without --force
    _interrupt_at_first_report(tok, src, out)
    assert (tmp_path / "out.progress.json").exists()
    r = cli(*enc, check=True)  # and an interrupted run resumes without it
    assert "resumed after" in r.stderr, r.stderr
    assert np.array_equal(read_bin(out), first)
    # A run killed between its two renames leaves the data and the journal, no sidecar.
    _interrupt_at_first_report(tok, src, out)
    os.unlink(tmp_path / "out.json")
    cli(*enc, check=True)
    assert np.array_equal(read_bin(out), first)


def test_encode_texts_refuses_a_foreign_file_unless_forced(tmp_path, small_tok):
    tok, _ = small_tok
    precious = tmp_path / "out.json"
    precious.write_text("[1, 2, 3]\n", encoding="utf-8")
    with pytest.raises(FileExistsError, match="out.json exists"):
        shards.encode_texts(tok, ["one document"], tmp_path / "out", progress=False)
    assert precious.read_text(encoding="utf-8") == "[1, 2, 3]\n"
    shards.encode_texts(tok, ["one document"], tmp_path / "out", progress=False, force=True)
    assert shards.read_sidecar(precious)["num_documents"] == 1


# ------------------------------------------------------------------ the manifest


def test_manifest_written_and_read_in_one_place(tmp_path, gpt2_tok):
    """write_manifest names and writes P.manifest.json; the shard tools and TokenShards read the
    same parts from it, and refuse a manifest without parts with the same message."""
    from ferrolm.lm.data import TokenShards

    texts = [["one story", "two"], ["three stories here", "four"]]
    for i, docs in enumerate(texts):
        shards.encode_texts(gpt2_tok, docs, tmp_path / "sub" / f"c.part-{i}-of-2", progress=False)
    record = shards.write_manifest(tmp_path / "c", {"parts": ["sub/c.part-0-of-2", "sub/c.part-1-of-2"]})
    path = shards.manifest_path(tmp_path / "c")
    assert path == tmp_path / "c.manifest.json" and shards.manifest_path(tmp_path / "c.bin") == path
    assert json.loads(path.read_text()) == record
    assert record["format"] == shards.MANIFEST_FORMAT and record["format_version"] == shards.MANIFEST_VERSION
    assert shards.resolve_shards(path) == [tmp_path / "sub" / f"c.part-{i}-of-2.json" for i in range(2)]
    want = [t for i in range(2) for t in np.fromfile(tmp_path / "sub" / f"c.part-{i}-of-2.bin", dtype="<u2")]
    assert TokenShards(path)[:].tolist() == [int(t) for t in want]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": shards.MANIFEST_FORMAT, "parts": []}))
    for read in (shards.resolve_shards, TokenShards):
        with pytest.raises(shards.ShardError, match="a manifest needs a non-empty list of part prefixes"):
            read(bad)

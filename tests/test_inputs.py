"""Inputs are read one way: tokenizer training reads every file `ferrolm encode` reads,
with the same documents; what is not a regular file is refused by name; JSON Lines
surrogate escapes and byte-order marks are read as text, not as errors."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ferrolm.bpe import reference, shards
from ferrolm.bpe.tokenizer import Tokenizer
from ferrolm.bpe.trainer import train

EOT = "<|endoftext|>"


def quiet(input, vocab_size=330, specials=(EOT,), **kw):
    return train(input, vocab_size, specials, progress=False, num_threads=2, **kw)


def documents(n: int = 120, seed: int = 3) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "it's", "Ünïcode", "数据", "123", "!!", "\n", "\n\n", "  ", "hello", "—", "don't", '"q"']
    return [" ".join(words[i] for i in rng.integers(0, len(words), int(rng.integers(2, 40)))) for _ in range(n)]


def zstd_bytes(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "ferrolm", *map(str, args)], capture_output=True, text=True, timeout=60
    )


def assert_clear_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


@pytest.fixture(scope="module")
def docs_files(tmp_path_factory):
    """The same documents as plain text, JSON Lines, compressed and Parquet files."""
    d = tmp_path_factory.mktemp("inputs")
    docs = documents()
    plain = (EOT.join(docs) + EOT).encode()
    jsonl = "".join(json.dumps({"id": i, "text": t, "meta": {"text": "no"}}) + "\n" for i, t in enumerate(docs))
    files = {
        "plain": plain,
        "txt.gz": gzip.compress(plain),
        "txt.zst": zstd_bytes(plain),
        "jsonl": jsonl.encode(),
        "jsonl.gz": gzip.compress(jsonl.encode()),
        "jsonl.zst": zstd_bytes(jsonl.encode()),
        "bom.txt": b"\xef\xbb\xbf" + plain,
        "bom.jsonl": b"\xef\xbb\xbf" + jsonl.encode(),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = d / f"d.{name}"
        paths[name].write_bytes(data)
    return docs, paths


def test_training_reads_every_input_as_encode_does(docs_files):
    docs, paths = docs_files
    want = quiet(paths["plain"])
    assert want == reference.train_bpe(paths["plain"], 330, [EOT])
    for name, path in paths.items():
        assert quiet(path) == want, name
    # A small chunk size cuts JSON Lines and decompressed text into many chunks.
    from ferrolm.bpe import trainer as bpe_trainer

    old, bpe_trainer._CHUNK_SIZE = bpe_trainer._CHUNK_SIZE, 256
    try:
        for name in ("jsonl", "jsonl.zst", "txt.gz"):
            assert quiet(paths[name]) == want, name
    finally:
        bpe_trainer._CHUNK_SIZE = old


def test_training_reads_parquet_and_another_field(tmp_path, docs_files):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs, paths = docs_files
    want = quiet(paths["plain"])
    pq.write_table(pa.table({"body": docs}), tmp_path / "d.parquet", row_group_size=17)
    assert quiet(tmp_path / "d.parquet", column="body") == want
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in docs))
    assert quiet(tmp_path / "b.jsonl", column="body") == want
    with pytest.raises(ValueError, match=r"b\.jsonl:1: record has no \"text\" field"):
        quiet(tmp_path / "b.jsonl")


def test_train_tokenizer_cli_reads_json_lines_by_field(tmp_path, docs_files):
    docs, paths = docs_files
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"story": t}) + "\n" for t in docs))
    r = run_cli(
        "train-tokenizer", "--input", tmp_path / "b.jsonl", "--jsonl-field", "story", "--vocab-size", 330,
        "--out", tmp_path / "tok", "--no-progress", "--threads", 1,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.load(tmp_path / "tok")
    assert tok.merges == quiet(paths["plain"])[1]
    # The compression line measures the documents' text, not the JSON around it.
    sample = "".join(docs).encode()
    bpt = len(sample) / len(tok.encode("".join(docs)))
    assert f"compression   {bpt:.2f} bytes/token on the first {len(sample):,} bytes" in r.stdout


def test_encode_reads_bom_and_lone_surrogates_as_text(tmp_path, docs_files):
    docs, paths = docs_files
    tok = Tokenizer.train(iter(docs), 330, [EOT], progress=False)
    ref = shards.encode(tok, paths["plain"], tmp_path / "ref", progress=False)
    for name in ("bom.txt", "bom.jsonl"):
        side = shards.encode(tok, paths[name], tmp_path / name, progress=False)
        assert (tmp_path / f"{name}.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes(), name
        assert side["num_documents"] == ref["num_documents"]
    # What Python's json writes for a str with a lone surrogate; encode(str) gives U+FFFD.
    texts = ["a\ud800b", "\udc00x\ud83d\ude00", "\\ud800 kept"]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    shards.encode(tok, tmp_path / "s.jsonl", tmp_path / "s", progress=False)
    want = sum((tok.encode(t) + [tok.eos_id] for t in texts), [])
    assert np.fromfile(tmp_path / "s.bin", dtype="<u2").tolist() == want
    assert tok.decode(tok.encode(texts[0])) == "a\ufffdb"
    # Training reads them the same way as an iterable of the same str.
    assert quiet(tmp_path / "s.jsonl", 270) == quiet(iter(texts), 270)


def test_encode_summary_measures_the_text_not_the_file(tmp_path, docs_files):
    docs, paths = docs_files
    tok = Tokenizer.train(iter(docs), 330, [EOT], progress=False)
    tok.save(tmp_path / "tok")
    lines = {}
    for name in ("plain", "txt.gz", "jsonl.zst"):
        r = run_cli("encode", "--tokenizer", tmp_path / "tok", "--input", paths[name], "--out", tmp_path / name,
                    "--no-progress")  # fmt: skip
        assert r.returncode == 0, r.stderr
        lines[name] = re.search(r"([\d.]+) MB of text in .* ([\d.]+) bytes/token", r.stdout).groups()
    text_bytes = len("".join(docs).encode()) + len(docs) * len(EOT)  # the plain file's text
    tokens = len(np.fromfile(tmp_path / "plain.bin", dtype="<u2"))
    assert lines["plain"] == (f"{text_bytes / 1e6:.1f}", f"{text_bytes / tokens:.2f}")
    assert lines["txt.gz"] == lines["plain"]
    # JSON Lines: the documents' own text (no separators between them).
    jsonl_bytes = len("".join(docs).encode())
    assert lines["jsonl.zst"][1] == f"{jsonl_bytes / tokens:.2f}"


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_pipes_and_devices_are_refused_by_name(tmp_path, docs_files, fifo):
    docs, paths = docs_files
    tok = Tokenizer.train(iter(docs), 300, [EOT], progress=False)
    tok.save(tmp_path / "tok")
    for src, kind in ((fifo, "a pipe or FIFO"), ("/dev/zero", "a character device")):
        r = run_cli("encode", "--tokenizer", tmp_path / "tok", "--input", src, "--out", tmp_path / "o", "--no-progress")
        assert_clear_error(r, f"input {src} is not a regular file ({kind})", "save the stream to a file first")
        assert not list(tmp_path.glob("o.*"))
        r = run_cli("train-tokenizer", "--input", src, "--vocab-size", 300, "--out", tmp_path / "t", "--no-progress")
        assert_clear_error(r, f"input {src} is not a regular file ({kind})")
        assert not (tmp_path / "t").exists()
        with pytest.raises(ValueError, match="not a regular file"):
            quiet([paths["plain"], src])


def test_stdin_through_the_cli_is_refused_not_read_as_empty(tmp_path, docs_files):
    docs, paths = docs_files
    Tokenizer.train(iter(docs), 300, [EOT], progress=False).save(tmp_path / "tok")
    with open(paths["plain"], "rb") as f:
        cat = subprocess.Popen(["cat"], stdin=f, stdout=subprocess.PIPE)
        r = subprocess.run(
            [sys.executable, "-m", "ferrolm", "encode", "--tokenizer", str(tmp_path / "tok"), "--input", "/dev/stdin",
             "--out", str(tmp_path / "o"), "--no-progress"],
            stdin=cat.stdout, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        cat.stdout.close()
        cat.wait()
    assert_clear_error(r, "input /dev/stdin is not a regular file (a pipe or FIFO)")
    assert "wrote" not in r.stdout


def test_parquet_with_bad_utf8_names_the_file_in_training(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": pa.array([b"fine", b"bad \xff here"], pa.binary())}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet: document 1 is not valid UTF-8 \(at byte 4 of it"):
        quiet(tmp_path / "b.parquet", 270)
    # Replaced, it trains as the same text with U+FFFD.
    assert quiet(tmp_path / "b.parquet", 270, errors="replace") == quiet(iter(["fine", "bad \ufffd here"]), 270)


def test_compressed_text_with_bad_utf8_names_the_decompressed_offset(tmp_path):
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(b"good text \xff"))
    with pytest.raises(ValueError, match=r"b\.txt\.gz \(decompressed\): invalid UTF-8 at byte offset 10"):
        quiet(tmp_path / "b.txt.gz", 270)


def test_a_parquet_column_inside_a_struct_by_its_dotted_path(tmp_path, docs_files):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs, paths = docs_files
    meta = [{"id": i, "text": t} for i, t in enumerate(docs)] + [None, {"id": -1, "text": None}]
    pq.write_table(pa.table({"meta": meta}), tmp_path / "s.parquet", row_group_size=50)
    tok = Tokenizer.train(iter(docs), 300, [EOT], progress=False)
    shards.encode(tok, paths["plain"], tmp_path / "ref", progress=False)
    side = shards.encode(tok, tmp_path / "s.parquet", tmp_path / "s", column="meta.text", progress=False)
    assert (tmp_path / "s.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert side["num_documents"] == len(docs)  # a null struct or text is no document
    assert quiet(tmp_path / "s.parquet", column="meta.text") == quiet(paths["plain"])
    with pytest.raises(ValueError, match=r"'meta' .* is nested .* dotted paths: meta\.id, meta\.text"):
        shards.encode(tok, tmp_path / "s.parquet", tmp_path / "e", column="meta", progress=False)
    with pytest.raises(ValueError, match=r"no column 'meta\.body'"):
        quiet(tmp_path / "s.parquet", column="meta.body")

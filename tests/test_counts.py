"""Tokenizer training in two phases: pre-token counts per part, then merges from all the
counts files, equal to one run over the whole input (and to the reference trainer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from texts import multilingual_text, stdlib_text

from ferrolm import reference
from ferrolm.bpe import counts, trainer

EOT = "<|endoftext|>"
SPECIALS = [EOT, "<|pad|>"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two text files (documents split by special tokens) and a file with none."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.txt").write_text(stdlib_text(120_000).replace("\n\n", "\n<|pad|>\n", 3), encoding="utf-8")
    (d / "b.txt").write_text(multilingual_text(60_000), encoding="utf-8")
    (d / "c.txt").write_text("no special token in this one at all, just words words words\n" * 50, encoding="utf-8")
    return [str(d / n) for n in ("a.txt", "b.txt", "c.txt")]


@pytest.fixture(scope="module")
def whole_run(corpus):
    return trainer.train_bpe(corpus, 1200, SPECIALS)


def _count_parts(corpus, tmp_path, n, threads):
    files = []
    for i in range(n):
        out = tmp_path / f"p{i}.counts"
        counts.count(corpus, out, SPECIALS, part=(i, n), num_threads=threads, progress=False)
        files.append(out)
    return files


@pytest.mark.parametrize("n,threads", [(1, 1), (3, 2), (8, 1), (8, 2)])
def test_merges_from_counts_equal_one_run(corpus, whole_run, tmp_path, n, threads):
    files = _count_parts(corpus, tmp_path, n, threads)
    vocab, merges = counts.train_from_counts(files, 1200, num_threads=threads, progress=False)
    assert merges == whole_run[1]
    assert vocab == whole_run[0]


def test_parts_tile_the_inputs(corpus):
    sizes = {p: os.path.getsize(p) for p in corpus}
    for n in (1, 2, 5, 8, 40):
        seen = {p: [] for p in corpus}
        for i in range(n):
            for p, a, b in counts.part_ranges(corpus, (i, n), SPECIALS):
                seen[p].append((a, b))
        for p, ranges in seen.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == sizes[p]
            assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
            text = open(p, "rb").read()
            for a, _ in ranges[1:]:  # every cut is just after a special token
                assert any(text[:a].endswith(s.encode()) for s in SPECIALS), (p, a)


def test_counts_match_the_reference_trainer(tmp_path):
    text = stdlib_text(20_000) + "\n" + EOT + "\n" + multilingual_text(8_000)
    path = tmp_path / "small.txt"
    path.write_text(text, encoding="utf-8")
    files = _count_parts([str(path)], tmp_path, 3, 2)
    vocab, merges = counts.train_from_counts(files, 500, progress=False)
    ref_vocab, ref_merges = reference.train_bpe(str(path), 500, SPECIALS)
    assert merges == ref_merges and vocab == ref_vocab


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "ferrolm", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_cli_two_phases_save_the_tokenizer_of_one_run(corpus, tmp_path):
    specials = [a for s in SPECIALS for a in ("--special-token", s)]
    for i in range(3):
        r = _cli(
            "train-tokenizer",
            "--input",
            *corpus,
            "--part",
            f"{i}/3",
            "--counts-out",
            tmp_path / f"{i}.counts",
            *specials,
            "--no-progress",
        )
        assert r.returncode == 0, r.stderr
        assert f"of part {i}/3" in r.stdout
    r = _cli(
        "train-tokenizer",
        "--counts",
        *(tmp_path / f"{i}.counts" for i in range(3)),
        "--vocab-size",
        1200,
        "--out",
        tmp_path / "two",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    r = _cli(
        "train-tokenizer",
        "--input",
        *corpus,
        "--vocab-size",
        1200,
        "--out",
        tmp_path / "one",
        *specials,
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    for name in ("merges.txt", "vocab.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
    from ferrolm import Tokenizer

    assert Tokenizer.load(tmp_path / "two").fingerprint == Tokenizer.load(tmp_path / "one").fingerprint


def test_bad_counts_are_refused_clearly(corpus, tmp_path):
    files = _count_parts(corpus, tmp_path, 2, 1)
    # A missing part, the same part twice.
    with pytest.raises(ValueError, match="part 1/2 .* is missing"):
        counts.train_from_counts(files[:1], 500, progress=False)
    with pytest.raises(ValueError, match="given twice"):
        counts.train_from_counts([files[0], files[0], files[1]], 500, progress=False)
    # Counts of another pattern do not add up to one run.
    with pytest.raises(ValueError, match="counted with pattern"):
        counts.train_from_counts(files, 500, pattern="cl100k", progress=False)
    # A flipped byte: the checksum refuses the file, from the CLI with exit status 2.
    data = bytearray(files[1].read_bytes())
    data[len(data) // 2] ^= 0x20
    files[1].write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        counts.train_from_counts(files, 500, progress=False)
    r = _cli("train-tokenizer", "--counts", *files, "--vocab-size", 500, "--out", tmp_path / "t", "--no-progress")
    assert r.returncode == 2 and "checksum mismatch" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "t").exists()
    # Not a counts file at all; a header from the future.
    (tmp_path / "x.counts").write_text("hello")
    with pytest.raises(ValueError, match="not a ferrolm pre-token counts file"):
        counts.train_from_counts([tmp_path / "x.counts"], 500, progress=False)
    r = _cli("train-tokenizer", "--input", *corpus, "--part", "0/2", "--vocab-size", 500, "--out", tmp_path / "t")
    assert r.returncode == 2 and "--part goes with --counts-out" in r.stderr


def test_header_records_pattern_specials_and_unicode_version(corpus, tmp_path):
    from ferrolm.bpe import patterns

    h = counts.count(corpus[:1], tmp_path / "h.counts", SPECIALS, progress=False)
    on_disk = counts.read_header(tmp_path / "h.counts")
    assert on_disk["pattern"] == patterns.resolve("gpt2")
    assert on_disk["special_tokens"] == SPECIALS
    assert on_disk["unicode_version"] == patterns.unicode_version()
    assert h["unique_pretokens"] > 100 and json.dumps(on_disk)
    # The file depends on the counts only: the same for any thread count.
    counts.count(corpus[:1], tmp_path / "h2.counts", SPECIALS, num_threads=2, progress=False)
    assert (tmp_path / "h.counts").read_bytes() == (tmp_path / "h2.counts").read_bytes()


def test_files_that_are_not_plain_text_go_whole_to_one_part(corpus, tmp_path):
    import gzip

    docs = stdlib_text(40_000).split("\n" + EOT + "\n")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    gz = tmp_path / "more.txt.gz"
    gz.write_bytes(gzip.compress(multilingual_text(20_000).encode("utf-8")))
    inputs = [str(jsonl), corpus[0], str(gz)]
    for n in (2, 5):
        for i in range(n):
            for p, a, b in counts.part_ranges(inputs, (i, n), SPECIALS):
                assert p == corpus[0] or (a, b) == (0, os.path.getsize(p))
    files = _count_parts(inputs, tmp_path, 5, 2)
    assert counts.train_from_counts(files, 900, progress=False) == trainer.train_bpe(inputs, 900, SPECIALS)


def _edit_keeping_size_and_mtime(path, at: int) -> None:
    """Change the byte at ``at`` to another letter, then restore the modification time."""
    st = os.stat(path)
    data = bytearray(open(path, "rb").read())
    data[at] = ord("Q") if data[at] != ord("Q") else ord("R")
    with open(path, "r+b") as f:
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_identity_sees_a_same_size_edit_inside_a_sampled_window(tmp_path):
    from ferrolm.bpe import inputs

    path = tmp_path / "big.txt"
    path.write_bytes(stdlib_text(3_000_000).encode("utf-8"))
    offsets = inputs.sample_offsets(path.stat().st_size)
    assert len(offsets) == inputs.SAMPLE_SPREAD + 2 and offsets[0] == 0
    assert offsets[-1] + inputs.SAMPLE_WINDOW == path.stat().st_size
    for at in (offsets[0], offsets[7] + 100, offsets[-1] + inputs.SAMPLE_WINDOW - 1):
        before = inputs.identity(path)
        _edit_keeping_size_and_mtime(path, at)
        after = inputs.identity(path)
        assert after[1:3] == before[1:3] and after[3] != before[3], at
        assert inputs.identity_change(before, after) == "sampled bytes"
    # A small file is hashed whole: any byte counts.
    small = tmp_path / "small.txt"
    small.write_text(stdlib_text(50_000), encoding="utf-8")
    before = inputs.identity(small)
    _edit_keeping_size_and_mtime(small, 33_333)
    assert inputs.identity(small)[3] != before[3]


def _small_corpus(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text(stdlib_text(30_000), encoding="utf-8")
    return [str(path)]


def test_counts_of_two_versions_of_an_input_are_refused_by_name(tmp_path):
    corpus = _small_corpus(tmp_path)
    first = tmp_path / "p0.counts"
    counts.count(corpus, first, SPECIALS, part=(0, 2), progress=False)
    _edit_keeping_size_and_mtime(corpus[0], 20_000)
    second = tmp_path / "p1.counts"
    counts.count(corpus, second, SPECIALS, part=(1, 2), progress=False)
    with pytest.raises(ValueError, match="different versions") as e:
        counts.train_from_counts([first, second], 500, progress=False)
    assert str(first) in str(e.value) and str(second) in str(e.value) and corpus[0] in str(e.value)
    r = _cli(
        "train-tokenizer", "--counts", first, second, "--vocab-size", 500, "--out", tmp_path / "t", "--no-progress"
    )
    assert r.returncode == 2 and "different versions" in r.stderr and str(first) in r.stderr, r.stderr
    assert not (tmp_path / "t").exists()
    # Counted again from one version, the parts add up.
    counts.count(corpus, first, SPECIALS, part=(0, 2), progress=False)
    assert counts.train_from_counts([first, second], 500, progress=False) == trainer.train_bpe(corpus, 500, SPECIALS)


def _with_header(path, header: dict) -> None:
    """Rewrite a counts file's header (and its checksum), as another writer would have made it."""
    import hashlib

    data = path.read_bytes()
    n = int.from_bytes(data[20:24], "little")
    h = json.dumps(header, sort_keys=True).encode("utf-8")
    out = data[:20] + len(h).to_bytes(4, "little") + h + data[24 + n : -32]
    path.write_bytes(out + hashlib.sha256(out).digest())


def test_counts_files_without_identities_merge_when_their_sizes_agree(tmp_path):
    corpus = _small_corpus(tmp_path)
    files = _count_parts(corpus, tmp_path, 2, 1)
    old = counts.read_header(files[0])
    old["inputs"] = [rec[:2] for rec in old["inputs"]]  # what earlier versions recorded: path and size
    _with_header(files[0], old)
    assert counts.train_from_counts(files, 500, progress=False) == trainer.train_bpe(corpus, 500, SPECIALS)
    old["inputs"] = [[rec[0], rec[1] + 1] for rec in old["inputs"]]
    _with_header(files[0], old)
    with pytest.raises(ValueError, match=r"different versions .*\(size"):
        counts.train_from_counts(files, 500, progress=False)


@pytest.mark.parametrize("length", ["longer", "shorter", "zero", "huge", "past_the_end"])
def test_a_damaged_header_length_names_the_file(tmp_path, length):
    corpus = _small_corpus(tmp_path)
    files = _count_parts(corpus, tmp_path, 2, 1)
    data = bytearray(files[1].read_bytes())
    n = int.from_bytes(data[20:24], "little")
    bad = {"longer": n + 9, "shorter": n - 5, "zero": 0, "huge": 2**32 - 1, "past_the_end": len(data)}[length]
    data[20:24] = bad.to_bytes(4, "little")
    files[1].write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged") as e:
        counts.train_from_counts(files, 500, progress=False)
    assert str(files[1]) in str(e.value)
    r = _cli("train-tokenizer", "--counts", *files, "--vocab-size", 500, "--out", tmp_path / "t", "--no-progress")
    assert r.returncode == 2 and str(files[1]) in r.stderr and "damaged" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "codec" not in r.stderr


def test_a_file_that_changes_while_it_is_counted_writes_no_counts(tmp_path, monkeypatch):
    corpus = _small_corpus(tmp_path)
    real = trainer._count_files

    def count_then_append(*args, **kwargs):
        real(*args, **kwargs)
        with open(corpus[0], "a", encoding="utf-8") as f:
            f.write("more text written while it was read\n")

    monkeypatch.setattr(trainer, "_count_files", count_then_append)
    with pytest.raises(ValueError, match="changed while it was counted"):
        counts.count(corpus, tmp_path / "c.counts", SPECIALS, progress=False)
    assert not (tmp_path / "c.counts").exists()


def test_counts_out_never_replaces_a_file_it_did_not_write_unless_forced(corpus, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("notes of my own\n", encoding="utf-8")
    args = ["train-tokenizer", "--input", corpus[2], "--counts-out", precious, "--no-progress"]
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert f"--counts-out {precious} exists and is not a pre-token counts file" in r.stderr
    assert "--force" in r.stderr and "Traceback" not in r.stderr
    assert precious.read_text(encoding="utf-8") == "notes of my own\n"
    r = _cli(*args, "--force")
    assert r.returncode == 0, r.stderr
    assert counts.read_header(precious)["format"] == counts.FORMAT
    r = _cli(*args)  # a counts file of ferrolm's is replaced without --force
    assert r.returncode == 0, r.stderr


def test_counts_out_never_replaces_an_input_even_forced(corpus, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("some words <|endoftext|> more words\n", encoding="utf-8")
    before = src.read_bytes()
    with pytest.raises(ValueError, match="--counts-out .* which this command reads"):
        counts.count([src], src, force=True, progress=False)
    with pytest.raises(FileExistsError, match="--counts-out"):
        counts.count_texts(["a document"], src)
    assert src.read_bytes() == before

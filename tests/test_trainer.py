"""The Rust BPE trainer (ferrolm.bpe.trainer): exact against the pure-Python reference,
deterministic, streaming, and clear about bad input."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from texts import SEPARATOR, corpus_text, fixture_file, write_corpus

import ferrolm
from ferrolm.bpe import reference
from ferrolm.bpe import trainer as bpe_trainer
from ferrolm.bpe.files import read_merges
from ferrolm.bpe.trainer import train, train_bpe

EOT = "<|endoftext|>"


def quiet(input, vocab_size, special_tokens=(EOT,), **kw):
    kw.setdefault("progress", False)
    return train(input, vocab_size, special_tokens, **kw)


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


# ---------------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------------


def test_reference_merges_fixture():
    merges_ref = read_merges(fixture_file("train-bpe-reference-merges.txt"))
    vocab, merges = quiet(fixture_file("corpus.en"), 500)
    assert merges == merges_ref
    assert len(vocab) == 500 and vocab[499] == EOT.encode()


def test_train_bpe_is_exposed_lazily():
    vocab, merges = ferrolm.train_bpe(fixture_file("corpus.en"), 300, [EOT])
    assert (vocab, merges) == train_bpe(fixture_file("corpus.en"), 300, [EOT])
    assert len(merges) == 43 and len(vocab) == 300


def test_vocab_layout_bytes_merges_specials():
    vocab, merges = quiet(fixture_file("tinystories_sample.txt"), 300, [EOT, "<pad>"])
    assert [vocab[i] for i in range(256)] == [bytes([i]) for i in range(256)]
    assert [vocab[256 + k] for k in range(len(merges))] == [a + b for a, b in merges]
    assert vocab[298] == EOT.encode() and vocab[299] == b"<pad>"
    assert sorted(vocab) == list(range(300))


@pytest.mark.parametrize(
    "corpus, size, vocab_size",
    [
        ("stories", 1_600_000, 10_000),
        ("stdlib", 3 << 20, 10_000),
        ("multilingual", 1 << 20, 5_000),
    ],
)
def test_equals_reference_on_corpora(tmp_path, corpus, size, vocab_size):
    path = write_corpus(tmp_path / "corpus.txt", corpus, size)
    want = reference.train_bpe(path, vocab_size, [EOT])
    got = quiet(path, vocab_size)
    assert got[1] == want[1]
    assert got[0] == want[0]


@pytest.mark.parametrize("pattern", ["cl100k", "o200k", r"\w+|\s+|[^\w\s]+", r"\p{L}+| ?\p{N}|\s+(?!\S)|\s+|."])
def test_equals_reference_with_other_patterns(tmp_path, pattern):
    path = write(tmp_path / "c.txt", corpus_text("stdlib", 200_000) + SEPARATOR + corpus_text("multilingual", 200_000))
    want = reference.train_bpe(path, 1_000, [EOT], pattern=pattern)
    assert quiet(path, 1_000, pattern=pattern) == want


FRAGMENTS = [
    "a", "b", "ab", "ba", "the", " the", " ", "  ", "\n", "\n\n", "\t", " \n", "x\nY", "'s", "'ll", "don't",
    "12", "345", " 6", "!", "?!", "...", "é", "ü", "ß", "日本", "語", "中文", "Ж", "ñ", "😀", "\u00a0", "\u3000",
    "<", "|", ">", "<|", "|>", "<s", "<|eot|>", "<s>", "ab<s>", "<s><s>", "endoftext",
]  # fmt: skip
SPECIALS = ["<|eot|>", "<s>", "<s><s>", "ab", "|", "\n\n", "日本"]


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=80),
    specials=st.lists(st.sampled_from(SPECIALS), max_size=3, unique=True),
    extra_merges=st.integers(0, 60),
    threads=st.sampled_from([1, 2, 3]),
)
def test_random_corpora_equal_reference(tmp_path, parts, specials, extra_merges, threads):
    text = "".join(parts)
    vocab_size = 256 + len(specials) + extra_merges
    try:
        want = reference.train_bpe(iter([text]), vocab_size, specials)
    except ValueError:
        return
    if not reference.count_pretokens(iter([text]), specials):
        with pytest.raises(ValueError, match="empty"):
            quiet(iter([text]), vocab_size, specials, num_threads=threads)
        return
    assert quiet(iter([text]), vocab_size, specials, num_threads=threads) == want
    path = write(tmp_path / "h.txt", text)
    assert quiet(path, vocab_size, specials, num_threads=threads) == want


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    parts=st.lists(
        st.sampled_from(FRAGMENTS + ["\n"] * 10 + [" word", " Word", "Word", "d\nW"] * 5), min_size=1, max_size=400
    ),
    specials=st.lists(st.sampled_from(["<s>", "<|eot|>", "\nW", "d\nWord", "<s><s>"]), max_size=3, unique=True),
    chunk=st.sampled_from([64, 100, 333, 1000]),
)
def test_small_chunks_change_nothing(tmp_path, monkeypatch, parts, specials, chunk):
    """Files read in tiny chunks (cut at special tokens, at exact text cuts, or holding
    back the last pre-tokens) give the same merges."""
    text = "".join(parts)
    path = write(tmp_path / "c.txt", text)
    vocab_size = 300 + len(specials)
    try:
        want = quiet(path, vocab_size, specials)
    except ValueError:
        return
    assert want == reference.train_bpe(path, vocab_size, specials)
    monkeypatch.setattr(bpe_trainer, "_CHUNK_SIZE", chunk)
    assert quiet(path, vocab_size, specials) == want


def test_small_chunks_on_real_text(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "c.txt", "stdlib", 1 << 20)
    want = quiet(path, 2_000)
    monkeypatch.setattr(bpe_trainer, "_CHUNK_SIZE", 4096)
    assert quiet(path, 2_000) == want
    # Without special tokens the cuts are text cuts (after "x\nY") or hold-back cuts.
    want_nospecial = reference.train_bpe(path, 1_000, [])
    assert quiet(path, 1_000, []) == want_nospecial
    assert quiet(path, 1_000, [], pattern=r"\S+|\s+") == reference.train_bpe(path, 1_000, [], pattern=r"\S+|\s+")


def test_ties_break_to_greatest_pair(tmp_path):
    # Every pair occurs twice; ("c","d") > ("b","a") > ("a","b") as byte strings.
    want = reference.train_bpe(iter(["ab ab cd cd ba ba"]), 256 + 10, [])
    assert quiet(iter(["ab ab cd cd ba ba"]), 256 + 10, []) == want
    vocab, merges = quiet(iter(["ab", "\n", "cd", "\n", "ba"]), 256 + 1 + 3, ["\n"])
    assert merges == [(b"c", b"d"), (b"b", b"a"), (b"a", b"b")]


# ---------------------------------------------------------------------------------------
# Determinism and input forms
# ---------------------------------------------------------------------------------------


def test_same_merges_at_any_thread_count(tmp_path):
    path = write_corpus(tmp_path / "c.txt", "stdlib", 1_600_000)
    results = [quiet(path, 3_000, num_threads=n) for n in (1, 2, 4)]
    assert results[0] == results[1] == results[2]


def test_one_file_equals_same_text_split_over_files(tmp_path):
    text = corpus_text("stories", 1 << 20)
    docs = text.split(EOT)
    whole = write(tmp_path / "whole.txt", text)
    # Split after special tokens: each file is its own text, and the special token was a
    # hard boundary anyway.
    parts = []
    step = max(1, len(docs) // 5)
    for i in range(0, len(docs), step):
        chunk = EOT.join(docs[i : i + step]) + (EOT if i + step < len(docs) else "")
        parts.append(write(tmp_path / f"part{i}.txt", chunk))
    assert len(parts) >= 5
    want = quiet(whole, 2_000)
    assert quiet(parts, 2_000) == want
    assert quiet(tuple(str(p) for p in parts), 2_000) == want
    # Each item of an iterable is a document: the same documents separated by EOT in a file.
    assert quiet(iter(docs), 2_000) == want
    assert quiet(iter(docs), 2_000) == reference.train_bpe(iter(docs), 2_000, [EOT])


def test_items_of_an_iterable_are_documents_apart(tmp_path):
    docs = ["x\n", "\ny"] * 50
    vocab, merges = quiet(iter(docs), 256 + 4, [])
    assert (b"\n", b"\n") not in merges  # "\n\n" would be a pre-token only across two items
    assert (vocab, merges) == reference.train_bpe(iter(docs), 256 + 4, [])
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet", row_group_size=7)
    assert quiet(tmp_path / "d.parquet", 256 + 4, []) == (vocab, merges)
    assert quiet(str(tmp_path / "*.parquet"), 256 + 4, []) == (vocab, merges)


def test_each_file_is_its_own_text(tmp_path):
    a = write(tmp_path / "a.txt", "hello wor")
    b = write(tmp_path / "b.txt", "ld hello world")
    assert quiet([a, b], 300, []) == reference.train_bpe([a, b], 300, [])
    # The same two texts as items of an iterable: two documents, the same merges.
    assert quiet([a, b], 300, []) == quiet(iter(["hello wor", "ld hello world"]), 300, [])
    assert quiet([a, b], 300, []) != quiet(iter(["hello world hello world"]), 300, [])


def test_stops_when_no_pair_is_left():
    vocab, merges = quiet(iter(["abc abc"]), 1_000, [EOT])
    assert len(merges) == len(vocab) - 257 < 10
    assert vocab[len(vocab) - 1] == EOT.encode()


def test_lone_surrogates_become_replacement_chars():
    text = "ab\ud800cd \udc00x \ud83d\ude00\ud83d\ude00"
    assert quiet(iter([text]), 300, []) == reference.train_bpe(iter([text]), 300, [])
    # Items are documents: a surrogate pair split between two is two lone surrogates.
    split = ["ab \ud83d", "\ude00\ud83d\ude00"]
    assert quiet(iter(split), 300, []) == reference.train_bpe(iter(split), 300, [])
    assert quiet(iter(split), 300, []) == quiet(iter(["ab \ufffd", "\ufffd\ud83d\ude00"]), 300, [])


def test_stats_report_stages():
    stats: dict = {}
    quiet(fixture_file("corpus.en"), 400, stats=stats)
    for key in ("read_s", "count_s", "merge_tables_s", "build_s", "merge_s"):
        assert stats[key] >= 0
    assert stats["bytes"] == fixture_file("corpus.en").stat().st_size
    assert stats["merges"] == 400 - 257 and stats["unique_pretokens"] > 1000


def test_progress_bars(capsys):
    quiet(fixture_file("corpus.en"), 400, progress=True)
    err = capsys.readouterr().err
    assert "counting" in err and "merging" in err and "143/143" in err
    quiet(fixture_file("corpus.en"), 400, progress=False)
    assert capsys.readouterr().err == ""


def test_ctrl_c_stops_training_quickly(tmp_path):
    # 5 GB (one file 200 times over, read from the page cache): counting alone lasts seconds
    # even at the 1 GB/s a fast core counts this text; 150 MB could end before the interrupt.
    paths = [write_corpus(tmp_path / "c.txt", "stdlib", 25_000_000)] * 200
    fired = []

    def interrupt():
        fired.append(time.perf_counter())
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Ctrl-C's usual handler, also when the tests run in the background with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    # A KeyboardInterrupt raised inside a gc callback (hypothesis installs one) is reported as
    # unraisable and dropped: no callbacks while the signal may land.
    callbacks, gc.callbacks[:] = gc.callbacks[:], []
    timer = threading.Timer(0.3, interrupt)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            quiet(paths, 32_000, num_threads=1)
        stopped = time.perf_counter()
    finally:
        timer.cancel()
        gc.callbacks[:] = callbacks
        signal.signal(signal.SIGINT, previous)
    assert fired, "training finished before the interrupt was sent"
    assert stopped - fired[0] < 1.0


# ---------------------------------------------------------------------------------------
# Invalid UTF-8 and bad input
# ---------------------------------------------------------------------------------------


def test_invalid_utf8_names_file_and_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello world " * 1000 + b"\xff\xfe oops" + b" more" * 10)
    with pytest.raises(ValueError, match=r"bad\.txt.*byte offset 12000"):
        quiet(path, 300)


def test_invalid_utf8_offset_in_a_later_chunk(tmp_path, monkeypatch):
    path = tmp_path / "bad.txt"
    good = ("line of text\n" + EOT) * 2000
    path.write_bytes(good.encode() + b"ok \xe2\x82 x" + good.encode() + b"\xc3")
    monkeypatch.setattr(bpe_trainer, "_CHUNK_SIZE", 1000)
    with pytest.raises(ValueError, match=f"byte offset {len(good) + 3}"):
        quiet(path, 300)


def test_errors_replace(tmp_path):
    raw = b"caf\xc3\xa9 \xff\xfe caf\xe2\x82 cafe\xed\xa0\x80 " * 50
    path = tmp_path / "bad.txt"
    path.write_bytes(raw)
    got = quiet(path, 320, errors="replace")
    want = reference.train_bpe(iter([raw.decode("utf-8", errors="replace")]), 320, [EOT])
    assert got == want
    assert any("\ufffd".encode() in t for t in got[0].values())


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(vocab_size=256), ValueError, "at least 257"),
        (dict(vocab_size=100, special_tokens=[]), ValueError, "at least 256"),
        (dict(vocab_size=300, special_tokens=["a", "a"]), ValueError, "twice"),
        (dict(vocab_size=300, special_tokens=[""]), ValueError, "empty"),
        (dict(vocab_size=300, special_tokens=EOT), TypeError, "list"),
        (dict(vocab_size=300, pattern="(unclosed"), ValueError, "pattern"),
        (dict(vocab_size=300, num_threads=0), ValueError, "num_threads"),
        (dict(vocab_size=300, errors="ignore"), ValueError, "errors"),
        (dict(vocab_size="300"), TypeError, "vocab_size"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    kwargs.setdefault("special_tokens", [EOT])
    with pytest.raises(exc, match=match):
        train(fixture_file("corpus.en"), progress=False, **kwargs)


@pytest.mark.parametrize("vocab_size", [2**64, 10**12, 2**63 - 1, 2**32])
def test_vocab_size_beyond_32_bit_ids_is_refused_up_front(tmp_path, vocab_size):
    # Refused before the corpus is read (the file does not even exist).
    with pytest.raises(ValueError, match="too large.*at most 4294967295"):
        quiet(tmp_path / "not-read.txt", vocab_size)


def test_vocab_size_above_what_the_corpus_allows_trains_it_whole(tmp_path):
    # The largest vocab_size allowed, in a subprocess: a capacity sized by the request
    # (34 GB) aborts the interpreter rather than raising.
    path = tmp_path / "small.txt"
    path.write_text("low lower lowest newer wider<|endoftext|>" * 20)
    code = (
        "import sys; from ferrolm.bpe.trainer import train_bpe; "
        "vocab, merges = train_bpe(sys.argv[1], 2**32 - 1); print(len(merges))"
    )
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    vocab, merges = quiet(path, 10_000)
    assert int(r.stdout) == len(merges) < 10_000 - 257
    # Every pre-token ended whole: nothing is left to merge.
    assert {b"low", b" lower", b" lowest", b" newer", b" wider"} <= set(vocab.values())


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        quiet(tmp_path / "nope.txt", 300)
    # A folder is its files; an empty one is an error.
    with pytest.raises(FileNotFoundError, match="holds no files"):
        quiet(tmp_path, 300)
    with pytest.raises(FileNotFoundError, match="iter"):
        quiet(["the first document", "the second"], 300)
    with pytest.raises(ValueError, match="empty"):
        quiet([], 300)
    empty = write(tmp_path / "empty.txt", "")
    with pytest.raises(ValueError, match="empty"):
        quiet(empty, 300)
    only_specials = write(tmp_path / "specials.txt", EOT * 3)
    with pytest.raises(ValueError, match="empty"):
        quiet(only_specials, 300)
    with pytest.raises(ValueError, match="empty"):
        quiet(iter([]), 300)
    with pytest.raises(TypeError, match="str"):
        quiet(iter(["ok", b"bytes"]), 300)
    with pytest.raises(TypeError):
        quiet(b"bytes", 300)
    with pytest.raises(TypeError):
        quiet(42, 300)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path):
    path = write(tmp_path / "secret.txt", "text")
    path.chmod(0)
    with pytest.raises(PermissionError, match="secret.txt"):
        quiet(path, 300)

"""The Rust-backed ferrolm.Tokenizer: exact ids (tiktoken, the reference, a naive oracle),
streaming, conversions, worst cases and bad inputs."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from texts import CORPORA, corpus_text, fixture_file, stdlib_text, stories_text, write_corpus

from ferrolm import Tokenizer, _core
from ferrolm.bpe import patterns
from ferrolm.bpe.files import TokenizerFileError, read_merges, read_vocab

EOT = "<|endoftext|>"
FIXTURE_TEXTS = ["address.txt", "german.txt", "tinystories_sample.txt", "corpus.en"]
#: Chars of each test corpus (tests/texts.py) compared whole with tiktoken.
CORPUS_CHARS = 2_000_000


# --------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gpt2(gpt2_vocab_merges):
    vocab, merges = gpt2_vocab_merges
    return Tokenizer(vocab, merges, [EOT])


@pytest.fixture(scope="session")
def trained():
    """The CS336 reference trainer's tokenizer (vocab 500 on corpus.en, <|endoftext|> at id 0)."""
    vocab = read_vocab(fixture_file("train-bpe-reference-vocab.json"), [EOT])
    merges = read_merges(fixture_file("train-bpe-reference-merges.txt"))
    return Tokenizer(vocab, merges, [EOT])


@pytest.fixture(scope="session")
def corpus_paths(tmp_path_factory):
    """Each test corpus written to a file, by name."""
    d = tmp_path_factory.mktemp("corpora")
    return {name: write_corpus(d / f"{name}.txt", name, CORPUS_CHARS) for name in CORPORA}


@pytest.fixture(scope="session")
def reference_module():
    return pytest.importorskip(
        "ferrolm.bpe.reference", reason="ferrolm.bpe.reference (the pure-Python tokenizer) is not in this build"
    )


_TIKTOKEN_IDS: dict = {}


def tiktoken_ids(enc, path: Path) -> list[int]:
    """tiktoken's ids of a whole file, line ends as they are (cached: several tests compare
    against them)."""
    if path not in _TIKTOKEN_IDS:
        _TIKTOKEN_IDS[path] = enc.encode(path.read_bytes().decode("utf-8"), allowed_special="all")
    return _TIKTOKEN_IDS[path]


def naive_encode(tok: Tokenizer, text: str, specials: bool = True) -> list[int]:
    """A deliberately simple oracle: split on specials (longest first), pre-tokenize with
    Python's `regex`, merge the lowest-ranked pair (leftmost first) until none is left."""
    import regex

    vocab = tok.vocab
    id_of: dict[bytes, int] = {}
    for i in sorted(vocab):
        id_of.setdefault(vocab[i], i)
    rank = {}
    for k, m in enumerate(tok.merges):
        rank.setdefault(m, k)
    pat = regex.compile(tok.pattern)
    text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    out: list[int] = []
    spans = [text]
    if specials and tok.special_tokens:
        sp = regex.compile("|".join(regex.escape(s) for s in sorted(tok.special_tokens, key=len, reverse=True)))
        spans, pos = [], 0
        for m in sp.finditer(text):
            spans += [text[pos : m.start()], (m.group(),)]
            pos = m.end()
        spans.append(text[pos:])
    for span in spans:
        if isinstance(span, tuple):
            out.append(tok.special_token_ids[span[0]])
            continue
        for piece in pat.findall(span):
            parts = [bytes([b]) for b in piece.encode("utf-8")]
            while len(parts) > 1:
                best = min(range(len(parts) - 1), key=lambda i: (rank.get((parts[i], parts[i + 1]), 1 << 60), i))
                if (parts[best], parts[best + 1]) not in rank:
                    break
                parts[best : best + 2] = [parts[best] + parts[best + 1]]
            out.extend(id_of[p] for p in parts)
    return out


def chunked(text: str, size: int):
    return (text[i : i + size] for i in range(0, len(text), size))


def ragged(text: str, seed: int, top: int = 40):
    rng = random.Random(seed)
    i = 0
    while i < len(text):
        n = rng.randint(1, top)
        yield text[i : i + n]
        i += n


# --------------------------------------------------------------------------------------
# GPT-2: ids equal tiktoken's
# --------------------------------------------------------------------------------------


def test_design_examples(gpt2):
    assert gpt2.encode("a\n\n b") == [64, 628, 275]
    assert list(gpt2.encode_iterable(["a\n", "\n", " b"])) == [64, 628, 275]
    assert gpt2.encode("Hello, world!") == [15496, 11, 995, 0]
    assert gpt2.encode(EOT) == [50256]
    assert gpt2.eos_id == 50256
    assert gpt2.vocab_size == 50257


@pytest.mark.parametrize("name", FIXTURE_TEXTS)
def test_fixture_texts_equal_tiktoken(gpt2, tiktoken_gpt2, name):
    path = fixture_file(name)
    text = path.read_text(encoding="utf-8")
    want = tiktoken_ids(tiktoken_gpt2, path)
    assert gpt2.encode(text) == want
    for size in (1, 7):
        assert list(gpt2.encode_iterable(chunked(text, size))) == want
    assert list(gpt2.encode_iterable(text.splitlines(keepends=True))) == want
    assert gpt2.decode(want) == text


@pytest.mark.slow
@pytest.mark.parametrize("name", CORPORA)
def test_corpora_equal_tiktoken(gpt2, tiktoken_gpt2, corpus_paths, name):
    """Every test corpus, whole and streamed (lines, 1 MB chunks, 7 chars on a slice,
    ragged chunks, 1 char on a small slice)."""
    path = corpus_paths[name]
    text = path.read_bytes().decode("utf-8")
    want = tiktoken_ids(tiktoken_gpt2, path)
    got = gpt2.encode(text)
    assert len(got) == len(want)
    assert got == want
    assert gpt2.decode(got) == text
    with open(path, encoding="utf-8", newline="") as f:
        assert list(gpt2.encode_iterable(f)) == want
    assert list(gpt2.encode_iterable(chunked(text, 1 << 20))) == want
    # Chunkings that cut everywhere, on slices (tiktoken's ids of the slice itself).
    part = text[:300_000]
    want_part = tiktoken_gpt2.encode(part, allowed_special="all")
    assert list(gpt2.encode_iterable(chunked(part, 7))) == want_part
    assert list(gpt2.encode_iterable(ragged(part, seed=len(text)))) == want_part
    small = text[:20_000]
    assert list(gpt2.encode_iterable(iter(small))) == tiktoken_gpt2.encode(small, allowed_special="all")


def test_parallel_whole_text_equals_serial(gpt2, tiktoken_gpt2, corpus_paths):
    path = corpus_paths["stdlib"]
    want = tiktoken_ids(tiktoken_gpt2, path)
    text = path.read_bytes().decode("utf-8")
    for threads in (1, 2, 3):
        arr = gpt2.encode_to_numpy(text, num_threads=threads)
        assert arr.dtype == np.uint16
        assert arr.tolist() == want
    assert gpt2.encode_file(path, dtype=np.uint32, num_threads=2).tolist() == want
    # With specials as plain text the cut points must still be safe.
    assert gpt2.encode_to_numpy(text.replace(EOT, " "), num_threads=2).tolist() == tiktoken_gpt2.encode_ordinary(
        text.replace(EOT, " ")
    )


def test_encode_file_keeps_line_ends_and_replaces_bad_bytes(tmp_path):
    # Over 4 MiB, so that the file is mapped (valid UTF-8) or read (invalid) and checked in
    # parallel: CRLF line ends, multi-byte characters, special tokens, and in the invalid
    # file bad bytes in the middle and at the end.
    unit = "Hello, wörld!\r\nSecond line 漢字 😀 a b<|endoftext|>c\r\n  spaced   out\n".encode()
    valid = bytearray(unit * (5_000_000 // len(unit)))
    invalid = bytearray(valid)
    invalid[len(invalid) // 2] = 0xFF
    invalid += b"tail \xe6"
    tok = Tokenizer.train(iter([unit.decode() * 50]), 400, [EOT], progress=False)
    for name, data in (("valid", valid), ("invalid", invalid)):
        path = tmp_path / f"crlf_{name}.txt"
        path.write_bytes(bytes(data))
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            text = f.read()
        assert "\r\n" in text and ("\ufffd" in text) == (name == "invalid")
        want = tok.encode_to_numpy(text, num_threads=1).tolist()
        for threads in (1, 2, 3):
            assert tok.encode_file(path, num_threads=threads).tolist() == want, (name, threads)


def test_encode_batch(gpt2, tiktoken_gpt2):
    docs = stories_text(400_000).split(EOT)[:400]
    want = [tiktoken_gpt2.encode(d) for d in docs]
    assert gpt2.encode_batch(docs) == want
    assert gpt2.encode_batch(docs, num_threads=1) == want
    assert gpt2.encode_batch(tuple(docs), num_threads=2) == want
    assert gpt2.encode_batch(iter(docs[:5])) == want[:5]
    assert gpt2.encode_batch([]) == []
    ids, offsets = gpt2.encode_batch_to_numpy(docs, num_threads=2)
    assert ids.dtype == np.uint16 and offsets.dtype == np.int64 and len(offsets) == len(docs) + 1
    assert [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(docs))] == want
    ids, offsets = gpt2.encode_batch_to_numpy(docs[:50] + [""], dtype=np.uint32, num_threads=1)
    assert ids.dtype == np.uint32 and ids.tolist() == [t for w in want[:50] for t in w]
    assert offsets.tolist()[-2:] == [len(ids), len(ids)]
    ids, offsets = gpt2.encode_batch_to_numpy([], dtype=np.uint32)
    assert ids.size == 0 and offsets.tolist() == [0]


def test_encode_ordinary_treats_specials_as_text(gpt2, tiktoken_gpt2):
    s = f"one{EOT}two <|endoftext|>"
    assert gpt2.encode_ordinary(s) == tiktoken_gpt2.encode_ordinary(s)
    assert 50256 not in gpt2.encode_ordinary(s)
    assert gpt2.encode(s).count(50256) == 2


def test_surrogates_as_tiktoken(gpt2, tiktoken_gpt2):
    for s in [
        "\ud83d\ude00 ok",
        "lone \ud800 high",
        "lone \udfff low",
        "\ud83d",
        "a\udc00\ud800b",
        "x\ud83d\ude00\ud83d",
    ]:
        want = tiktoken_gpt2.encode(s)
        assert gpt2.encode(s) == want, repr(s)
        assert gpt2.encode_ordinary(s) == tiktoken_gpt2.encode_ordinary(s)
        assert gpt2.encode_batch([s, "plain"]) == [want, tiktoken_gpt2.encode("plain")]
        assert gpt2.encode_to_numpy(s).tolist() == want
        # A surrogate pair split across chunks still joins.
        assert list(gpt2.encode_iterable(iter(s))) == want, repr(s)


def test_encode_iterable_large_chunks_with_surrogates(gpt2, tiktoken_gpt2):
    # encode_iterable feeds the core large chunks in parts; a surrogate pair at a cut stays
    # joined and the ids equal those of the whole text.
    from ferrolm.bpe.tokenizer import _FEED_MAX

    for k in (_FEED_MAX - 2, _FEED_MAX - 1, _FEED_MAX, _FEED_MAX + 1):
        s = "word " * (k // 5) + "x" * (k % 5) + "\ud83d\ude00 tail \ud800 " + "é" * (2 * _FEED_MAX + 3) + " end"
        want = tiktoken_gpt2.encode(s)
        assert list(gpt2.encode_iterable([s])) == want, k
        assert list(gpt2.encode_iterable([s[:7], s[7:]])) == want, k


def test_decode(gpt2):
    ids = gpt2.encode("héllo wörld ✓ 日本語")
    assert gpt2.decode(ids) == "héllo wörld ✓ 日本語"
    assert gpt2.decode(np.array(ids, dtype=np.int64)) == "héllo wörld ✓ 日本語"
    assert gpt2.decode(np.array(ids, dtype=np.uint16)) == "héllo wörld ✓ 日本語"
    assert gpt2.decode_bytes(iter(ids)) == "héllo wörld ✓ 日本語".encode()
    # Token 447 is the first two bytes of a three-byte character: invalid alone.
    partial = gpt2.decode_bytes([447])
    assert gpt2.decode([447]) == partial.decode("utf-8", errors="replace")
    assert "\ufffd" in gpt2.decode([447])
    assert gpt2.decode([]) == ""
    assert gpt2.decode([50256]) == EOT


# --------------------------------------------------------------------------------------
# Trained tokenizers: ids equal the oracle's and the reference's
# --------------------------------------------------------------------------------------


def test_trained_fixture_equals_naive_oracle(trained):
    text = fixture_file("corpus.en").read_text(encoding="utf-8")[:40_000]
    assert trained.encode(text) == naive_encode(trained, text)
    assert trained.eos_id == 0
    for name in CORPORA:
        part = corpus_text(name, 3_000)
        assert trained.encode(part) == naive_encode(trained, part), name
        assert trained.decode(trained.encode(part)) == part


def test_trained_fixture_equals_reference(trained, reference_module):
    ref = reference_module.Tokenizer(trained.vocab, trained.merges, trained.special_tokens)
    texts = {"corpus.en": fixture_file("corpus.en").read_text(encoding="utf-8")}
    texts.update({name: corpus_text(name, 200_000) for name in CORPORA})
    for name, text in texts.items():
        assert trained.encode(text) == ref.encode(text), name


def test_ferrolm_trained_equals_reference(reference_module, tmp_path):
    """A tokenizer trained by ferrolm (the Rust trainer when present, else the reference
    trainer) encodes every corpus like the reference Tokenizer."""
    src = write_corpus(tmp_path / "sample.txt", "stories", 200_000)
    try:
        tok = Tokenizer.train(str(src), 600, [EOT], progress=False)
    except ImportError:
        vocab, merges = reference_module.train_bpe(str(src), 600, [EOT])
        tok = Tokenizer(vocab, merges, [EOT])
    ref = reference_module.Tokenizer(tok.vocab, tok.merges, tok.special_tokens)
    for name in CORPORA:
        text = corpus_text(name, 100_000)
        assert tok.encode(text) == ref.encode(text), name


ALPHABET = st.one_of(
    st.sampled_from(
        list(" \n\t\r'sdmtlvreAa0123456789.,!?-_\u00a0\u3000\x1c\x85") + ["ll", "ve", "re", "  ", "\n\n", "'s", "’"]
    ),
    st.characters(),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),  # lone surrogates
    st.sampled_from(["é", "日本", "😀", "\U0001f600"[0], "ß", "ǅ", "Ⅻ", "٣"]),
)
SPECIAL_BITS = st.sampled_from(
    [EOT, EOT + EOT, "<|endoftext", "|>", "<|", "endoftext", "<|endoftext|", "<<|endoftext|>>"]
)
TEXTS = st.lists(st.one_of(ALPHABET, SPECIAL_BITS), max_size=40).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS)
def test_hypothesis_gpt2_equals_tiktoken(gpt2, tiktoken_gpt2, text):
    want = tiktoken_gpt2.encode(text, allowed_special="all")
    assert gpt2.encode(text) == want
    assert gpt2.encode_ordinary(text) == tiktoken_gpt2.encode_ordinary(text)
    assert list(gpt2.encode_iterable(iter(text))) == want
    clean = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    assert gpt2.decode(want) == clean


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS)
def test_hypothesis_gpt2_equals_reference(gpt2, reference_module, text):
    ref = _reference_gpt2(reference_module, gpt2)
    assert gpt2.encode(text) == ref.encode(text)


@pytest.fixture(scope="session", params=["gpt2", "cl100k", "o200k"])
def gpt2_any_pattern(request, gpt2_vocab_merges):
    vocab, merges = gpt2_vocab_merges
    return Tokenizer(vocab, merges, [EOT], pattern=request.param)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(ALPHABET, SPECIAL_BITS), max_size=80).map("".join), st.data())
def test_hypothesis_ragged_chunks_equal_whole_text(gpt2_any_pattern, text, data):
    # Any cut points (empty chunks, a chunk per character, cuts inside a special token,
    # between the halves of a surrogate pair): the ids of the whole text.
    tok = gpt2_any_pattern
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12), label="cuts"))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert list(tok.encode_iterable(iter(chunks))) == tok.encode(text)


_REF_CACHE: dict = {}


def _reference_gpt2(module, tok):
    key = id(tok)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = module.Tokenizer(tok.vocab, tok.merges, tok.special_tokens)
    return _REF_CACHE[key]


@pytest.fixture(scope="session")
def overlapping(trained):
    """Overlapping special tokens, one containing another, one that is also a vocab token."""
    return Tokenizer(trained.vocab, trained.merges, [EOT, EOT + EOT, "<|e", "t|>", "the"])


def test_overlapping_specials_longest_first(overlapping):
    ids = overlapping.special_token_ids
    assert overlapping.encode(EOT + EOT) == [ids[EOT + EOT]]
    assert overlapping.encode(EOT * 3) == [ids[EOT + EOT], ids[EOT]]
    assert overlapping.encode("<|ex") == [ids["<|e"], overlapping.encode_ordinary("x")[0]]
    assert overlapping.encode("the") == [ids["the"]]
    # "the" is also an ordinary token; as text it is that token, not the special's new id.
    assert overlapping.encode_ordinary("the") == naive_encode(overlapping, "the", specials=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(ALPHABET, SPECIAL_BITS, st.sampled_from(["the", "<|e", "t|>", "then"])), max_size=30).map(
        "".join
    )
)
def test_hypothesis_overlapping_specials(overlapping, text):
    assert overlapping.encode(text) == naive_encode(overlapping, text)
    assert overlapping.encode_ordinary(text) == naive_encode(overlapping, text, specials=False)
    assert list(overlapping.encode_iterable(iter(text))) == naive_encode(overlapping, text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(ALPHABET, SPECIAL_BITS, st.sampled_from(["the", "<|e", "t|>"])), max_size=30).map("".join))
def test_hypothesis_overlapping_specials_reference(overlapping, reference_module, text):
    ref = _reference_gpt2(reference_module, overlapping)
    assert overlapping.encode(text) == ref.encode(text)


def test_other_patterns_equal_oracle(trained):
    text = fixture_file("tinystories_sample.txt").read_text(encoding="utf-8")
    text += " I'LL they're 12345 foo\r\n\r\n  bar!!\n"
    for pattern in ("cl100k", "o200k", r"\S+|\s+"):
        tok = Tokenizer(trained.vocab, trained.merges, [EOT], pattern=pattern)
        assert tok.pattern == patterns.resolve(pattern)
        want = naive_encode(tok, text)
        assert tok.encode(text) == want, pattern
        assert list(tok.encode_iterable(ragged(text, seed=3, top=5))) == want, pattern


# --------------------------------------------------------------------------------------
# Conversions and files
# --------------------------------------------------------------------------------------


def test_save_load_roundtrip(gpt2, trained, tmp_path):
    for tok in (gpt2, trained):
        d = tok.save(tmp_path / f"tok{tok.vocab_size}")
        back = Tokenizer.load(d)
        assert back.vocab == tok.vocab and back.merges == tok.merges
        assert back.special_tokens == tok.special_tokens and back.pattern == tok.pattern
        assert back.fingerprint == tok.fingerprint
        assert back.encode("Hello <|endoftext|> world") == tok.encode("Hello <|endoftext|> world")
    fp = Tokenizer.from_files(fixture_file("gpt2_vocab.json"), fixture_file("gpt2_merges.txt"), [EOT])
    assert fp.fingerprint == gpt2.fingerprint
    assert pickle.loads(pickle.dumps(gpt2)).encode("pickled text") == gpt2.encode("pickled text")


def test_tiktoken_roundtrip(gpt2, tiktoken_gpt2, trained, tmp_path):
    text = fixture_file("corpus.en").read_text(encoding="utf-8")[:50_000] + EOT + "tail"
    from_tt = Tokenizer.from_tiktoken(tiktoken_gpt2)
    assert from_tt.vocab == gpt2.vocab
    assert from_tt.merges == gpt2.merges  # GPT-2's merges are recovered exactly
    assert from_tt.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all")
    to_tt = trained.to_tiktoken()
    assert to_tt.encode(text, allowed_special="all") == trained.encode(text)
    rank_file = trained.save_tiktoken(tmp_path / "trained.tiktoken")
    back = Tokenizer.from_tiktoken_file(rank_file, special_tokens={EOT: 0})
    assert back.encode(text) == trained.encode(text)
    first = rank_file.read_text().splitlines()[0].split()
    assert len(first) == 2 and int(first[1]) == 1  # id 0 is the special token
    gpt2.save_tiktoken(tmp_path / "gpt2.tiktoken")
    back = Tokenizer.from_tiktoken_file(tmp_path / "gpt2.tiktoken", special_tokens=[EOT])
    assert back.eos_id == 50256 and back.encode(text) == gpt2.encode(text)


def test_hf_tokenizer_json(gpt2, trained, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    text = fixture_file("tinystories_sample.txt").read_text(encoding="utf-8")
    text += fixture_file("german.txt").read_text(encoding="utf-8") + " ✓ 日本語 😀\n\n  x"
    for tok in (gpt2, trained):
        path = tok.save_hf(tmp_path / f"hf{tok.vocab_size}.json")
        hf = tokenizers.Tokenizer.from_file(str(path))
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text)
        assert hf.decode(tok.encode(text), skip_special_tokens=False) == text
    (tmp_path / "dir").mkdir()
    assert gpt2.save_hf(tmp_path / "dir").name == "tokenizer.json"


def test_truncate(trained):
    small = trained.truncate(300)
    assert small.vocab_size == 300 and len(small.merges) == 300 - 256 - 1
    assert small.merges == trained.merges[:43]
    assert small.special_tokens == [EOT]
    text = fixture_file("corpus.en").read_text(encoding="utf-8")[:5_000]
    assert small.encode(text) == naive_encode(small, text)
    # A trained-layout tokenizer keeps its ids: bytes 0-255, merges, then specials.
    trained_layout = Tokenizer(
        {i: bytes([i]) for i in range(256)} | {256 + k: a + b for k, (a, b) in enumerate(trained.merges)},
        trained.merges,
        [EOT],
    )
    cut = trained_layout.truncate(400)
    assert cut.special_token_ids[EOT] == 399
    assert all(cut.vocab[i] == trained_layout.vocab[i] for i in range(399))
    with pytest.raises(ValueError):
        trained.truncate(100)
    with pytest.raises(ValueError):
        trained.truncate(10_000)


def test_vocab_and_merges_are_built_once_and_read_only_to_the_tokenizer(tmp_path):
    merges = [(b"a", b"b"), (b"ab", b"c"), (b" ", b"abc")]
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"abc", 258: b" abc"}
    tok = Tokenizer(vocab, merges, [EOT])
    # Kept after the first access: a lookup loop does not rebuild 50k entries each time.
    assert tok.vocab is tok.vocab and tok.merges is tok.merges
    assert tok.vocab == vocab | {259: EOT.encode()} and tok.merges == merges
    ids = tok.encode("abc abc" + EOT)
    # Changing the handed-out copies changes nothing the tokenizer does or saves.
    tok.vocab[256] = b"zz"
    tok.merges.clear()
    assert tok.encode("abc abc" + EOT) == ids == [257, 258, 259]
    tok.save(tmp_path / "t")
    again = Tokenizer.load(tmp_path / "t")
    assert again.vocab == vocab | {259: EOT.encode()} and again.merges == merges


def test_train_uses_rust_trainer(tmp_path):
    pytest.importorskip("ferrolm.bpe.trainer", reason="the Rust trainer (ferrolm.bpe.trainer) is not in this build")
    src = fixture_file("corpus.en")
    tok = Tokenizer.train(str(src), 400, [EOT], progress=False)
    assert tok.vocab_size == 400 and tok.eos_id == 399
    text = src.read_text(encoding="utf-8")[:10_000]
    assert tok.encode(text) == naive_encode(tok, text)


# --------------------------------------------------------------------------------------
# Streaming memory, worst cases
# --------------------------------------------------------------------------------------


def test_stream_buffer_stays_small(gpt2):
    """Feeding a long text line by line, the Rust stream buffers only the unfinished tail."""
    from ferrolm import _core

    assert isinstance(gpt2._core, _core.Encoder)
    stream = gpt2._core.stream(True)
    text = stdlib_text(3_000_000)
    n, most = 0, 0
    for line in text.splitlines(keepends=True):
        n += len(stream.feed(line))
        most = max(most, stream.buffered)
    n += len(stream.finish())
    assert n == len(gpt2.encode(text))
    assert most < 200_000


@pytest.mark.parametrize("unit", ["a", "!", " ", "\n", "7", "日", "😀", "ab", " a"])
def test_worst_cases_run(gpt2, unit):
    text = unit * (1_000_000 // len(unit.encode()))
    ids = gpt2.encode(text)
    assert gpt2.decode(ids) == text
    if unit in ("a", "!", " "):
        assert list(gpt2.encode_iterable(chunked(text, 4096))) == ids
        assert gpt2.encode_to_numpy(text, num_threads=2).tolist() == ids


def test_worst_case_matches_tiktoken_small(gpt2, tiktoken_gpt2):
    for unit in ["a", "!", " ", "\n", "ab"]:
        text = unit * 3000
        assert gpt2.encode(text) == tiktoken_gpt2.encode(text)


# --------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------


def _bytes_vocab():
    return {i: bytes([i]) for i in range(256)}


def test_bad_constructor_inputs():
    v = _bytes_vocab()
    with pytest.raises(ValueError, match="not in the vocab"):
        Tokenizer(v, [(b"a", b"b")])
    with pytest.raises(ValueError, match="not in the vocab"):
        Tokenizer({**v, 256: b"xyz"}, [(b"xy", b"z")])
    with pytest.raises(ValueError, match="listed twice"):
        Tokenizer(v, [], ["<s>", "<s>"])
    with pytest.raises(ValueError, match="empty"):
        Tokenizer(v, [], [""])
    with pytest.raises(TypeError):
        Tokenizer(v, [], "<s>")
    with pytest.raises(ValueError, match="2\\^32"):
        Tokenizer({**v, 2**32: b"ab"}, [])
    with pytest.raises(ValueError):
        Tokenizer({**v, -1: b"ab"}, [])
    with pytest.raises(ValueError, match="byte 0x41"):
        Tokenizer({i: bytes([i]) for i in range(256) if i != 0x41}, [])
    with pytest.raises(TypeError, match="bytes"):
        Tokenizer({**v, 256: "ab"}, [])
    with pytest.raises(TypeError):
        Tokenizer({**v, "x": b"ab"}, [])
    with pytest.raises(TypeError):
        Tokenizer(list(v.values()), [])
    with pytest.raises(TypeError, match="merges\\[0\\]"):
        Tokenizer({**v, 256: b"ab"}, [("a", "b")])
    with pytest.raises(ValueError, match="pattern"):
        Tokenizer(v, [], pattern="(unclosed")


def test_bad_encode_decode_inputs(gpt2):
    for bad in (b"bytes", 3, None, ["a"]):
        with pytest.raises(TypeError):
            gpt2.encode(bad)
    with pytest.raises(TypeError):
        gpt2.encode_batch("not a list")
    with pytest.raises(TypeError):
        gpt2.encode_batch(["ok", b"bytes"])
    with pytest.raises(TypeError):
        gpt2.encode_iterable("a str")
    with pytest.raises(TypeError):
        list(gpt2.encode_iterable([b"bytes"]))
    for bad in ([50257], [-1], [2**40], [2**70], np.array([50257]), np.array([-3])):
        with pytest.raises(ValueError):
            gpt2.decode(bad)
    with pytest.raises(TypeError):
        gpt2.decode(["a"])
    with pytest.raises(TypeError):
        gpt2.decode(np.array([1.5]))
    with pytest.raises(ValueError):
        gpt2.encode_to_numpy("x", dtype=np.int8)
    with pytest.raises(ValueError):
        gpt2.encode_batch(["x"], num_threads=0)


def test_an_absurd_thread_count_is_a_value_error(tmp_path):
    # Not a panic inside a parallel call, and not thousands of threads started first.
    from ferrolm.bpe import shards

    v = _bytes_vocab()
    v[256] = b"<|endoftext|>"
    tok = Tokenizer(v, [], ["<|endoftext|>"])
    big = "hello world<|endoftext|>" * 20_000
    path = tmp_path / "t.txt"
    path.write_text(big, encoding="utf-8")
    calls = {
        "encode_batch": lambda: tok.encode_batch(["a b"], num_threads=10**6),
        "encode_batch_to_numpy": lambda: tok.encode_batch_to_numpy(["a"], num_threads=5000),
        "encode_to_numpy": lambda: tok.encode_to_numpy(big, num_threads=10**6),
        "encode_file": lambda: tok.encode_file(path, num_threads=10**6),
        "train": lambda: Tokenizer.train(
            iter(["a b c"] * 10), 260, special_tokens=[], num_threads=10**6, progress=False
        ),
        "shards.encode": lambda: shards.encode(tok, [path], tmp_path / "out", threads=10**6, progress=False),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="over the limit"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"], "a refused encode left files behind"
    assert tok.encode_batch(["ab"], num_threads=2) == [[97, 98]]


def test_an_absurd_rayon_num_threads_is_named_in_the_error():
    import os
    import subprocess
    import sys

    code = (
        "from ferrolm.bpe.tokenizer import Tokenizer\n"
        "tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], [])\n"
        "try:\n"
        "    tok.encode_batch(['a b'])\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, RAYON_NUM_THREADS="5000")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RAYON_NUM_THREADS=5000" in out.stdout, out.stdout + out.stderr


def test_uint16_refused_for_big_vocab():
    v = _bytes_vocab()
    v[70_000] = b"<big>"
    tok = Tokenizer(v, [], ["<big>"])
    assert tok.vocab_size == 70_001
    assert tok.encode_to_numpy("x<big>").dtype == np.uint32
    assert tok.encode_to_numpy("x<big>").tolist() == [ord("x"), 70_000]
    with pytest.raises(ValueError, match="uint16"):
        tok.encode_to_numpy("x", dtype=np.uint16)


def test_bad_files(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "vocab.json").write_text("{not json")
    (d / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(TokenizerFileError):
        Tokenizer.load(d)
    (d / "vocab.json").write_text(json.dumps({"a": 0}))
    (d / "tokenizer.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(TokenizerFileError):
        Tokenizer.load(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerFileError, match="incomplete"):
        Tokenizer.load(d)
    with pytest.raises(ValueError, match="byte"):
        Tokenizer.from_files(d / "vocab.json", d / "merges.txt")
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "missing")
    (tmp_path / "bad.tiktoken").write_text("!!!notbase64 x\n")
    with pytest.raises(TokenizerFileError):
        Tokenizer.from_tiktoken_file(tmp_path / "bad.tiktoken")


def _read_both(reader, path, *args):
    """reader(path, *args) with fast=False and fast=True: (result or exception, same)."""
    out = []
    for fast in (False, True):
        try:
            out.append(reader(path, *args, fast=fast))
        except Exception as e:  # noqa: BLE001 - the exception itself is compared
            out.append((type(e), str(e)))
    return out


def test_fast_file_readers_equal_the_python_readers(gpt2, trained, tmp_path):
    """The core's vocab.json / merges.txt readers (fast=True, what Tokenizer.load uses) give
    what tokenizer_files' Python readers give, and hand every file they do not accept to
    them, so the errors are the same; the core's fingerprint is tokenizer_files'."""
    from ferrolm.bpe import files as tf

    odd = Tokenizer({**_bytes_vocab(), 300: b"a b", 301: b'\\"\n'}, [], ["<|sp a|>", "a b"], pattern=r"\w+|\s+|.")
    for tok in (gpt2, trained, odd):
        d = tok.save(tmp_path / f"tok{tok.vocab_size}")
        slow, fast = _read_both(tf.read_vocab, d / "vocab.json", tok.special_tokens)
        assert fast == slow and slow == tok.vocab
        slow, fast = _read_both(tf.read_merges, d / "merges.txt")
        assert fast == slow and slow == tok.merges
        # The core read these itself (no fallback).
        assert _core.read_vocab_json((d / "vocab.json").read_text(encoding="utf-8"), tok.special_tokens) == tok.vocab
        assert _core.read_merges_txt((d / "merges.txt").read_text(encoding="utf-8")) == tok.merges
        assert tok.fingerprint == tf.fingerprint(tok.vocab, tok.merges, tok.special_tokens, tok.pattern)
    cases = [
        ("{not json", "#version: 0.2\n"),
        ("[1, 2]", "a b c\n"),
        ('{"a": 0, "b": 0}', "a  b\n"),
        ('{"a": -1}', "ab\n"),
        ('{"a": 1.0}', "x\n#version: 0.2\n"),
        ('{"a": true}', "a \u0144\n"),
        ('{"": 0}', "a b\r\r\n\n"),
        ('{"a c": 0}', "\ta b\n"),
        ('{"a": 0, "a": 1}', "#version: 0.2\r\nĠ t\n"),
        ('{"\u0144": 0}', ""),
        ('{"a": 4294967296, "b": 1}', "a\u00a0 b\n"),
        ('{"b": 0}', "#version: 0.2\na b\nĠ t\na b\n"),  # a repeated merge
    ]
    for i, (vocab_text, merges_text) in enumerate(cases):
        (tmp_path / f"v{i}.json").write_text(vocab_text, encoding="utf-8")
        (tmp_path / f"m{i}.txt").write_text(merges_text, encoding="utf-8", newline="")
        slow, fast = _read_both(tf.read_vocab, tmp_path / f"v{i}.json", ["<|sp|>"])
        assert fast == slow, vocab_text
        slow, fast = _read_both(tf.read_merges, tmp_path / f"m{i}.txt")
        assert fast == slow, merges_text
    (tmp_path / "latin1.txt").write_bytes(b"a \xff\n")
    assert _read_both(tf.read_merges, tmp_path / "latin1.txt")[0][0] is TokenizerFileError
    slow, fast = _read_both(tf.read_merges, tmp_path / "latin1.txt")
    assert fast == slow


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.binary(max_size=12), max_size=30))
def test_byte_to_unicode_writers(tokens):
    """token_to_str / tokens_to_strs (charmap codec, one call for many tokens) give GPT-2's
    byte-to-unicode form, character by character, and str_to_token reads it back."""
    from ferrolm.bpe import fileformat as ff

    table = ff.bytes_to_unicode()
    want = ["".join(table[b] for b in t) for t in tokens]
    assert [ff.token_to_str(t) for t in tokens] == want
    assert ff.tokens_to_strs(tokens) == want
    assert ff.tokens_to_strs(iter(tokens)) == want
    assert [ff.str_to_token(s) for s in want if s] == [t for t in tokens if t]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.lists(st.binary(min_size=2, max_size=6), min_size=1, max_size=40, unique=True),
    seed=st.integers(0, 2**32 - 1),
)
def test_fast_file_readers_on_random_vocabs(tokens, seed, tmp_path_factory):
    """Random byte tokens (every byte value, control bytes and UTF-8 fragments included)
    saved and read back: the core's readers and the Python readers agree."""
    from ferrolm.bpe import files as tf

    rng = random.Random(seed)
    vocab = {**_bytes_vocab(), **{256 + i: t for i, t in enumerate(tokens)}}
    merges = [(t[:1], t[1:]) for t in tokens if rng.random() < 0.5]
    d = tmp_path_factory.mktemp("rand")
    tf.save_dir(d, vocab, merges, ["<|x|>"], "gpt2")
    slow_vocab, fast = _read_both(tf.read_vocab, d / "vocab.json", ["<|x|>"])
    assert fast == slow_vocab
    slow, fast = _read_both(tf.read_merges, d / "merges.txt")
    assert fast == slow == merges
    assert _core.read_merges_txt((d / "merges.txt").read_text(encoding="utf-8")) == merges
    assert _core.read_vocab_json((d / "vocab.json").read_text(encoding="utf-8"), ["<|x|>"]) == slow_vocab


def test_encode_file_of_a_device_or_directory_is_not_no_such_file(tmp_path):
    tok = Tokenizer.train(iter(["ab ab ab"]), 260, [], progress=False)
    with pytest.raises(ValueError, match="/dev/null is not a regular file"):
        tok.encode_file("/dev/null")
    with pytest.raises(ValueError, match="is not a regular file"):
        tok.encode_file(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        tok.encode_file(tmp_path / "missing.txt")


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("gpt3", r"unknown pattern name 'gpt3' \(did you mean 'gpt2'\?\)"),
        ("", "empty"),
        (r"\p{Foo}+", "unknown property"),
    ],
)
def test_bad_patterns_are_named_for_training_and_tokenizers(pattern, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer.train(iter(["ab ab ab"]), 260, [], pattern=pattern, progress=False)
    with pytest.raises(ValueError, match=message):
        Tokenizer({i: bytes([i]) for i in range(256)}, [], pattern=pattern)

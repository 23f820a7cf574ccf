"""The pure-Python reference tokenizer (ferrolm.bpe.reference) against real data and real peers.

Peers: the CS336 reference trainer's output on corpus.en, tiktoken's GPT-2 encoding (built
offline from the fixture files), HF tokenizers loading our saved files, and a naive
recount-everything trainer written here from docs/DESIGN.md's rules.
"""

from __future__ import annotations

import itertools
import random
import tracemalloc
from collections import Counter

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from texts import CORPORA, corpus_text, fixture_file, stories_text

from ferrolm.bpe import patterns, reference
from ferrolm.bpe.files import TokenizerFileError, read_merges, read_vocab
from ferrolm.bpe.reference import Tokenizer, train_bpe

EOT = "<|endoftext|>"
SAMPLE_CHARS = 200_000

# Text fragments that stress pre-tokenization: mixed whitespace, contractions, digits,
# punctuation, non-ASCII letters and marks, special tokens (whole and cut), surrogates.
FRAGMENTS = [
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    "\u00a0",
    "\u3000",
    "\u2028",
    "\x85",
    "\x0b",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'LL",
    "'",
    "’",
    "0",
    "7",
    "12",
    "2024",
    "3.14",
    "1,000",
    "a",
    "b",
    "the",
    "The",
    " the",
    "Hello",
    "é",
    "ß",
    "ñ",
    "e\u0301",
    "中文",
    "日本語",
    "Привет",
    "👍",
    "🇫🇷",
    ".",
    ",",
    "!",
    "?",
    "...",
    "--",
    "(",
    ")",
    "<",
    "|",
    ">",
    "<|",
    "|>",
    "#",
    "$",
    "@",
    "_",
    "\\",
    EOT,
    "<|endoftext",
    "endoftext|>",
]
SURROGATE_FRAGMENTS = ["\ud800", "\udfff", "\ud83d", "\ude00", "\ud83d\ude00"]


def without_lone_surrogates(text: str) -> str:
    """What the text means to the tokenizer (and to tiktoken): lone surrogates become U+FFFD."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# st.characters() includes lone surrogates.
mixed_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.characters()), max_size=40).map("".join)


# --------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2(gpt2_vocab_merges):
    vocab, merges = gpt2_vocab_merges
    return Tokenizer(vocab, merges, [EOT])


@pytest.fixture(scope="module")
def corpus_samples():
    return {name: corpus_text(name, SAMPLE_CHARS) for name in CORPORA}


@pytest.fixture(scope="module")
def fixture_texts():
    names = ["address.txt", "german.txt", "tinystories_sample.txt", "corpus.en"]
    return {name: fixture_file(name).read_text(encoding="utf-8") for name in names}


@pytest.fixture(scope="module")
def stories_tokenizer():
    vocab, merges = train_bpe(iter(stories_text(1_600_000).split(EOT)), 2000, [EOT])
    return Tokenizer(vocab, merges, [EOT])


def ragged(text: str, rng: random.Random, max_len: int) -> list[str]:
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, max_len)
        chunks.append(text[i : i + n])
        i += n
    return chunks


# --------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------


def test_train_reproduces_cs336_reference_merges_and_vocab():
    vocab, merges = train_bpe(fixture_file("corpus.en"), 500, [EOT])
    expected_merges = read_merges(fixture_file("train-bpe-reference-merges.txt"))
    expected_vocab = read_vocab(fixture_file("train-bpe-reference-vocab.json"), [EOT])
    assert merges == expected_merges
    assert len(vocab) == 500
    assert set(vocab.values()) == set(expected_vocab.values())


def test_trained_vocab_layout_bytes_then_merges_then_specials():
    specials = [EOT, "<|pad|>"]
    vocab, merges = train_bpe(fixture_file("corpus.en"), 400, specials)
    assert sorted(vocab) == list(range(400))
    assert [vocab[i] for i in range(256)] == [bytes([i]) for i in range(256)]
    assert [vocab[256 + k] for k in range(len(merges))] == [a + b for a, b in merges]
    assert [vocab[398], vocab[399]] == [s.encode() for s in specials]
    assert len(merges) == 400 - 256 - 2


def naive_train(text: str, num_merges: int, special_tokens: list[str], pattern: str = patterns.GPT2):
    """docs/DESIGN.md's rules spelled out with a full recount per merge, on byte strings."""
    if special_tokens:
        docs = regex.split("|".join(regex.escape(s) for s in sorted(special_tokens, key=len, reverse=True)), text)
    else:
        docs = [text]
    words = Counter()
    for doc in docs:
        for piece in regex.findall(pattern, doc):
            words[tuple(bytes([b]) for b in piece.encode("utf-8"))] += 1
    merges = []
    for _ in range(num_merges):
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


# Small alphabets give many ties, repeated symbols (a a a), prefixes (b"a" vs b"ab") and
# multi-byte characters whose bytes share prefixes.
small_text = st.lists(
    st.sampled_from(["a", "b", "c", "ab", " a", " b", "aa", "é", "è", "中", "\n", " ", "1", "'s", "<|x|>"]), max_size=60
).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=small_text, num_merges=st.integers(0, 40))
def test_train_matches_naive_trainer(text, num_merges):
    vocab_size = 256 + 1 + num_merges
    vocab, merges = train_bpe(iter([text]), vocab_size, ["<|x|>"])
    assert merges == naive_train(text, num_merges, ["<|x|>"])
    assert len(vocab) == 256 + len(merges) + 1


def test_train_matches_naive_trainer_on_real_text():
    text = fixture_file("tinystories_sample.txt").read_text(encoding="utf-8")
    _, merges = train_bpe(iter([text]), 256 + 1 + 150, [EOT])
    assert merges == naive_train(text, 150, [EOT])


def test_ties_take_the_lexicographically_greatest_pair():
    # Every pair occurs once ("ab", " cde"): the greatest, (b"d", b"e"), is merged first.
    _, merges = train_bpe(iter(["ab cde"]), 256 + 3, [])
    assert merges[0] == (b"d", b"e")
    # (a,b) and (b,c) tie at 2: (b,c) wins. Then (a,bc) and (a,b) tie at 1: b"bc" > b"b",
    # a byte string beats its own proper prefix.
    _, merges = train_bpe(iter(["abc bc ab"]), 256 + 3, [], pattern=r"\S+")
    assert merges == [(b"b", b"c"), (b"a", b"bc"), (b"a", b"b")]


def test_special_tokens_are_hard_boundaries_in_training():
    # Without the special token the text would be "x<|", "endoftext", "|>x" ...: many pairs.
    vocab, merges = train_bpe(iter(["x" + EOT] * 50), 300, [EOT])
    assert merges == []  # the only pre-token is "x": no pair at all
    assert len(vocab) == 257 and vocab[256] == EOT.encode()
    # A special token that contains another one is matched whole (longest first).
    counts = reference.count_pretokens(iter(["a<|s|><|t|>b<|s|>c"]), ["<|s|>", "<|s|><|t|>"])
    assert counts == Counter({"a": 1, "b": 1, "c": 1})


def test_train_input_forms_agree(tmp_path):
    path = fixture_file("corpus.en")
    text = path.read_text(encoding="utf-8")
    expected = train_bpe(str(path), 320, [EOT])
    assert train_bpe(path, 320, [EOT]) == expected
    assert train_bpe([path], 320, [EOT]) == expected
    # Each item of an iterable is a document: the file's documents give the file's merges.
    assert train_bpe(iter(text.split(EOT)), 320, [EOT]) == expected


def test_each_input_file_is_its_own_text(tmp_path):
    (tmp_path / "a.txt").write_text("a\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("\n b", encoding="utf-8")
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    assert reference.count_pretokens(files) == Counter({"a": 1, "\n": 2, " b": 1})
    # The items of an iterable of str are documents, apart like files; one item is one text.
    assert reference.count_pretokens(iter(["a\n", "\n b"])) == Counter({"a": 1, "\n": 2, " b": 1})
    assert reference.count_pretokens(iter(["a\n\n b"])) == Counter({"a": 1, "\n\n": 1, " b": 1})


@pytest.mark.parametrize("name", ["gpt2", "cl100k", "o200k"])
def test_count_pretokens_follows_the_selected_pattern(name, corpus_samples):
    text = corpus_samples["stories"][:50_000] + corpus_samples["multilingual"][:20_000]
    expected = Counter()
    for doc in text.split(EOT):
        expected.update(regex.findall(patterns.resolve(name), doc))
    assert reference.count_pretokens(iter(text.split(EOT)), [EOT], name) == expected


def test_custom_pattern_is_a_regex():
    counts = reference.count_pretokens(iter(["ab cd ab"]), [], r"\S+|\s+")
    assert counts == Counter({"ab": 2, " ": 2, "cd": 1})


# --------------------------------------------------------------------------------------
# encoding: parity with tiktoken
# --------------------------------------------------------------------------------------


def test_gpt2_tokenizer_keeps_gpt2_ids(gpt2, gpt2_vocab_merges):
    vocab, merges = gpt2_vocab_merges
    assert gpt2.vocab == vocab and gpt2.merges == merges
    assert gpt2.encode(EOT) == [50256]
    assert gpt2.encode("Hello world") == [15496, 995]
    # A special token that is not in the vocab is appended after the largest id.
    tok = Tokenizer(vocab, merges, [EOT, "<|im_start|>"])
    assert tok.encode("<|im_start|>hi" + EOT) == [50257, 5303, 50256]


def test_encode_matches_tiktoken_on_fixture_texts(gpt2, tiktoken_gpt2, fixture_texts):
    for name, text in fixture_texts.items():
        assert gpt2.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all"), name
        assert gpt2.decode(gpt2.encode(text)) == text, name


def test_encode_matches_tiktoken_on_every_corpus(gpt2, tiktoken_gpt2, corpus_samples):
    for name, text in corpus_samples.items():
        ids = gpt2.encode(text)
        assert ids == tiktoken_gpt2.encode(text, allowed_special="all"), name
        assert gpt2.decode(ids) == text, name


@settings(max_examples=400, deadline=None)
@given(text=mixed_text)
def test_encode_matches_tiktoken_on_generated_text(gpt2, tiktoken_gpt2, text):
    ids = gpt2.encode(text)
    assert ids == tiktoken_gpt2.encode(text, allowed_special="all")
    assert gpt2.decode(ids) == without_lone_surrogates(text)


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(SURROGATE_FRAGMENTS + FRAGMENTS[:30]), max_size=20).map("".join))
def test_lone_surrogates_are_encoded_as_tiktoken_does(gpt2, tiktoken_gpt2, text):
    # tiktoken passes the text through UTF-16 (surrogatepass / replace): a valid pair becomes
    # its character, a lone surrogate becomes U+FFFD. The reference does the same.
    assert gpt2.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all")


def test_surrogate_examples(gpt2):
    assert gpt2.encode("\ud800") == gpt2.encode("\ufffd")
    assert gpt2.decode(gpt2.encode("x\udfff")) == "x\ufffd"
    assert gpt2.encode("a\ud83d\ude00") == gpt2.encode("a😀")


@pytest.mark.parametrize("name", ["cl100k", "o200k"])
def test_other_patterns_match_tiktoken(gpt2_vocab_merges, name, corpus_samples):
    tiktoken = pytest.importorskip("tiktoken")
    vocab, merges = gpt2_vocab_merges
    ranks = {b: i for i, b in vocab.items() if i != 50256}
    peer = tiktoken.Encoding(
        f"gpt2-{name}", pat_str=patterns.resolve(name), mergeable_ranks=ranks, special_tokens={EOT: 50256}
    )
    tok = Tokenizer(vocab, merges, [EOT], pattern=name)
    for text in corpus_samples.values():
        text = text[:20_000]
        assert tok.encode(text) == peer.encode(text, allowed_special="all")


def test_special_tokens_longest_first(gpt2_vocab_merges):
    vocab, merges = gpt2_vocab_merges
    double = EOT + EOT
    tok = Tokenizer(vocab, merges, [EOT, double])
    assert tok.encode(double) == [50257]
    assert tok.encode(EOT + "x" + EOT) == [50256, 87, 50256]
    assert tok.encode(double + EOT) == [50257, 50256]
    assert tok.decode([50257]) == double


def test_decode_replaces_invalid_utf8(gpt2):
    id_of = {b: i for i, b in gpt2.vocab.items()}
    lead_byte = id_of["中".encode()[:1]]
    assert gpt2.decode([lead_byte]) == "\ufffd"
    assert gpt2.decode([id_of[b"a"], lead_byte, id_of[b"b"]]) == "a\ufffdb"
    assert gpt2.decode([]) == ""


def test_tokenizer_train_and_encode_batch():
    path = fixture_file("corpus.en")
    tok = Tokenizer.train(path, 300)
    vocab, merges = train_bpe(path, 300, [EOT])
    assert tok.vocab == vocab and tok.merges == merges and tok.special_tokens == [EOT]
    texts = ["iron cement", EOT, "", "the mould edges"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts)[1] == [299]


def test_fresh_tokenizer_roundtrips_and_compresses(stories_tokenizer, corpus_samples):
    for name, text in corpus_samples.items():
        text = text[:20_000]
        ids = stories_tokenizer.encode(text)
        assert stories_tokenizer.decode(ids) == text, name
    story = corpus_samples["stories"][:20_000]
    assert len(stories_tokenizer.encode(story)) < len(story.encode()) / 3


# --------------------------------------------------------------------------------------
# streaming
# --------------------------------------------------------------------------------------


def test_encode_iterable_design_example(gpt2):
    assert list(gpt2.encode_iterable(["a\n", "\n", " b"])) == [64, 628, 275]


def test_encode_iterable_equals_encode_on_corpora(gpt2, corpus_samples, monkeypatch):
    rng = random.Random(0)
    for name, text in corpus_samples.items():
        whole = gpt2.encode(text)
        assert list(gpt2.encode_iterable(ragged(text, rng, 5000))) == whole, name
        with monkeypatch.context() as m:
            # Process after every chunk, so that every chunk boundary is a possible cut.
            m.setattr(reference, "_STREAM_MIN_CHARS", 0)
            sample = text[:10_000]
            assert list(gpt2.encode_iterable(ragged(sample, rng, 7))) == gpt2.encode(sample), name


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.sampled_from(FRAGMENTS + SURROGATE_FRAGMENTS), max_size=60).map("".join),
    seed=st.integers(0, 2**32),
)
def test_encode_iterable_equals_encode_on_generated_text(gpt2, text, seed):
    chunks = ragged(text, random.Random(seed), 6)
    old = reference._STREAM_MIN_CHARS
    reference._STREAM_MIN_CHARS = 0
    try:
        assert list(gpt2.encode_iterable(chunks)) == gpt2.encode(text)
    finally:
        reference._STREAM_MIN_CHARS = old


@pytest.mark.parametrize("name", ["gpt2", "cl100k", "o200k"])
@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(st.sampled_from(FRAGMENTS + SURROGATE_FRAGMENTS), max_size=60).map("".join),
    seed=st.integers(0, 2**32),
)
def test_streamed_pretokens_equal_whole_text(name, text, seed):
    specials = [EOT, EOT + EOT]

    def run(chunks):
        stream = reference._PreTokenStream(name, specials)
        items = [item for chunk in chunks for item in stream.feed(chunk)] + stream.finish()
        flat = []
        for item in items:
            flat.extend([("special", item)] if isinstance(item, str) else item)
        return flat

    assert run(ragged(text, random.Random(seed), 5)) == run([text])


def test_encode_iterable_is_lazy_and_bounded(gpt2):
    text = "Once upon a time, there was a little dog.\n\nIt ran   fast! "
    first = list(itertools.islice(gpt2.encode_iterable(itertools.repeat(text)), 5000))
    assert first == gpt2.encode(text * 400)[:5000]

    def peak_bytes(repeats: int) -> tuple[int, int]:
        tracemalloc.start()
        try:
            n = sum(1 for _ in gpt2.encode_iterable(text for _ in range(repeats)))
            return n, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    n_small, peak_small = peak_bytes(2_000)  # 116 KB of text
    n_big, peak_big = peak_bytes(20_000)  # 1.16 MB of text
    assert n_big == len(gpt2.encode(text * 20_000))
    assert peak_big < 1.25 * peak_small, f"memory grew with the input: {peak_small} -> {peak_big} bytes"


# --------------------------------------------------------------------------------------
# files: save / load / from_files / HF tokenizers
# --------------------------------------------------------------------------------------


def hf_from_dir(directory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    hf = tokenizers.Tokenizer(models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt")))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOT])
    return hf


def test_save_load_roundtrip(tmp_path, stories_tokenizer):
    stories_tokenizer.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.vocab == stories_tokenizer.vocab
    assert loaded.merges == stories_tokenizer.merges
    assert loaded.special_tokens == [EOT]
    assert loaded.fingerprint() == stories_tokenizer.fingerprint()
    again = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT])
    assert again.vocab == stories_tokenizer.vocab


def test_saved_files_load_in_hf_tokenizers(tmp_path, gpt2, stories_tokenizer, corpus_samples, fixture_texts):
    texts = [t[:20_000] for t in corpus_samples.values()] + list(fixture_texts.values())
    for name, tok in [("gpt2", gpt2), ("stories", stories_tokenizer)]:
        directory = tmp_path / name
        tok.save(directory)
        hf = hf_from_dir(directory)
        for text in texts:
            ids = tok.encode(text)
            assert hf.encode(text).ids == ids, name
            assert hf.decode(ids, skip_special_tokens=False) == text, name


def test_loading_gpt2_files_gives_gpt2_ids(gpt2):
    tok = Tokenizer.from_files(fixture_file("gpt2_vocab.json"), fixture_file("gpt2_merges.txt"), [EOT])
    text = fixture_file("address.txt").read_text(encoding="utf-8")
    assert tok.encode(text) == gpt2.encode(text)


# --------------------------------------------------------------------------------------
# bad input: clear exceptions that name the problem
# --------------------------------------------------------------------------------------


def test_missing_input_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"input file not found: .*nope\.txt"):
        train_bpe(tmp_path / "nope.txt", 300, [EOT])
    with pytest.raises(FileNotFoundError, match=r"iter\(texts\)"):
        train_bpe(["some text, not a path"], 300, [EOT])


def test_invalid_utf8_names_file_and_offset(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello " + b"\xff" + b" world")
    with pytest.raises(ValueError, match=r"bad\.txt: not valid UTF-8 at byte 6"):
        train_bpe(bad, 300, [])


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match=r"vocab_size=256 .* at least 257"):
        train_bpe(iter(["abc"]), 256, [EOT])
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        train_bpe(iter(["abc"]), 300.0, [])


def test_bad_special_tokens():
    with pytest.raises(TypeError, match="list of str"):
        train_bpe(iter(["abc"]), 300, EOT)
    with pytest.raises(ValueError, match="empty string"):
        train_bpe(iter(["abc"]), 300, [""])
    with pytest.raises(ValueError, match="listed twice"):
        train_bpe(iter(["abc"]), 300, [EOT, EOT])


def test_bad_pattern():
    with pytest.raises(ValueError, match="invalid pre-tokenization pattern"):
        train_bpe(iter(["abc"]), 300, [], pattern="(unclosed")


def test_malformed_vocab_and_merges_files(tmp_path):
    vocab_path, merges_path = tmp_path / "vocab.json", tmp_path / "merges.txt"
    merges_path.write_text("#version: 0.2\na b\n", encoding="utf-8")

    vocab_path.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match=r"vocab\.json: not valid JSON"):
        Tokenizer.from_files(vocab_path, merges_path)
    vocab_path.write_text('["a", "b"]', encoding="utf-8")
    with pytest.raises(TokenizerFileError, match=r"expected a JSON object"):
        Tokenizer.from_files(vocab_path, merges_path)
    vocab_path.write_text('{"a": -1}', encoding="utf-8")
    with pytest.raises(TokenizerFileError, match=r"non-negative integer"):
        Tokenizer.from_files(vocab_path, merges_path)
    vocab_path.write_text('{"a b": 0}', encoding="utf-8")
    with pytest.raises(TokenizerFileError, match=r"not in GPT-2's byte-to-unicode alphabet"):
        Tokenizer.from_files(vocab_path, merges_path)

    vocab_path.write_text('{"a": 0, "b": 1, "ab": 2}', encoding="utf-8")
    merges_path.write_text("#version: 0.2\nab\n", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match=r"merges\.txt:2: expected two tokens"):
        Tokenizer.from_files(vocab_path, merges_path)
    merges_path.write_text("a c\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merge 0 .*b'c' is not in the vocab"):
        Tokenizer.from_files(vocab_path, merges_path)
    merges_path.write_text("a b\n", encoding="utf-8")
    assert Tokenizer.from_files(vocab_path, merges_path).encode("ab") == [2]

    with pytest.raises(FileNotFoundError, match=r"merges file not found: .*missing\.txt"):
        Tokenizer.from_files(vocab_path, tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match=r"tokenizer directory not found"):
        Tokenizer.load(tmp_path / "no-such-dir")


def test_decode_rejects_unknown_ids(gpt2):
    with pytest.raises(ValueError, match=r"token id 50257 is out of range.*0\.\.50256"):
        gpt2.decode([15496, 50257])
    with pytest.raises(ValueError, match=r"token id -1 is out of range"):
        gpt2.decode([-1])
    with pytest.raises(TypeError, match=r"token ids must be ints, got str"):
        gpt2.decode(["15496"])


def test_encode_rejects_non_str(gpt2):
    with pytest.raises(TypeError, match=r"encode expects a str, got bytes"):
        gpt2.encode(b"hello")
    with pytest.raises(TypeError, match=r"encode expects a str, got NoneType"):
        gpt2.encode(None)
    with pytest.raises(TypeError, match=r"use encode\(\) for a single str"):
        list(gpt2.encode_iterable("hello"))
    with pytest.raises(TypeError, match=r"expected str chunks of text, got bytes"):
        list(gpt2.encode_iterable(["ok", b"bytes"]))

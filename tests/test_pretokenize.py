"""The Rust pre-tokenizer against the pure-Python reference (Python's `regex` module
given the core's Unicode classes), the ground truth.

The built-in patterns run on hand-written scanners in rust/pretokenize.rs; these tests
check they give exactly the reference's pieces (`regex.findall` of the pattern with the
core's classes): on random text biased towards the characters the patterns treat
specially, on the fixtures and on slices of each test corpus (tests/texts.py; set
FERROLM_FULL_CORPUS=1 to compare them whole, at a larger size). tests/test_unicode.py
checks every code point, and tiktoken.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("regex")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from texts import CORPORA, corpus_text, fixture_file

from ferrolm import _core
from ferrolm.bpe import patterns, reference

NAMES = ["gpt2", "cl100k", "o200k"]
SPLIT = {name: reference._compile_pattern(name)[1] for name in NAMES}


def expected(name: str, text: str) -> list[str]:
    return SPLIT[name](text)


def check(name: str, text: str) -> None:
    got = _core.pretokenize(text, name)
    want = expected(name, text)
    if got != want:
        # Report the first difference, not two huge lists.
        i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        pytest.fail(
            f"{name}: piece {i} differs: rust {got[i : i + 3]!r} vs reference {want[i : i + 3]!r} "
            f"(after {''.join(want[max(0, i - 3) : i])!r})"
        )


# ---------------------------------------------------------------------------------
# Pattern sources and Unicode classes


@pytest.mark.parametrize("name", ["gpt2", "r50k", "p50k", "cl100k", "cl100k_base", "o200k", "o200k_base"])
def test_rust_pattern_sources_equal_python_ones(name):
    assert _core.pattern_source(name) == patterns.NAMED[name]


def test_unknown_pattern_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown built-in pattern"):
        _core.pattern_source("gpt3")


def test_builtin_source_given_as_regex_gives_same_pieces():
    text = "Hello world's 123 \n\n  x"
    for name in NAMES:
        assert _core.pretokenize(text, patterns.NAMED[name]) == _core.pretokenize(text, name)


def test_char_class_flags_are_consistent():
    # Sanity of the expectation itself: a few known chars.
    assert list(_core._char_classes("aA\u01c5\u02b0\u4e2d\u0301\u0663 \x1c")) == [33, 17, 17, 49, 49, 56, 2, 4, 0]


# ---------------------------------------------------------------------------------
# Hand-picked cases (each checked against the reference too, so a wrong expectation fails)

CASES = [
    "",
    "a",
    " ",
    "  ",
    "\n",
    "Hello, world! It's 2024.",
    "I'll  go!\n\n x",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'Ve 'M 'lL 'D '\u017f",
    "don't DON'T Don'T don\u2019t",
    "x  \n\n  \n y",
    "  a\t\tb\n",
    "abc \n",
    "abc\n",
    "abc\n\n",
    "abc  ",
    "a \u00a0b \u3000c\u2028d",
    "\u0301AB \u0301'sX !\u0301 !!\u0301",
    "a\n/\n !\n/\nx // /\r\n",
    "aBC ABc ABC\u01c5 \u02b0AB A\u02b0'S camelCaseWord HTTPServer",
    "12345 \u0663\u0663\u0663\u0663 \u216b\u216b 1/2 \u00bd\u00b2",
    "\u4e2d\u6587\u5b57 \u3042\u3044 \u0416\u0436 \u05d0\u05d1 \U0001f600\u200d\U0001f3fb\ufe0f",
    "\r\n\r\n  \r\n",
    "end with space ",
    "end with newline and spaces\n  ",
    " \n",
    "\t\n \t",
    "'",
    "''s",
    "\x1c\x1d\x1e\x1f \x1c",
    "\x85\x85a",
    "\u0295 \U0001e5d0",
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("text", CASES)
def test_hand_picked_cases(name, text):
    check(name, text)


def test_pieces_cover_the_text():
    text = "Mixed: caf\u00e9 na\u00efve \u0915\u094d\u0937 \n\t 42\u0661 'tis \u00a0!"
    for name in NAMES:
        assert "".join(_core.pretokenize(text, name)) == text


def test_custom_pattern_uses_regex_semantics():
    assert _core.pretokenize("a12b345c", r"\d+") == ["12", "345"]
    with pytest.raises(ValueError):
        _core.pretokenize("x", "(unclosed")


# ---------------------------------------------------------------------------------
# Random differential tests

TRICKY = list(
    " \t\n\r\x0b\x0c\x85\xa0\u3000\u2028\u1680\u2009\x1c\x00"  # whitespace and near misses
    "''''sStTlLvVeErRdDmM\u017f\u212a"  # contractions and their case folds
    "azQ\u00e9\u00c9\u00df\u01c5\u02b0\u00aa\u4e2d\u3042\u0416\u0436\u05d0\u0295"  # letters of each case class
    "\U00010400\U00010428\U0001d400\U0001e5d0"  # astral letters
    "\u0301\u0903\u20dd\u0e31\U000e0100"  # marks (Mn, Mc, Me)
    "07\u0663\u0967\u216b\u00bd\u00b2\U0001d7ce"  # numbers (Nd, Nl, No)
    '!.,/-"(@#\u2019\u00b7'  # punctuation
    "\U0001f600\u200d\U0001f3fb\ufe0f\ue000"  # emoji, joiners, private use
)
# Any code point except surrogates (which Python passes to Rust replaced).
ANY_CHAR = st.characters(blacklist_categories=("Cs",))
CHAR = st.one_of(st.sampled_from(TRICKY), st.sampled_from(TRICKY), ANY_CHAR)
# Small alphabets make runs and repetitions (the source of backtracking subtleties) likely.
SMALL_ALPHABET_TEXT = st.lists(CHAR, min_size=1, max_size=5).flatmap(
    lambda alphabet: st.text(st.sampled_from(alphabet), max_size=40)
)
FRAGMENTS = [
    " ",
    "  ",
    "\n",
    "\r\n",
    "\n\n",
    " \n",
    "\t",
    "'s",
    "'S",
    "'ll",
    "'LL",
    "'ve",
    "'re",
    "'d",
    "'",
    "/",
    "//",
    "\u0301",
    "word",
    "Word",
    "WORD",
    "wORD",
    "\u02b0",
    "\u01c5",
    "123",
    "1234",
    "\u0663",
    "!",
    "...",
    "\u00a0",
    "\u3000",
    "\u4e2d\u6587",
    "\U0001f600",
    "x",
    "I",
]
FRAGMENT_TEXT = st.lists(st.one_of(st.sampled_from(FRAGMENTS), CHAR), max_size=20).map("".join)

# Long, mostly ASCII text: the Rust scanners work on 64-byte windows of ASCII there.
ASCII_PROSE = list("     \n\n\t\r\x0b\x0c''stlverdmabxSLETRA019.,!/-\"(")
PROSE_CHAR = st.one_of(st.sampled_from(ASCII_PROSE), st.sampled_from(ASCII_PROSE), st.sampled_from(ASCII_PROSE), CHAR)
LONG_TEXT = st.one_of(
    st.text(PROSE_CHAR, min_size=50, max_size=300),
    st.lists(PROSE_CHAR, min_size=1, max_size=6).flatmap(
        lambda alphabet: st.text(st.sampled_from(alphabet), min_size=50, max_size=300)
    ),
)

# Long ASCII text with a non-ASCII char here and there (as in English Wikipedia): the GPT-2
# scanner's windows classify a few such chars themselves instead of leaving them to the
# scalar scanner.
SPARSE_CHAR = st.one_of(*[st.sampled_from(ASCII_PROSE)] * 12, CHAR)
SPARSE_TEXT = st.text(SPARSE_CHAR, min_size=60, max_size=400)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(text=st.text(CHAR, max_size=60))
def test_random_text_matches_regex(name, text):
    check(name, text)


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(text=SMALL_ALPHABET_TEXT)
def test_small_alphabet_text_matches_regex(name, text):
    check(name, text)


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(text=FRAGMENT_TEXT)
def test_fragment_text_matches_regex(name, text):
    check(name, text)


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(text=LONG_TEXT)
def test_long_mostly_ascii_text_matches_regex(name, text):
    check(name, text)


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(text=SPARSE_TEXT)
def test_long_text_with_sparse_non_ascii_matches_regex(name, text):
    check(name, text)


# ---------------------------------------------------------------------------------
# Real text: fixtures and corpora

FIXTURES = ["address.txt", "corpus.en", "german.txt", "tinystories_sample.txt"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fixture", FIXTURES)
def test_fixture_files(name, fixture):
    text = fixture_file(fixture).read_text(encoding="utf-8")
    check(name, text)


FULL = os.environ.get("FERROLM_FULL_CORPUS") == "1"
SLICE = 1 << 20 if FULL else 1 << 17
CORPUS_CHARS = 8 << 20 if FULL else 1 << 20


def slices(text: str, size: int, count: int | None):
    """Slices of about `size` chars cut after newlines: all of them, or `count` spread
    over the text (start, middle, end...)."""
    if len(text) <= size:
        yield text
        return
    starts = (
        list(range(0, len(text), size))
        if count is None
        else [k * (len(text) - size) // max(count - 1, 1) for k in range(count)]
    )
    for s in starts:
        if s > 0:
            nl = text.find("\n", s)
            s = len(text) if nl < 0 else nl + 1
        e = min(len(text), s + size)
        nl = text.find("\n", e)
        e = len(text) if nl < 0 else nl + 1
        if s < e:
            yield text[s:e]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("corpus", CORPORA)
def test_corpora(name, corpus):
    """Slices of each test corpus (whole, and larger, with FERROLM_FULL_CORPUS=1) piece for piece."""
    text = corpus_text(corpus, CORPUS_CHARS)
    for part in slices(text, SLICE, None if FULL else 3):
        check(name, part)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

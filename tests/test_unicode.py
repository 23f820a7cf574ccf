"""The Unicode classes of the built-in patterns, on every code point.

One Unicode version for all: the Rust core's tables (generated from the regex engine it
uses), the reference's class definitions (python/ferrolm/bpe/unicode_classes.py, from the
same generator) and tiktoken, which defines the gpt2/cl100k/o200k vocabularies. None of it
may depend on the installed `regex` module's own tables.
"""

from __future__ import annotations

import functools
import os
import random

import pytest

tiktoken = pytest.importorskip("tiktoken")

from ferrolm import _core
from ferrolm.bpe import patterns, reference, tokenizer
from ferrolm.bpe.unicode_classes import RANGES, UNICODE_VERSION

NAMES = ["gpt2", "cl100k", "o200k"]
# Every code point but the surrogates (which a str passed to Rust or tiktoken cannot hold).
CODE_POINTS = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]
ALL = "".join(map(chr, CODE_POINTS))
# Bits of _core._char_classes and the classes (unions of RANGES' classes) they stand for.
FLAGS = [
    (1, r"\p{L}", ("Lu", "Lt", "Ll", "Lm", "Lo")),
    (2, r"\p{N}", ("N",)),
    (4, r"\s", ("s",)),
    (8, r"\p{M}", ("M",)),
    (16, r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", ("Lu", "Lt", "Lm", "Lo", "M")),
    (32, r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", ("Ll", "Lm", "Lo", "M")),
]
BYTE_RANKS = {bytes([b]): b for b in range(256)}


def ranges_members(classes: tuple[str, ...]) -> set[int]:
    out: set[int] = set()
    for name in classes:
        for item in RANGES[name].split():
            first, _, last = item.partition("-")
            out.update(range(int(first, 16), int(last or first, 16) + 1))
    return out


def tiktoken_members(cls: str) -> set[int]:
    """The code points tiktoken's engine puts in `cls`: with single-byte ranks, the ids of
    a text are its UTF-8 bytes, and text the pattern does not match is left out."""
    enc = tiktoken.Encoding("classes", pat_str=cls, mergeable_ranks=BYTE_RANKS, special_tokens={})
    return set(map(ord, bytes(enc.encode_ordinary(ALL)).decode("utf-8")))


def describe(cps) -> str:
    cps = sorted(cps)
    return f"{len(cps)} code points: " + " ".join(f"U+{cp:04X}" for cp in cps[:12])


def test_unicode_version_is_one_everywhere():
    assert _core.unicode_version() == patterns.UNICODE_VERSION == UNICODE_VERSION
    assert UNICODE_VERSION.count(".") == 2


@pytest.mark.parametrize("flag,cls,classes", FLAGS, ids=[f[1] for f in FLAGS])
def test_core_and_reference_classes_equal_tiktoken(flag, cls, classes):
    """Every code point: the core's tables, the generated ranges and tiktoken agree."""
    flags = _core._char_classes(ALL)
    core = {cp for cp, f in zip(CODE_POINTS, flags) if f & flag}
    ranges = ranges_members(classes)
    theirs = tiktoken_members(cls)
    versions = f"core Unicode {_core.unicode_version()}, ranges {UNICODE_VERSION}, tiktoken {tiktoken.__version__}"
    assert core == ranges, f"{cls}: core vs ranges ({versions}) differ on {describe(core ^ ranges)}"
    assert ranges == theirs, f"{cls}: ranges vs tiktoken ({versions}) differ on {describe(ranges ^ theirs)}"


@pytest.mark.parametrize("name", ["Lu", "Lt", "Ll", "Lm", "Lo"])
def test_letter_case_ranges_equal_tiktoken(name):
    assert ranges_members((name,)) == tiktoken_members(rf"\p{{{name}}}")


def test_ranges_are_disjoint():
    seen: set[int] = set()
    for name in RANGES:
        members = ranges_members((name,))
        assert not seen & members, name
        seen |= members


# ---------------------------------------------------------------------------------
# Every code point in contexts that show the piece boundaries around it: before a
# contraction, after a space, between letters and digits, before a newline and spaces,
# after an uppercase letter, doubled. Planes 4-13, 15 and 16 (unassigned or private use in
# every Unicode version so far) get a shorter context, to keep the texts' length down.
CONTEXT = "{c}'s {c}a{c}1{c}\n A{c}{c}'T.\n"
SHORT_CONTEXT = "{c}'s {c}a{c}1\n"


def context_text(cps) -> str:
    return "".join(
        (CONTEXT if cp < 0x40000 or 0xE0000 <= cp < 0xF0000 else SHORT_CONTEXT).format(c=chr(cp)) for cp in cps
    )


def first_difference(a: list, b: list) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def encoders(gpt2_vocab_merges):
    """Per pattern: ferrolm's Tokenizer and tiktoken's Encoding with GPT-2's ranks."""
    vocab, merges = gpt2_vocab_merges
    ranks = {b: i for i, b in vocab.items() if i != 50256}
    out = {}
    for name in NAMES:
        ours = tokenizer.Tokenizer(vocab, merges, ["<|endoftext|>"], pattern=name)
        theirs = tiktoken.Encoding(name, pat_str=patterns.NAMED[name], mergeable_ranks=ranks, special_tokens={})
        out[name] = ours, theirs
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_every_code_point_in_context_pieces_equal_reference(name):
    text = context_text(CODE_POINTS)
    got = _core.pretokenize(text, name)
    want = reference._compile_pattern(name)[1](text)
    if got != want:
        i = first_difference(got, want)
        pytest.fail(f"{name}: piece {i}: core {got[i : i + 3]!r} vs reference {want[i : i + 3]!r}")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_every_code_point_in_context_ids_equal_tiktoken(name, encoders):
    ours, theirs = encoders[name]
    text = context_text(CODE_POINTS)
    got, want = ours.encode_ordinary(text), theirs.encode_ordinary(text)
    if got != want:
        i = first_difference(got, want)
        near = theirs.decode(want[max(0, i - 8) : i + 8])
        pytest.fail(f"{name}: id {i}: ours {got[i : i + 4]} vs tiktoken {want[i : i + 4]} near {near!r}")


# ---------------------------------------------------------------------------------
# Random texts

# Code points assigned in Unicode 15.0-17.0 (the newest ones are unassigned to the core's
# version and letters to a newer `regex`), and characters changed between versions.
RECENT = [
    *range(0x0C5C, 0x0C5E),
    0x0CDC,
    0x088F,
    0x0295,
    0x1C89,
    *range(0xA7CB, 0xA7DD),
    *range(0x10940, 0x1095A),
    *range(0x10D40, 0x10D90),
    *range(0x11DB0, 0x11DEA),
    *range(0x11F00, 0x11F5B),
    *range(0x16100, 0x1613A),
    *range(0x16EA0, 0x16EDA),
    *range(0x1E5D0, 0x1E5FB),
    *range(0x2EBF0, 0x2EE5E, 97),
    *range(0x323B0, 0x3347A, 61),
]
COMMON = list(
    " \t\n\r\u00a0\u3000''sStTdDlLvVeErRmM\u017f\u212aaZ0159\u0663\u00bd.,!/-\"(\u4e2d\u3042\u0416\u0436\u05d0\u0301\U0001f600"
)
SCRIPTS = [
    (0x41, 0x7A),
    (0xC0, 0x24F),
    (0x370, 0x3FF),
    (0x400, 0x4FF),
    (0x590, 0x6FF),
    (0x900, 0x97F),
    (0x4E00, 0x4E80),
]


def alphabet(rng: random.Random) -> tuple[list[str], list[int]]:
    """Characters to draw from, and their cumulative weights: recent code points 3 in 10,
    common and special characters 4 in 10, letters of a few scripts 2 in 10, and any code
    point 1 in 10."""
    anything = [rng.randrange(0x110000 - 0x800) for _ in range(50_000)]
    groups = [
        (3, [chr(cp) for cp in RECENT]),
        (4, COMMON),
        (2, [chr(cp) for lo, hi in SCRIPTS for cp in range(lo, hi + 1)]),
        (1, [chr(cp + 0x800 if cp >= 0xD800 else cp) for cp in anything]),
    ]
    chars, cum, total = [], [], 0.0
    for weight, group in groups:
        for c in group:
            total += weight / len(group)
            chars.append(c)
            cum.append(total)
    return chars, cum


@functools.cache
def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    chars, cum = alphabet(rng)
    return ["".join(rng.choices(chars, cum_weights=cum, k=rng.randrange(1, 24))) for _ in range(count)]


# 50,000 seeded texts per pattern in the suite (about 6 s each); the every-code-point tests
# above cover each character, these the mixes. FERROLM_RANDOM_TEXTS=200000 for a longer run.
TEXTS = int(os.environ.get("FERROLM_RANDOM_TEXTS", "50000"))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_random_texts_equal_tiktoken_and_reference(name, encoders):
    ours, theirs = encoders[name]
    texts = random_texts(1234, TEXTS)
    split = reference._compile_pattern(name)[1]
    got = ours.encode_batch(texts)
    want = theirs.encode_ordinary_batch(texts)
    bad_ids = [t for t, a, b in zip(texts, got, want) if a != b]
    bad_pieces = [t for t in texts if _core.pretokenize(t, name) != split(t)]
    assert not bad_ids, f"{name}: {len(bad_ids)} of {TEXTS} texts encode unlike tiktoken, e.g. {bad_ids[:3]!r}"
    assert not bad_pieces, f"{name}: {len(bad_pieces)} of {TEXTS} texts cut unlike the reference: {bad_pieces[:3]!r}"


def test_patterns_are_unchanged_where_regex_agrees_with_the_core(monkeypatch):
    from ferrolm.bpe import core_classes

    def installed_as_core(escape):
        return frozenset(set().union(*(core_classes._core_members(c) for c in core_classes._ESCAPES[escape])))

    monkeypatch.setattr(core_classes, "_installed_members", installed_as_core)
    core_classes.with_core_classes.cache_clear()
    try:
        for name in NAMES:
            assert core_classes.with_core_classes(patterns.NAMED[name]) == patterns.NAMED[name]
    finally:
        core_classes.with_core_classes.cache_clear()


def test_unknown_constructs_in_a_builtin_rewrite_are_errors():
    from ferrolm.bpe import core_classes

    with pytest.raises(ValueError, match="unexpected"):
        core_classes.with_core_classes(r"[a-z\p{L}]")

"""Pre-tokenization patterns, by name. The Rust core carries the same strings
(rust/pretokenize.rs); a test checks they agree."""

from __future__ import annotations

import difflib
import functools
import re

# The Unicode version of the built-in patterns' classes (\p{L}, \p{N}, \s, ...), in the Rust
# core (ferrolm._core.unicode_version()) and the reference alike: fixed per release, that of
# the regex engine the core uses (regex-syntax) and of tiktoken. Tokenizer records keep it,
# so a folder saved under other classes is noticed.
from ferrolm.bpe.unicode_classes import UNICODE_VERSION as UNICODE_VERSION

GPT2 = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

CL100K = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""

O200K = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NAMED = {
    "gpt2": GPT2,
    "r50k": GPT2,
    "p50k": GPT2,
    "cl100k": CL100K,
    "cl100k_base": CL100K,
    "o200k": O200K,
    "o200k_base": O200K,
}


def unicode_version() -> str:
    """The Unicode version of the compiled pre-tokenizer's character classes."""
    try:
        from ferrolm import _core
    except ImportError:  # the pure-Python reference alone
        return UNICODE_VERSION
    fn = getattr(_core, "unicode_version", None)
    return fn() if fn is not None else UNICODE_VERSION


def resolve(pattern: str) -> str:
    """The regex source for a pattern name ("gpt2", "cl100k", "o200k") or a custom regex
    (Python ``regex`` syntax; ValueError, with the regex module's reason, when it is not one)."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str (a name or a regex), got {type(pattern).__name__}")
    if pattern in NAMED:
        return NAMED[pattern]
    if not pattern:
        raise ValueError("the pattern is empty: give a name (gpt2, cl100k, o200k) or a regex")
    if re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", pattern):
        # A bare word would split text into nothing but itself: surely a misspelt name.
        raise ValueError(f"unknown pattern name {pattern!r}{_suggest(pattern)}; the names are gpt2, cl100k and o200k")
    _check_regex(pattern)
    return pattern


@functools.lru_cache(maxsize=64)
def _check_regex(source: str) -> None:
    import regex  # the documented syntax; imported only for custom patterns

    try:
        regex.compile(source)
    except regex.error as e:
        raise ValueError(f"invalid pre-tokenization pattern {source!r}: {e}") from None


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, ["gpt2", "cl100k", "o200k"], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def name_of(pattern: str) -> str:
    """The short name of a built-in pattern source, or the source itself for custom ones."""
    source = resolve(pattern)
    for name in ("gpt2", "cl100k", "o200k"):
        if NAMED[name] == source:
            return name
    return source

"""Pre-tokenization patterns, by name. The Rust core carries the same strings
(rust/pretokenize.rs); a test checks they agree."""

from __future__ import annotations

# The Unicode version of the built-in patterns' classes (\p{L}, \p{N}, \s, ...), in the Rust
# core (ferrolm._core.unicode_version()) and the reference alike: fixed per release, that of
# the regex engine the core uses (regex-syntax) and of tiktoken.
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


def resolve(pattern: str) -> str:
    """The regex source for a pattern name ("gpt2", "cl100k", "o200k") or a custom regex."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str (a name or a regex), got {type(pattern).__name__}")
    return NAMED.get(pattern, pattern)


def name_of(pattern: str) -> str:
    """The short name of a built-in pattern source, or the source itself for custom ones."""
    source = resolve(pattern)
    for name in ("gpt2", "cl100k", "o200k"):
        if NAMED[name] == source:
            return name
    return source

"""The built-in patterns rewritten so that Python's `regex` module applies the Rust core's
Unicode classes instead of its own.

Each `regex` release carries the Unicode version of its day, while the core's classes are
fixed per release (unicode_classes.py, generated from the regex engine the core uses). So
that the reference cuts text exactly as the core does whatever `regex` is installed, every
class in a built-in pattern (`\\p{L}`, `\\s`, `[^\\s\\p{L}\\p{N}]`, ...) is corrected where
the installed tables differ: the code points the core has in the class and `regex` has not
are added to it, the reverse removed. Both sets are small (recently assigned or
recategorised code points), so the pattern stays nearly as fast as the original, and with a
`regex` of the core's Unicode version it is unchanged.
"""

from __future__ import annotations

import array
import functools

import regex

from ferrolm.bpe.unicode_classes import RANGES, UNICODE_VERSION

__all__ = ["UNICODE_VERSION", "with_core_classes"]

# The escapes the built-in patterns use, as unions of the fine classes of RANGES.
_ESCAPES = {
    r"\s": ("s",),
    r"\p{L}": ("Lu", "Lt", "Ll", "Lm", "Lo"),
    r"\p{N}": ("N",),
    r"\p{M}": ("M",),
    r"\p{Lu}": ("Lu",),
    r"\p{Lt}": ("Lt",),
    r"\p{Ll}": ("Ll",),
    r"\p{Lm}": ("Lm",),
    r"\p{Lo}": ("Lo",),
}
_LITERAL_ESCAPES = {"r": "\r", "n": "\n", "t": "\t", "/": "/"}


@functools.cache
def _core_members(fine: str) -> frozenset[int]:
    members: set[int] = set()
    for item in RANGES[fine].split():
        first, _, last = item.partition("-")
        members.update(range(int(first, 16), int(last or first, 16) + 1))
    return frozenset(members)


@functools.cache
def _all_code_points() -> str:
    # Surrogates included, so that a code point's index in the text is the code point.
    return array.array("I", range(0x110000)).tobytes().decode("utf-32-le", "surrogatepass")


@functools.cache
def _installed_members(escape: str) -> frozenset[int]:
    members: set[int] = set()
    for m in regex.finditer(escape + "+", _all_code_points()):
        members.update(range(m.start(), m.end()))
    return frozenset(members)


def _members(escapes: list[str], literals: str, core: bool) -> set[int]:
    out = set(map(ord, literals))
    for e in escapes:
        if core:
            for fine in _ESCAPES[e]:
                out |= _core_members(fine)
        else:
            out |= _installed_members(e)
    return out


def _char_set(cps: set[int]) -> str:
    """A bracket class of the code points `cps`, as ranges of \\U escapes."""
    items: list[list[int]] = []
    for cp in sorted(cps):
        if items and items[-1][1] == cp - 1:
            items[-1][1] = cp
        else:
            items.append([cp, cp])
    return "[" + "".join(f"\\U{a:08x}" + (f"-\\U{b:08x}" if b > a else "") for a, b in items) + "]"


# General categories by major class: those a class leaves out make its complement.
_CATEGORIES = {
    "L": ("Lu", "Ll", "Lt", "Lm", "Lo"),
    "M": ("Mn", "Mc", "Me"),
    "N": ("Nd", "Nl", "No"),
    "P": ("Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po"),
    "S": ("Sm", "Sc", "Sk", "So"),
    "Z": ("Zs", "Zl", "Zp"),
    "C": ("Cc", "Cf", "Cs", "Co", "Cn"),
}


def _complement(escapes: list[str], literals: str) -> str | None:
    """Items of a bracket class holding exactly the code points not in `escapes`
    (general categories, or \\s alone), or None."""
    if literals:
        return None
    if len(escapes) == 1:
        return r"\S" if escapes[0] == r"\s" else r"\P" + escapes[0][2:]
    covered = {e[3:-1] for e in escapes}
    if r"\s" in escapes:
        return None
    items = []
    for major, subs in _CATEGORIES.items():
        if major in covered:
            continue
        left = [c for c in subs if c not in covered]
        items += [f"\\p{{{major}}}"] if len(left) == len(subs) else [f"\\p{{{c}}}" for c in left]
    return "".join(items)


def _corrected(text: str, items: str, escapes: list[str], literals: str, negated: bool) -> str:
    """`text`, one class of the pattern (bracket contents `items`), as the core defines it.

    Below the lowest code point t where the two differ, the installed class is right; from
    t on, the code points to remove are excluded and those to add listed. Each part is one
    negated bracket class (`regex` tests a class's items one by one, so ASCII text is
    decided by the first part's few items, and a lookahead per character would cost
    several times the original's time)."""
    if not escapes:
        return text
    core, installed = _members(escapes, literals, True), _members(escapes, literals, False)
    add, remove = core - installed, installed - core
    if negated:
        add, remove = remove, add
    if not add and not remove:
        return text
    outside = items if negated else _complement(escapes, literals)
    if outside is None:
        return f"(?:(?!{_char_set(remove)}){text}|{_char_set(add)})"
    t = min(add | remove)
    parts = [f"[^{outside}\\U{t:08x}-\\U0010ffff]"] if t > 0 else []
    parts.append(f"[^{outside}\\U00000000-\\U{t - 1:08x}" + (_char_set(remove)[1:] if remove else "]"))
    if add:
        parts.append(_char_set(add))
    return "(?:" + "|".join(parts) + ")"


def _escape_at(source: str, i: int) -> str:
    """The escape starting at source[i] (a backslash): `\\p{..}` or a backslash and one char."""
    if source.startswith("\\p{", i):
        return source[i : source.index("}", i) + 1]
    return source[i : i + 2]


def _bracket(source: str, i: int) -> tuple[str, int]:
    """The bracket class starting at source[i], corrected, and the index after it."""
    j = i + 1
    negated = source.startswith("^", j)
    j += negated
    escapes: list[str] = []
    literals = ""
    while source[j] != "]":
        if source[j] == "\\":
            e = _escape_at(source, j)
            if e in _ESCAPES:
                escapes.append(e)
            elif e[1:] in _LITERAL_ESCAPES:
                literals += _LITERAL_ESCAPES[e[1:]]
            else:
                raise ValueError(f"unexpected escape {e!r} in a built-in pattern")
            j += len(e)
        elif source[j] in "[-":
            raise ValueError(f"unexpected {source[j]!r} in a bracket of a built-in pattern")
        else:
            literals += source[j]
            j += 1
    items = source[i + 1 + negated : j]
    return _corrected(source[i : j + 1], items, escapes, literals, negated), j + 1


@functools.cache
def with_core_classes(source: str) -> str:
    """A built-in pattern's source with each class corrected to the core's Unicode classes
    (unchanged where the installed `regex` agrees). Only the constructs of the built-in
    patterns are understood: anything else raises ValueError."""
    out: list[str] = []
    i = 0
    while i < len(source):
        c = source[i]
        if c == "[":
            text, i = _bracket(source, i)
            out.append(text)
        elif c == "\\":
            e = _escape_at(source, i)
            if e in _ESCAPES:
                out.append(_corrected(e, e, [e], "", False))
            elif e == r"\S":
                out.append(_corrected(e, r"\s", [r"\s"], "", True))
            else:
                out.append(e)
            i += len(e)
        else:
            out.append(c)
            i += 1
    return "".join(out)

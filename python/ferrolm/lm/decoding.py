"""One decoding step's rules: sampling a token from logits, and turning tokens into text.

The pieces, in the order they act on one step's logits:

    temperature   x = logits / T                 T = 0 means greedy: the argmax, nothing drawn
    top-k         keep the k largest x           ties at the k-th value: the lowest ids win
    softmax       p = softmax(x over the kept tokens)
    top-p         keep the smallest set of most probable tokens whose mass reaches p
    renormalize   p = p / sum(p over the kept tokens)
    draw          one uniform u from the generator; the id where the cumulative p passes u

Exact definitions (the tests hold the code to them):

- Ties. Tokens are ranked by probability, highest first, and equal probabilities by id,
  lowest first (a stable sort). top-k keeps the first k of that ranking; top-p keeps the
  shortest prefix of it whose cumulative probability reaches p. So with four equally
  likely tokens, top_k=2 and top_p=0.5 both keep ids {0, 1}, never a random pair.
- "Reaches p": a token is kept when the mass of the tokens ranked before it is below
  ``p - 1e-6`` (the slack absorbs float32 rounding: 0.4 + 0.3 may sum to 0.69999996,
  which still reaches p = 0.7). The first token is always kept. ``top_p=1.0`` keeps every
  token. top-p acts on the distribution after temperature and top-k.
- Greedy (temperature 0) returns the lowest id among equal maxima; top-k and top-p
  cannot change it (the argmax is always kept).

Text: ``SequenceText`` is what every decoding path does with a sequence's new tokens (the
engine holds one per sequence): the end-of-text token ends the sequence and is not shown,
ids become text at UTF-8 character boundaries (``iter_text`` does that alone), and the text
is cut before the first stop string (``StopText``), which ends the sequence too.
"""

from __future__ import annotations

import codecs
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "top_k_mask",
    "top_p_mask",
    "sampling_probs",
    "sample",
    "check_sampling_args",
    "iter_text",
    "StopText",
    "SequenceText",
]

TOP_P_SLACK = 1e-6  # mass within this of p counts as reaching p (float32 rounding)


# --------------------------------------------------------------------------------------
# Pure functions on logits
# --------------------------------------------------------------------------------------


def check_sampling_args(temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None) -> None:
    """Raise ValueError naming the problem for a bad temperature, top_k or top_p."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def top_k_mask(logits: Tensor, k: int) -> Tensor:
    """Bool mask over the last dim: True for the k largest logits.

    Ties at the k-th value are broken by id, lowest first, so exactly min(k, vocab)
    tokens are kept.
    """
    vocab = logits.shape[-1]
    if k >= vocab:
        return torch.ones_like(logits, dtype=torch.bool)
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # the k-th largest value
    above = logits > kth
    tied = logits == kth
    room = k - above.sum(dim=-1, keepdim=True)  # how many of the tied ones fit
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def top_p_mask(probs: Tensor, p: float) -> Tensor:
    """Bool mask over the last dim: the smallest set of most probable tokens whose
    total probability reaches p (ranking ties by lowest id; see the module docstring)."""
    if p >= 1.0:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cumulative = sorted_probs.double().cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
    keep_sorted = mass_before < (p - TOP_P_SLACK)
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sampling_probs(
    logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None
) -> Tensor:
    """The distribution a step draws from, float32 over the last dim, summing to 1.

    Temperature, then top-k, softmax, top-p, renormalize. Temperature 0 gives a one-hot
    vector at the argmax (lowest id among equal maxima).
    """
    check_sampling_args(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    # Subtract the max first: (x - max) / T is <= 0 and cannot overflow for tiny T.
    x = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        x = x.masked_fill(~top_k_mask(x, top_k), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p is not None and top_p < 1.0:
        probs = probs * top_p_mask(probs, top_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _nucleus_candidates(probs: Tensor, p: float) -> Optional[Tensor]:
    """(rows, m) ids, ascending in each row, that surely contain every row's top-p set;
    None when the whole vocabulary must be ranked.

    The m most probable tokens of a row (m = 64, 256, 1024, ... up to half the vocab)
    are the first m of the full ranking when no token outside them ties with the m-th;
    if they hold mass >= p - slack (with a 1e-9 margin for summation order), the top-p
    prefix ends among them. Ranking them instead of the vocabulary gives the same set.
    """
    vocab = probs.shape[-1]
    m = 64
    while m <= vocab // 2:
        values, ids = torch.topk(probs, m, dim=-1)
        no_boundary_ties = bool(((probs >= values[:, -1:]).sum(dim=-1) == m).all())
        if no_boundary_ties and bool((values.double().sum(dim=-1) >= p - TOP_P_SLACK + 1e-9).all()):
            return ids.sort(dim=-1).values
        m *= 4
    return None


def _draw(weights: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """One index per row of non-negative ``weights`` (rows, n), with probability
    weight / row sum: inverse-CDF sampling (one uniform per row, a float64 cumulative sum,
    a binary search). Zero-weight entries are never drawn."""
    cumulative = weights.double().cumsum(dim=-1)
    total = cumulative[:, -1:]
    if not bool((total > 0).all() and torch.isfinite(total).all()):
        raise ValueError(
            "cannot sample: the probabilities are NaN or all zero (does the model output NaN or -inf logits?)"
        )
    device = generator.device if generator is not None else weights.device
    u = torch.rand(weights.shape[0], 1, dtype=torch.float64, generator=generator, device=device).to(weights.device)
    # u < 1, but u * total may round up to total: stay strictly below it.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True)  # first entry whose cumulative sum exceeds target


def sample(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Draw one id per row of ``logits`` (..., vocab) -> LongTensor (...), from the
    distribution ``sampling_probs`` describes.

    Draws use ``generator`` (a seeded ``torch.Generator`` reproduces them): one uniform
    number per row, drawn on the generator's device. Temperature 0 is the argmax and
    draws nothing. For speed, top-k and top-p rank only a shortlist of candidates
    instead of sorting the vocabulary; the kept sets are the same (tested).
    """
    check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    x = logits.float().reshape(-1, vocab)
    candidates = None
    if top_k is not None and top_k < vocab:
        # The k kept ids in ascending order, so the stable sort inside top-p still
        # breaks ties by lowest id.
        candidates = top_k_mask(x, top_k).nonzero()[:, 1].view(-1, top_k)
        x = x.gather(1, candidates)
    probs = torch.softmax((x - x.amax(dim=-1, keepdim=True)) / temperature, dim=-1)
    if top_p is not None and top_p < 1.0:
        if candidates is None:
            shortlist = _nucleus_candidates(probs, top_p)
            if shortlist is not None:
                candidates, probs = shortlist, probs.gather(1, shortlist)
        probs = probs * top_p_mask(probs, top_p)  # _draw renormalizes
    drawn = _draw(probs, generator)
    if candidates is not None:
        drawn = candidates.gather(1, drawn)
    return drawn.reshape(logits.shape[:-1])


# --------------------------------------------------------------------------------------
# Text out
# --------------------------------------------------------------------------------------


def iter_text(ids: Iterable[int], token_bytes: Callable[[int], bytes]) -> Iterator[str]:
    """Decode a stream of ids to text pieces, emitting only whole UTF-8 characters.

    A character split across tokens is held back until its last byte arrives; invalid
    bytes become U+FFFD exactly as in ``Tokenizer.decode`` (``bytes.decode("utf-8",
    "replace")``), so ``"".join(iter_text(ids, f)) == b"".join(map(f, ids)).decode("utf-8",
    "replace")``. Empty pieces are not yielded.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for t in ids:
        piece = decoder.decode(token_bytes(t))
        if piece:
            yield piece
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


class StopText:
    """Cuts streamed text before the first stop string: ``feed`` returns the part of a
    piece that is safe to show, holding back an end that may be the start of a stop string;
    ``done`` is set once a stop string appeared (it and what follows are never shown).

    "First" is the one that ends first in the text (of those ending at one character, the
    longest), whatever pieces the text came in. Each stop string keeps the length of its
    longest prefix that ends the text so far, advanced character by character with its
    prefix function (Knuth-Morris-Pratt), so the whole text costs time linear in its length
    and the stop strings' whatever their lengths; the text held back is the longest of
    those prefixes.
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self._fail = [_prefix_function(s) for s in self.stops]
        self._matched = [0] * len(self.stops)
        self._held: deque[str] = deque()  # characters not shown yet
        self.done = False

    def feed(self, piece: str) -> str:
        if self.done:
            return ""
        if not self.stops:
            return piece
        held, matched = self._held, self._matched
        for c in piece:
            held.append(c)
            found = 0
            for k, s in enumerate(self.stops):
                j, fail = matched[k], self._fail[k]
                while j and s[j] != c:
                    j = fail[j - 1]
                j = j + 1 if s[j] == c else 0
                if j == len(s):
                    found, j = max(found, j), fail[j - 1]
                matched[k] = j
            if found:
                self.done = True
                out = self._take(len(held) - found)
                held.clear()
                return out
        return self._take(len(held) - max(matched))

    def _take(self, n: int) -> str:
        popleft = self._held.popleft
        return "".join([popleft() for _ in range(n)])

    def flush(self) -> str:
        out = "" if self.done else "".join(self._held)
        self._held.clear()
        self._matched = [0] * len(self.stops)
        return out

    def cut(self, text: str) -> str:
        """``text`` cut before its first stop string (the whole text at once)."""
        return self.feed(text) + self.flush()


def _prefix_function(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail = [0] * len(s)
    j = 0
    for i in range(1, len(s)):
        while j and s[i] != s[j]:
            j = fail[j - 1]
        if s[i] == s[j]:
            j += 1
        fail[i] = j
    return fail


class SequenceText:
    """One sequence's text as its tokens arrive: ``feed(token)`` returns the new text that is
    safe to show and sets ``done`` when the sequence ends, at ``eos_id`` (not shown) or at a
    stop string (cut before it; ``stopped`` is set too); ``finish()`` returns what was held
    back (a character still missing bytes, a possible start of a stop string) once it ends
    for another reason. ``token_bytes(id)`` gives a token's bytes; ``end_ids``: more ids that
    end the sequence as ``eos_id`` does (a chat reply's end token)."""

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        eos_id: Optional[int],
        stops: Sequence[str] = (),
        end_ids: Sequence[int] = (),
    ):
        self.token_bytes = token_bytes
        self.eos_id = eos_id
        self._ends = frozenset(t for t in (eos_id, *end_ids) if t is not None)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = StopText(stops)
        self.done = False

    @property
    def stopped(self) -> bool:
        return self._stop.done

    def feed(self, token: int) -> str:
        if self.done:
            return ""
        if token in self._ends:
            self.done = True
            return ""
        text = self._stop.feed(self._utf8.decode(self.token_bytes(token)))
        self.done = self._stop.done
        return text

    def finish(self) -> str:
        self.done = True
        if self._stop.done:
            return ""
        return self._stop.feed(self._utf8.decode(b"", final=True)) + self._stop.flush()

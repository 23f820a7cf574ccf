"""Sampling from a TransformerLM: temperature, top-k, top-p, a KV cache, streaming.

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

Generation (``generate``) runs the prompt through the model once, filling a
preallocated KV cache (``TransformerLM.make_kv_cache``: per layer, keys stored after
RoPE), then feeds one position per new token. Details:

- Batches: prompts of different lengths are left-padded to a common length and run
  together with an attention mask, so padding is never attended. RoPE depends only on
  the distance between positions, so a padded row gets the logits it would get alone
  (up to float rounding); one forward pass per step serves the whole batch.
- Empty prompt: generation starts from ``eos_id`` used as a beginning-of-sequence token
  (documents are separated by eos in ferrolm's shards, so the model has learned that
  text starts after it). The BOS is not yielded. An empty prompt without ``eos_id`` is
  an error.
- Context: the model sees at most ``context_length`` tokens. A prompt longer than that
  keeps its last ``context_length`` tokens. When the cache is full and another token
  must be fed, the window slides: each row keeps its last ``window_keep`` tokens
  (default ``context_length // 2``), they are recomputed in one forward pass from
  position 0 into the cache, and decoding continues one position per token.
  ``window_keep=context_length`` gives exactly the logits of running the model on the
  last ``context_length`` tokens at every step (as a cache-free sampler does), at the
  price of a full forward pass per token once the context is full. In a batch the
  rows share one window: it slides when the longest row fills it (each row then keeps
  its own last ``window_keep`` tokens), so past the context a shorter row may be
  conditioned differently than it would be alone, unless ``window_keep=context_length``.
- ``use_cache=False`` recomputes the whole window (the last ``context_length`` tokens)
  for every token: the slow reference the cache is tested and benchmarked against.
- Streaming text: ``iter_text`` turns ids into text pieces at UTF-8 character
  boundaries (a character split across tokens waits for its last byte).
"""

from __future__ import annotations

import codecs
import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

from ferrolm.lm.device import resolve_device

__all__ = [
    "top_k_mask",
    "top_p_mask",
    "sampling_probs",
    "sample",
    "check_sampling_args",
    "Decoder",
    "generate",
    "iter_text",
    "resolve_device",
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
# Incremental decoding with a KV cache
# --------------------------------------------------------------------------------------


def _model_config(model: Any) -> tuple[int, int]:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "vocab_size") or not hasattr(cfg, "context_length"):
        raise ValueError("model must have a .config with vocab_size and context_length (a ferrolm TransformerLM)")
    return int(cfg.vocab_size), int(cfg.context_length)


class Decoder:
    """The next-token logits of a batch of sequences, kept current as tokens are appended.

    ``Decoder(model, prompts)`` runs the (left-padded) prompts through the model;
    ``logits`` is then (batch, vocab) for the next token of every row, and
    ``push(ids)`` appends one token per row and updates ``logits`` at the cost of one
    position (or, when the context is full, one window recomputation; see the module
    docstring). ``sequences()`` returns every row's tokens so far, prompt included.
    """

    def __init__(
        self,
        model: Any,
        prompts: Sequence[Sequence[int]],
        *,
        use_cache: bool = True,
        window_keep: Optional[int] = None,
    ):
        self.model = model
        self.vocab_size, self.context_length = _model_config(model)
        if window_keep is None:
            window_keep = max(1, self.context_length // 2)
        if (
            isinstance(window_keep, bool)
            or not isinstance(window_keep, int)
            or not (1 <= window_keep <= self.context_length)
        ):
            raise ValueError(
                f"window_keep must be an int in [1, context_length={self.context_length}], got {window_keep!r}"
            )
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError(
                "every prompt must hold at least one token (generate() turns an empty prompt into [eos_id])"
            )
        self.window_keep = window_keep
        self.use_cache = use_cache
        self.device = next(model.parameters()).device
        self.history = [list(p) for p in prompts]  # every token of every row
        self.batch_size = len(prompts)
        self.cache = model.make_kv_cache(self.batch_size, self.context_length) if use_cache else None
        # The rows' last context_length tokens at most.
        self.logits = self._run_window([row[-self.context_length :] for row in self.history])

    def sequences(self) -> list[list[int]]:
        return [list(row) for row in self.history]

    def _run_window(self, rows: list[list[int]]) -> Tensor:
        """Forward the left-padded ``rows`` from position 0 (filling the cache); the
        logits at each row's last token."""
        width = max(len(r) for r in rows)
        ids = torch.zeros(self.batch_size, width, dtype=torch.long)
        valid = torch.zeros(self.batch_size, width, dtype=torch.bool)
        for b, r in enumerate(rows):
            if r:
                ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
                valid[b, width - len(r) :] = True
        ids = ids.to(self.device)
        # None when nothing is padded: the model then takes its plain causal path.
        self.valid = None if bool(valid.all()) else valid.to(self.device)
        self.width = width
        if self.cache is not None:
            self.cache.reset()
            out = self.model(ids, kv_cache=self.cache, start_pos=0, attention_mask=self.valid)
        else:
            out = self.model(ids, attention_mask=self.valid)
        return out[:, -1].float()

    def push(self, next_ids: Union[Tensor, Sequence[int]]) -> Tensor:
        """Append one token per row; return (and store in ``logits``) the next logits."""
        next_ids = torch.as_tensor(next_ids, dtype=torch.long).reshape(-1)
        if next_ids.numel() != self.batch_size:
            raise ValueError(f"push needs {self.batch_size} ids (one per row), got {next_ids.numel()}")
        tokens = next_ids.tolist()
        for row, t in zip(self.history, tokens):
            row.append(t)
        if self.cache is None:
            self.logits = self._run_window([row[-self.context_length :] for row in self.history])
        elif self.width + 1 > self.context_length:
            # The cache is full: slide the window and recompute what it keeps.
            self.logits = self._run_window([row[-self.window_keep :] for row in self.history])
        else:
            start = self.width
            if self.valid is not None:
                self.valid = torch.cat(
                    [self.valid, torch.ones(self.batch_size, 1, dtype=torch.bool, device=self.device)], dim=1
                )
            step = next_ids.to(self.device).view(self.batch_size, 1)
            out = self.model(step, kv_cache=self.cache, start_pos=start, attention_mask=self.valid)
            self.width = start + 1
            self.logits = out[:, -1].float()
        return self.logits


# --------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------


def _as_prompts(prompt_ids: Any) -> tuple[list[list[int]], bool]:
    """(rows, batched) from a list of ints, a 1-D tensor/array, a list of lists, a 2-D tensor/array."""
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError("prompt_ids must be token ids; encode the text with the tokenizer first")
    if hasattr(prompt_ids, "tolist") and hasattr(prompt_ids, "ndim"):  # torch tensor or numpy array
        if prompt_ids.ndim not in (1, 2):
            raise ValueError(
                f"prompt_ids must be 1-D (one prompt) or 2-D (a batch), got shape {tuple(prompt_ids.shape)}"
            )
        batched = prompt_ids.ndim == 2
        prompt_ids = prompt_ids.tolist()
        return (prompt_ids if batched else [prompt_ids]), batched
    try:
        items = list(prompt_ids)
    except TypeError:
        raise ValueError(
            f"prompt_ids must be a sequence of ints or of sequences of ints, got {type(prompt_ids).__name__}"
        ) from None
    if items and all(hasattr(x, "__len__") and not isinstance(x, (str, bytes)) for x in items):
        return [x.tolist() if hasattr(x, "tolist") else list(x) for x in items], True
    return [items], False


def _check_ids(rows: list[list[Any]], vocab_size: int) -> list[list[int]]:
    out = []
    for b, row in enumerate(rows):
        ints = []
        for i, t in enumerate(row):
            try:
                if isinstance(t, bool):
                    raise TypeError
                t = operator.index(t)  # int, numpy integers, integer 0-d tensors
            except TypeError:
                raise ValueError(f"prompt ids must be ints; row {b} position {i} is {t!r}") from None
            if not (0 <= t < vocab_size):
                raise ValueError(
                    f"prompt id {t} (row {b}, position {i}) is out of range for the model's vocab_size {vocab_size}"
                )
            ints.append(t)
        out.append(ints)
    return out


def generate(
    model: Any,
    prompt_ids: Any,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    *,
    use_cache: bool = True,
    window_keep: Optional[int] = None,
) -> Iterator[Any]:
    """Sample up to ``max_new_tokens`` tokens after ``prompt_ids``, yielding them as produced.

    ``prompt_ids``: one prompt (a list of ints or a 1-D tensor) -> yields ints; or a
    batch (a list of lists, possibly of different lengths, or a 2-D tensor) -> yields,
    per step, a list with one id per row, ``None`` for rows that have already finished.
    A row finishes when it produces ``eos_id`` (the eos itself is yielded, then nothing
    more for that row); generation ends when every row has finished or after
    ``max_new_tokens`` steps. ``temperature``, ``top_k``, ``top_p``: see ``sample``;
    ``generator``: a seeded ``torch.Generator`` makes the draws reproducible.
    ``use_cache``/``window_keep``: see the module docstring.

    Arguments are checked when ``generate`` is called, before the first token.
    """
    check_sampling_args(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    vocab_size, _ = _model_config(model)
    if eos_id is not None and (
        isinstance(eos_id, bool) or not isinstance(eos_id, int) or not (0 <= eos_id < vocab_size)
    ):
        raise ValueError(f"eos_id must be an id in [0, {vocab_size}), got {eos_id!r}")
    rows, batched = _as_prompts(prompt_ids)
    rows = _check_ids(rows, vocab_size)
    if any(len(r) == 0 for r in rows):
        if eos_id is None:
            raise ValueError("an empty prompt starts from eos_id as beginning-of-sequence; pass eos_id")
        rows = [r if r else [eos_id] for r in rows]
    if window_keep is not None:  # checked here so the error is eager too
        _, ctx = _model_config(model)
        if isinstance(window_keep, bool) or not isinstance(window_keep, int) or not (1 <= window_keep <= ctx):
            raise ValueError(f"window_keep must be an int in [1, context_length={ctx}], got {window_keep!r}")
    return _generate(
        model, rows, batched, max_new_tokens, temperature, top_k, top_p, eos_id, generator, use_cache, window_keep
    )


# As a decorator (not a `with` around the yields), inference mode is on only while this
# generator runs, never in the caller's code between two tokens.
@torch.inference_mode()
def _generate(
    model, rows, batched, max_new_tokens, temperature, top_k, top_p, eos_id, generator, use_cache, window_keep
):
    if max_new_tokens == 0:
        return
    decoder = Decoder(model, rows, use_cache=use_cache, window_keep=window_keep)
    finished = [False] * len(rows)
    for step in range(max_new_tokens):
        next_ids = sample(decoder.logits, temperature, top_k, top_p, generator)
        ids = next_ids.tolist()
        out = [None if done else t for done, t in zip(finished, ids)]
        if eos_id is not None:
            finished = [done or t == eos_id for done, t in zip(finished, ids)]
        yield out if batched else out[0]
        if all(finished) or step == max_new_tokens - 1:
            return
        decoder.push(next_ids)


# --------------------------------------------------------------------------------------
# Text out: what the CLI needs
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

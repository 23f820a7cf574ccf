"""Continuous batching: many sequences decoded together, each joining and leaving between steps.

``Engine(model, token_bytes, eos_id)`` owns one KV cache of ``max_batch`` rows and a thread
that runs the loop:

    admit     each waiting sequence takes the next free row, to fill with its prompt
    prefill   the rows filling run their prompts through the model, each alone into its row,
              in order of admission and at most ``prefill_chunk`` tokens in all per turn
              (None: every prompt whole), so the running rows' steps go on between the
              chunks of a long prompt; a row filled samples its first token and decodes
    step      one forward pass feeds every running row its last token, each row at its own
              position (``TransformerLM.forward`` with per-row ``start_pos``), and each row
              samples its next token with its own settings and its own generator
    leave     rows that finished (end-of-text, a stop string, max_tokens) or were cancelled
              free their row at once; the last rows move down so the running ones stay
              in rows [0, n) and a step computes only them

Sequences come in groups (``submit(..., group=g)``; the server makes one group of each
request). A free row goes to the waiting group that runs the fewest rows (the earliest
to arrive among equals), so a request of many sequences cannot keep the others out: while
another group waits with fewer than its fair share of rows (``max_batch`` // the groups
present, at least 1), the group running the most rows above that share is parked one row
per step: its sequence goes back to the front of its group's queue, keeping its tokens,
and when a row is free again its row is recomputed from them (as a sliding window is).
A sequence whose group already holds its prompt in a row (the other choices of one request)
is not prefilled: it copies that row's prompt positions and samples its first token from the
same logits with its own generator, when the row is filled (or at once, while the row still
starts with the prompt). A sequence that asks for its prompt's log-probabilities prefills its
own. ``max_queue`` bounds the groups that wait with no row (beyond those the free rows take at
once): one more is refused (``QueueFull``).

This is the one decoding loop: ``ferrolm serve`` runs it on the engine's thread
(``start``); ``generate``, ``ferrolm generate``, the evaluation harness and the demo run it
in the calling thread (``turns`` / ``run_until_done``), with no thread of its own.

A sequence's tokens do not depend on the batch: its prompt runs alone into its row (a
prefill; in chunks, logits equal to a whole prefill's up to rounding), and it draws with
``sample`` on its own (1, vocab) logits from its own ``torch.Generator`` (seeded with its
seed, or the one given to ``submit``). The batch changes
only the matrix shapes of a step, which may round the logits differently in the last bit,
never the rules. A prompt longer than the context keeps its last context_length tokens;
when a row's context is full it slides its own window: it keeps its last ``window_keep``
tokens (default context_length // 2) and recomputes them into its row. ``window_keep =
context_length`` gives, at every step, the logits of the model run on the last
context_length tokens, at the price of a full forward pass per token once the context is
full.

Text (``ferrolm.lm.decoding.SequenceText``, one per sequence): end-of-text (and any of the
sequence's ``end_ids``, such as a chat reply's end token) ends the sequence and is not shown, ids are turned into text at UTF-8 character boundaries, and the
text is cut before the first stop string, which ends the sequence too.

Events go to each sequence's ``on_event`` callable, called on the thread that runs the loop:
``Piece(text)`` for new text, then one ``Finished(reason, completion_tokens)`` with reason
"stop" (end-of-text or a stop string) or "length" (max_tokens), or ``Failed(message)``.
A cancelled sequence gets no further events.

Log-probabilities are computed only for a sequence that asks (``SamplingParams.logprobs``,
``prompt_logprobs``): the others' steps do no extra work. They are those of the model's own
distribution, log_softmax of its logits, whatever the temperature, top-k or top-p the
token was drawn with (what vLLM reports by default): ``Piece.logprobs`` holds a
``TokenLogprob`` for each token sampled since the last piece (a token whose text is held
back, a character's first bytes or a possible start of a stop string, comes with the piece
that shows it or with the last piece; the end-of-text token that ends a sequence is not
shown and has none), and a ``PromptLogprobs`` event, before any piece, holds those of the
prompt's tokens after its first. ``max_tokens=0`` runs the prompt only.

On a CPU, let the engine's thread be the only one that runs torch work: under OpenMP each
such thread keeps its own team of worker threads, and once the teams hold more threads
than there are cores, libgomp puts idle workers to sleep instead of spinning, so every
parallel region of a step pays for waking them (``ferrolm serve`` loads the model on a
thread that ends before the engine starts).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ferrolm.lm.decoding import SequenceText, check_sampling_args, sample

__all__ = [
    "SamplingParams",
    "TokenLogprob",
    "Piece",
    "PromptLogprobs",
    "Finished",
    "Failed",
    "Handle",
    "Engine",
    "QueueFull",
]


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled; ``seed`` None draws a fresh one. ``logprobs``: None, or
    the log-probability of each sampled token with the ``logprobs`` most likely tokens beside
    it; ``prompt_logprobs`` the same for the prompt's tokens. ``max_tokens`` 0: the prompt only."""

    max_tokens: int
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    end_ids: tuple[int, ...] = ()  # ids that end the sequence as end-of-text does (a chat's <|end|>)

    def __post_init__(self) -> None:
        check_sampling_args(self.temperature, self.top_k, self.top_p)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {k!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.end_ids):
            raise ValueError(f"end_ids must be token ids (ints), got {self.end_ids!r}")


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the most likely tokens at its place
    (``top``: (id, log-probability) pairs, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Piece:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens sampled since the last piece, when asked


@dataclass(frozen=True)
class PromptLogprobs:
    logprobs: tuple[TokenLogprob, ...]  # the prompt's tokens after its first (which has none)


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" or "length"
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


def check_window_keep(window_keep: Any, context_length: int) -> int:
    """``window_keep``, or its default context_length // 2; ValueError naming the range when bad."""
    if window_keep is None:
        return max(1, context_length // 2)
    if isinstance(window_keep, bool) or not isinstance(window_keep, int) or not 1 <= window_keep <= context_length:
        raise ValueError(f"window_keep must be an int in [1, context_length={context_length}], got {window_keep!r}")
    return window_keep


def _no_text(token: int) -> bytes:
    return b""


def _token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> tuple[TokenLogprob, ...]:
    """For each row of ``logits`` (n, vocab): the log-probability of ``tokens[i]`` and the
    ``k`` most likely tokens, in one pass over the rows."""
    if not tokens:
        return ()
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(tokens, device=lp.device).view(-1, 1))[:, 0].tolist()
    if k:
        values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(picked)
    return tuple(TokenLogprob(t, p, top) for t, p, top in zip(tokens, picked, tops))


class QueueFull(RuntimeError):
    """``Engine.submit`` refused a new group: ``max_queue`` groups already wait for a row."""


class Handle:
    """One submitted sequence; ``Engine.cancel(handle)`` stops it and frees its row."""

    def __init__(
        self, prompt: list[int], params: SamplingParams, on_event: Callable[[Any], None], engine, group, generator=None
    ):
        self.prompt = prompt
        self.group = self if group is None else group
        self.params = params
        self.on_event = on_event
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = generator if generator is not None else torch.Generator(engine.device).manual_seed(self.seed)
        self.history = list(prompt)  # prompt and sampled tokens: what a sliding window keeps
        self.tokens: list[int] = []  # every sampled token, the last one (eos, say) included
        self.length = 0  # positions filled in its cache row
        self.next_token = -1  # sampled, not yet fed
        self.generated = 0
        self.text = SequenceText(engine.token_bytes, engine.eos_id, params.stop, params.end_ids)
        self.cancelled = False  # set by any thread; read by the engine between steps
        self.done = False
        self.parked = False  # taken out of its row for another group; resumes from its tokens
        self.logprobs: list[TokenLogprob] = []  # sampled, not yet sent with a piece
        self.fill: list[int] = []  # what its row must hold before it decodes (prompt, or tokens to resume)
        self.resume = False  # filling its row back after being parked: no token to sample at the end
        self.prompt_lp: list[TokenLogprob] = []  # the prompt's, gathered chunk by chunk when asked
        self.followers: list[Handle] = []  # group-mates with its prompt: its row copied to theirs when filled
        # The logits after its prompt, kept while its row still starts with the prompt (a group-mate
        # admitted later copies both instead of prefilling the same tokens again).
        self.first_logits: Optional[torch.Tensor] = None

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        if not self.logprobs:  # the common case, not asked: nothing built
            return ()
        out, self.logprobs = tuple(self.logprobs), []
        return out


class Engine:
    """Decode many sequences as one batch; see the module docstring.

    ``token_bytes(id)`` gives a token's bytes (ids the tokenizer lacks may map to U+FFFD;
    None: no text, only tokens); ``eos_id`` ends a sequence (None: only max_tokens and stop
    strings do). ``use_cache=False`` recomputes each row's last context_length tokens for
    every token: the slow reference the cache is tested against. ``prefill_chunk``: at most
    this many prompt tokens are prefilled per turn, between decode steps (None: each prompt
    whole, at once).
    """

    def __init__(
        self,
        model: Any,
        token_bytes: Optional[Callable[[int], bytes]],
        eos_id: Optional[int],
        *,
        max_batch: int = 16,
        window_keep: Optional[int] = None,
        max_queue: Optional[int] = None,
        use_cache: bool = True,
        prefill_chunk: Optional[int] = None,
    ):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0):
            raise ValueError(f"max_queue must be an int >= 0 or None, got {max_queue!r}")
        if prefill_chunk is not None and (
            isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1
        ):
            raise ValueError(f"prefill_chunk must be an int >= 1 or None, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.context_length = int(model.config.context_length)
        self.window_keep = check_window_keep(window_keep, self.context_length)
        self.use_cache = use_cache
        self.token_bytes = token_bytes if token_bytes is not None else _no_text
        self.eos_id = eos_id
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.device = next(model.parameters()).device
        self.cache = model.make_kv_cache(max_batch, self.context_length)
        self._rows: list[Handle] = []  # decoding, row i of the cache is self._rows[i]
        self._filling: list[Handle] = []  # prefilling, in order, in the rows after the decoding ones
        # Per group, in order of arrival: its waiting sequences, and the rows it runs.
        self._waiting: dict[Any, deque[Handle]] = {}
        self._running: dict[Any, int] = {}
        self._arrival: dict[Any, int] = {}
        self._arrivals = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread: Optional[threading.Thread] = None

    # ---------------------------------------------------------------- outside the loop ---

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ferrolm-engine", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: Optional[float] = None, *, cancel: bool = False) -> None:
        """Finish every submitted sequence (``cancel``: drop them all, with no more events),
        then stop the thread; ``timeout`` bounds the wait for it."""
        with self._cond:
            self._closing = True
            if cancel:
                for h in [*self._held_handles(), *(h for q in self._waiting.values() for h in q)]:
                    h.cancelled = True
                self._waiting.clear()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        on_event: Callable[[Any], None],
        *,
        group: Any = None,
        generator: Optional[torch.Generator] = None,
    ) -> Handle:
        """Queue a sequence; events arrive through ``on_event`` on the engine's thread.
        ``group``: a hashable naming the sequences that share rows fairly with the other
        groups (default: the sequence alone). ``generator``: draw from this one instead of
        one seeded with ``params.seed``. QueueFull: the group is new and ``max_queue``
        groups already wait with no row."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("a prompt must hold at least one token (start a new document with the eos id)")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary [0, {self.vocab_size})")
        handle = Handle(prompt, params, on_event, self, group, generator)
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is shutting down")
            g = handle.group
            if g not in self._arrival:
                # Groups with no row beyond those the free rows take now.
                queued = sum(1 for w in self._waiting if not self._running.get(w))
                free = max(0, self.max_batch - self._held())
                if self.max_queue is not None and queued >= self.max_queue + free:
                    raise QueueFull(
                        f"{queued} requests already wait for a batch row (the queue holds {self.max_queue})"
                    )
                self._arrival[g], self._arrivals = self._arrivals, self._arrivals + 1
            self._queue(handle)
            self._cond.notify()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Stop a sequence: it leaves the batch before the next step (no more events)."""
        handle.cancelled = True
        with self._cond:
            queue = self._waiting.get(handle.group)
            if queue is not None and handle in queue:
                queue.remove(handle)
                self._forget_if_idle(handle.group)
            self._cond.notify()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences; running counts those prefilling too."""
        return self._held(), sum(len(q) for q in self._waiting.values())

    def _held_handles(self) -> list[Handle]:
        """Every sequence given a row: decoding, prefilling, or waiting on a group-mate's prefill."""
        return [*self._rows, *self._filling, *(f for h in self._filling for f in h.followers)]

    def _held(self) -> int:
        return len(self._held_handles())

    # ---------------------------------------------------------------- groups (under the lock) ---

    def _queue(self, handle: Handle, *, front: bool = False) -> None:
        queue = self._waiting.setdefault(handle.group, deque())
        queue.appendleft(handle) if front else queue.append(handle)

    def _forget_if_idle(self, g: Any) -> None:
        if not self._waiting.get(g, True):
            del self._waiting[g]
        if g not in self._waiting and not self._running.get(g):
            self._running.pop(g, None)
            self._arrival.pop(g, None)

    def _next_group(self) -> Any:
        """The waiting group a free row goes to: the fewest rows running, then the earliest."""
        return min(self._waiting, key=lambda g: (self._running.get(g, 0), self._arrival[g]))

    def _pick(self) -> list[Handle]:
        """Take waiting sequences for the free rows; park a row for a group below its share."""
        picked = []
        while self._waiting:
            if self._held() + len(picked) >= self.max_batch and not self._park_one(len(picked)):
                break
            g = self._next_group()
            queue = self._waiting[g]
            handle = queue.popleft()
            self._running[g] = self._running.get(g, 0) + 1
            self._forget_if_idle(g)
            picked.append(handle)
        return picked

    def _park_one(self, picked: int) -> bool:
        """With no free row: take one from the group furthest above its fair share, if the next
        waiting group is below it. Not twice in one turn: a group gives up a row a step."""
        if picked:
            return False
        groups = self._running.keys() | self._waiting.keys()
        share = max(1, self.max_batch // len(groups))
        if self._running.get(self._next_group(), 0) >= share:
            return False
        busiest = max(self._running, key=lambda g: (self._running[g], self._arrival[g]))
        if self._running[busiest] <= share:
            return False
        victim = next((h for h in reversed(self._rows) if h.group == busiest and not (h.done or h.cancelled)), None)
        if victim is None:  # its rows end at the next step anyway
            return False
        victim.parked = True
        victim.first_logits = None  # its row is given up
        self._running[busiest] -= 1
        self._queue(victim, front=True)
        return True

    # ---------------------------------------------------------------- the loop ---

    def turns(self) -> Iterator[None]:
        """Run the loop in the calling thread instead of the engine's own: each ``next`` runs
        one turn (admit, step, leave; the events of that turn delivered), and the iterator
        ends when no sequence is left. Not with ``start``."""
        if self._thread is not None:
            raise RuntimeError("the engine runs on its own thread (start() was called)")
        while True:
            with self._cond:
                if not self._waiting and not self._busy():
                    return
                admitted = self._pick()
            with torch.inference_mode():
                self._turn(admitted)
            yield

    def run_until_done(self) -> None:
        """Decode every submitted sequence to its end in the calling thread."""
        for _ in self.turns():
            pass

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._closing and not self._waiting and not self._busy():
                        self._cond.wait()
                    if self._closing and not self._waiting and not self._busy():
                        return
                    admitted = self._pick()
                self._turn(admitted)

    def _busy(self) -> bool:
        return bool(self._rows or self._filling)

    def _turn(self, admitted: list[Handle]) -> None:
        try:
            self._leave()
            for handle in admitted:
                self._admit(handle)
            self._fill()
            self._leave()
            if self._rows:
                self._step()
                self._leave()
        except Exception as e:  # noqa: BLE001 -- a failed step fails its sequences, not the server
            self._rows = list({id(h): h for h in self._held_handles() + admitted}.values())
            self._filling = []
            for handle in self._rows:
                handle.followers = []
                if handle.parked:  # queued again: it resumes later
                    continue
                if not handle.done:
                    handle.done = True
                    with contextlib.suppress(Exception):  # a failing callback must not end the loop
                        handle.on_event(Failed(f"generation failed: {e}"))
            self._leave()

    def _run(self, slot: int, tokens: list[int], start: int = 0, *, head: bool = True) -> torch.Tensor:
        """Run ``tokens`` from position ``start`` into cache row ``slot``: their logits (seq, vocab)
        (``head`` False: not computed, when only the cache is wanted)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        return self.model(ids, kv_cache=self.cache.rows(slot, slot + 1), start_pos=start, head=head)[0]

    def _admit(self, handle: Handle) -> None:
        """Give ``handle`` a row to fill: after the rows filling already, or a group-mate's with its prompt."""
        if handle.length:  # parked before: its row back as it was (the token to feed not in it)
            handle.fill, handle.resume = handle.history[-handle.length - 1 : -1], True
            handle.length = 0
        else:
            handle.fill = handle.history[-self.context_length :]
            donor = self._donor(handle)
            if donor is not None and donor.first_logits is None:  # still filling: it copies when done
                return donor.followers.append(handle)
            if donor is not None:
                return self._share(donor, [handle])
        self._filling.append(handle)

    def _donor(self, h: Handle) -> Optional[Handle]:
        """A sequence of ``h``'s group whose row holds, or is filling, the prompt of ``h``: the
        choices of one request share a prefill. Not when ``h`` wants its prompt's log-probabilities."""
        if h.params.prompt_logprobs is not None:
            return None
        for d in self._filling:
            if d.group is h.group and not d.resume and d.fill == h.fill:
                return d
        for d in self._rows:
            if d.group is h.group and d.first_logits is not None and d.fill == h.fill and not d.cancelled:
                return d
        return None

    def _fill(self) -> None:
        """Prefill the rows filling, in order, up to ``prefill_chunk`` tokens in all; a row
        filled (and its followers) joins the decoding rows and samples its first token."""
        budget = self.prefill_chunk
        while self._filling and budget != 0:
            h = self._filling[0]
            end = len(h.fill) if budget is None else min(len(h.fill), h.length + budget)
            k = None if h.resume else h.params.prompt_logprobs
            # Only the last chunk of a prompt needs logits, unless for the prompt's log-probabilities.
            logits = (end == len(h.fill) and not h.resume) or k is not None
            out = self._run(len(self._rows), h.fill[h.length : end], h.length, head=logits)
            if k is not None:  # position i predicts the prompt's token i + 1
                targets = h.fill[h.length + 1 : end + 1]
                h.prompt_lp.extend(_token_logprobs(out[: len(targets)], targets, k))
            budget = None if budget is None else budget - (end - h.length)
            h.length = end
            if end == len(h.fill):
                self._filled(h, out[-1:].float() if logits else None)

    def _filled(self, h: Handle, logits: Optional[torch.Tensor]) -> None:
        """``h``, first of the rows filling, has its row filled: it decodes from now on."""
        self._filling.pop(0)
        self._rows.append(h)  # its row is the first after the decoding ones: it stays
        if h.resume:
            h.resume = False
            return
        h.first_logits = logits
        if h.params.prompt_logprobs is not None and not h.cancelled:
            h.on_event(PromptLogprobs(tuple(h.prompt_lp)))
            h.prompt_lp = []
        followers, h.followers = h.followers, []
        self._first(h, logits)
        if followers:
            self._share(h, followers)

    def _share(self, donor: Handle, handles: list[Handle]) -> None:
        """Give ``handles`` rows that copy the prompt in ``donor``'s, and their first tokens."""
        n = len(handles)
        slot = self._open_rows(n)
        src, length = self._rows.index(donor), len(donor.fill)
        self.cache.copy_prefix(src, slice(slot, slot + n), length)
        for h in handles:
            self._rows.append(h)
            h.length, h.first_logits = length, donor.first_logits
            self._first(h, donor.first_logits)

    def _open_rows(self, n: int) -> int:
        """Move the rows filling ``n`` rows up; the first of the ``n`` rows freed before them."""
        start = len(self._rows)
        for i in reversed(range(len(self._filling))):
            self._move(start + i, start + i + n, self._filling[i].length)
        return start

    def _move(self, old: int, new: int, length: int) -> None:
        self.cache.copy_prefix(old, new, length)

    def _first(self, h: Handle, logits: torch.Tensor) -> None:
        """The first token after the prompt (``max_tokens`` 0: the prompt was all it asked for)."""
        h.length = len(h.fill)
        if h.params.max_tokens == 0:
            return self._finish(h, "length")
        self._take(h, logits)

    def _step(self) -> None:
        rows, ctx = self._rows, self.context_length
        positions = []
        slid: dict[int, torch.Tensor] = {}
        for slot, h in enumerate(rows):
            if not self.use_cache or h.length + 1 > ctx:
                # The row's context is full (or no cache is kept): keep its last window_keep
                # tokens (context_length without a cache), the one to feed among them, and
                # recompute them into its row. Its slot in the step below is a placeholder,
                # written over before it is read (a full row is recomputed again next step).
                keep = h.history[-(self.window_keep if self.use_cache else ctx) :]
                slid[id(h)] = self._run(slot, keep)[-1:].float()
                h.length, h.first_logits = len(keep), None  # its row no longer starts with its prompt
                positions.append(min(h.length, ctx - 1))
            else:
                positions.append(h.length)
        logits = None
        if len(slid) < len(rows):
            feed = torch.tensor([[h.next_token] for h in rows], dtype=torch.long, device=self.device)
            # Rows all at one length (one stream, say) take the plain path with no tensor of positions.
            at = positions[0] if len(set(positions)) == 1 else torch.tensor(positions, device=self.device)
            logits = self.model(feed, kv_cache=self.cache.rows(0, len(rows)), start_pos=at)[:, -1].float()
        for slot, h in enumerate(rows):
            if id(h) in slid:
                self._take(h, slid[id(h)])
            else:
                h.length += 1
                self._take(h, logits[slot : slot + 1])

    def _take(self, h: Handle, logits: torch.Tensor) -> None:
        """Sample ``h``'s next token from ``logits`` (1, vocab) and emit what it adds."""
        if h.cancelled:
            return
        p = h.params
        try:
            token = int(sample(logits, p.temperature, p.top_k, p.top_p, h.generator)[0])
        except ValueError as e:
            h.done = True
            h.on_event(Failed(str(e)))
            return
        h.generated += 1
        h.tokens.append(token)
        if p.logprobs is not None and token != self.eos_id:
            h.logprobs.extend(_token_logprobs(logits, [token], p.logprobs))
        text = h.text.feed(token)
        if text:
            h.on_event(Piece(text, h.take_logprobs()))
        if h.text.done:
            return self._finish(h, "stop")
        if h.generated >= p.max_tokens:
            return self._finish(h, "length")
        h.next_token = token
        h.history.append(token)

    def _finish(self, h: Handle, reason: str) -> None:
        tail = h.text.finish()
        if tail or h.logprobs:
            h.on_event(Piece(tail, h.take_logprobs()))
        h.done = True
        h.on_event(Finished(reason, h.generated))

    def _leave(self) -> None:
        """Drop finished, cancelled and parked rows; move the rest down to rows [0, n) in order,
        the decoding ones first. A cancelled sequence filling a row for followers leaves the row
        (what it filled) to the first of them."""
        gone = []  # each flag read once: another thread may cancel meanwhile
        for i, h in enumerate(self._filling):
            cancelled = [f.cancelled for f in h.followers]
            gone += [f for f, c in zip(h.followers, cancelled) if c]
            h.followers = [f for f, c in zip(h.followers, cancelled) if not c]
            if h.cancelled and h.followers:
                heir, self._filling[i] = h.followers[0], h.followers[0]
                heir.length, heir.followers, h.followers = h.length, h.followers[1:], []
                gone.append(h)
        held = self._rows + self._filling
        # A row filling for followers leaves only through its heir (above), never with them.
        gone += [h for h in held if (h.done or h.cancelled or h.parked) and not h.followers]
        if not gone:
            return
        left = {id(h) for h in gone}
        self._rows = [h for h in self._rows if id(h) not in left]
        self._filling = [h for h in self._filling if id(h) not in left]
        with self._cond:
            for h in gone:
                if h.parked:
                    h.parked = False  # waits again, in its group's queue since _park_one
                else:
                    self._running[h.group] -= 1
                    self._forget_if_idle(h.group)
        old_slot = {id(h): i for i, h in enumerate(held)}
        for new, h in enumerate(self._rows + self._filling):
            old = old_slot[id(h)]
            if old != new:  # new < old, and row new is free or already moved out
                self._move(old, new, h.length)

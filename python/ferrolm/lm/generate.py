"""Sampling from a TransformerLM, for library users: ``generate`` yields the tokens,
``generate_text`` returns (or streams) the text.

Both run the inference engine (``ferrolm.lm.engine.Engine``) in the calling thread, the
one decoding loop that ``ferrolm generate``, the server, the evaluation harness and the demo
drive too. Sampling (temperature, top-k, top-p, their exact tie rules) and the text step
(end-of-text, UTF-8 boundaries, stop strings) are defined in ``ferrolm.lm.decoding`` and
re-exported here. Details:

- Each prompt is its own row: its own positions and cache row, and its own window past the
  context (see the engine), so a row of a batch gets the tokens it would get alone.
- Random draws: one prompt draws from ``generator`` itself (one uniform number per token);
  in a batch, row b draws from a generator seeded with the b-th of the seeds first drawn
  from ``generator`` (one per row), so a batch is reproducible and each row equals its
  prompt alone with that row's generator. Greedy decoding (temperature 0) draws nothing.
- Empty prompt: generation starts from ``eos_id`` used as a beginning-of-sequence token
  (documents are separated by eos in ferrolm's shards, so the model has learned that
  text starts after it). The BOS is not yielded. An empty prompt without ``eos_id`` is
  an error.
- ``use_cache=False`` recomputes the whole window (the last ``context_length`` tokens)
  for every token: the slow reference the cache is tested and benchmarked against.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch

from ferrolm.lm.config import SEED_LIMIT
from ferrolm.lm.decoding import (
    StopText,
    check_sampling_args,
    iter_text,
    sample,
    sampling_probs,
    top_k_mask,
    top_p_mask,
)
from ferrolm.lm.device import resolve_device
from ferrolm.lm.engine import Engine, Failed, Piece, SamplingParams, check_window_keep

__all__ = [
    "top_k_mask",
    "top_p_mask",
    "sampling_probs",
    "sample",
    "check_sampling_args",
    "generate",
    "generate_text",
    "iter_text",
    "StopText",
    "resolve_device",
]


def _model_config(model: Any) -> tuple[int, int]:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "vocab_size") or not hasattr(cfg, "context_length"):
        raise ValueError("model must have a .config with vocab_size and context_length (a ferrolm TransformerLM)")
    return int(cfg.vocab_size), int(cfg.context_length)


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


def _prompt_rows(model: Any, prompt_ids: Any, eos_id: Optional[int]) -> tuple[list[list[int]], bool]:
    """(rows of checked ids, batched); an empty prompt becomes [eos_id]."""
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
    return rows, batched


def _check_max_new(max_new_tokens: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")


def _row_generators(model: Any, n: int, temperature: float, generator: Optional[torch.Generator], batched: bool):
    """Each row's generator: ``generator`` itself for one prompt; in a batch (or with no
    ``generator``), one seeded with the row's seed drawn from ``generator`` (None: from
    torch's default generator, so ``torch.manual_seed`` reproduces the draws). None where
    nothing is drawn (greedy): the engine's own then goes unused."""
    if temperature == 0 or (generator is not None and not batched):
        return [generator] * n
    at = generator.device if generator is not None else "cpu"
    seeds = torch.randint(0, SEED_LIMIT - 1, (n,), generator=generator, device=at).tolist()
    device = generator.device if generator is not None else next(model.parameters()).device
    return [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]


def _submit_rows(
    model: Any,
    rows: list[list[int]],
    params: SamplingParams,
    generators: list,
    *,
    token_bytes: Optional[Callable[[int], bytes]] = None,
    eos_id: Optional[int] = None,
    on_piece: Optional[Callable[[int, str], None]] = None,
    use_cache: bool = True,
    window_keep: Optional[int] = None,
) -> tuple[Iterator[None], list]:
    """An engine with one row per prompt, each submitted, and its turns (see ``_turns``);
    ``on_piece(row, text)`` gets the text as it comes."""
    engine = Engine(model, token_bytes, eos_id, max_batch=len(rows), window_keep=window_keep, use_cache=use_cache)

    failures: list[Exception] = []

    def events(r: int) -> Callable[[Any], None]:
        def on_event(event: Any) -> None:
            if isinstance(event, Failed):
                failures.append(ValueError(event.message))
            elif isinstance(event, Piece) and on_piece is not None:
                try:
                    on_piece(r, event.text)
                except Exception as e:  # noqa: BLE001 -- the caller's own error (a closed pipe, say), raised as is
                    failures.append(e)

        return on_event

    handles = [engine.submit(row, params, events(r), generator=g) for r, (row, g) in enumerate(zip(rows, generators))]
    return _turns(engine, failures), handles


def _turns(engine: Engine, failures: list[Exception]) -> Iterator[None]:
    """The engine's turns in this thread; a sequence that failed (NaN logits, say) raises
    ValueError, and an error of ``on_piece`` is raised as it was."""
    for _ in engine.turns():
        if failures:
            raise failures[0]
        yield


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
    ``generator``: a seeded ``torch.Generator`` makes the draws reproducible (see the
    module docstring for a batch). ``use_cache``/``window_keep``: see the module docstring
    and ``ferrolm.lm.engine``.

    Arguments are checked when ``generate`` is called, before the first token.
    """
    check_sampling_args(temperature, top_k, top_p)
    _check_max_new(max_new_tokens)
    rows, batched = _prompt_rows(model, prompt_ids, eos_id)
    check_window_keep(window_keep, _model_config(model)[1])
    if max_new_tokens == 0:
        return iter(())
    params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed=0)  # each row's generator is given
    generators = _row_generators(model, len(rows), temperature, generator, batched)
    turns, handles = _submit_rows(
        model, rows, params, generators, eos_id=eos_id, use_cache=use_cache, window_keep=window_keep
    )
    return _generate(turns, handles, batched)


def _generate(turns: Iterator[None], handles: list, batched: bool) -> Iterator[Any]:
    # Every row is admitted in the first turn (the engine has a row for each) and each turn
    # samples the next token of every running row, so the rows' token counts stay aligned.
    # Inference mode is on only inside the turns, never in the caller's code between tokens.
    yielded = 0
    for _ in turns:
        for step in range(yielded, max(len(h.tokens) for h in handles)):
            out = [h.tokens[step] if step < len(h.tokens) else None for h in handles]
            yield out if batched else out[0]
            yielded = step + 1


def generate_text(
    model: Any,
    prompt_ids: Any,
    token_bytes: Callable[[int], bytes],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    *,
    stop: Sequence[str] = (),
    end_ids: Sequence[int] = (),
    on_piece: Optional[Callable[[int, str], None]] = None,
) -> list[str]:
    """The text each prompt continues with: as ``generate`` samples it, with end-of-text not
    shown and the text cut before the first of the ``stop`` strings (which ends that row).
    ``end_ids``: more ids that end a row as ``eos_id`` does, not shown (a chat's end token).
    One text per row, also for a single prompt; ``on_piece(row, text)`` is called with each
    row's text as it is produced. ``token_bytes(id)``: a token's bytes."""
    check_sampling_args(temperature, top_k, top_p)
    _check_max_new(max_new_tokens)
    rows, batched = _prompt_rows(model, prompt_ids, eos_id)
    if max_new_tokens == 0:
        return [""] * len(rows)
    texts = [[] for _ in rows]

    def collect(r: int, piece: str) -> None:
        texts[r].append(piece)
        if on_piece is not None:
            on_piece(r, piece)

    params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed=0, stop=tuple(stop), end_ids=tuple(end_ids))
    generators = _row_generators(model, len(rows), temperature, generator, batched)
    turns, _ = _submit_rows(model, rows, params, generators, token_bytes=token_bytes, eos_id=eos_id, on_piece=collect)
    for _ in turns:
        pass
    return ["".join(t) for t in texts]

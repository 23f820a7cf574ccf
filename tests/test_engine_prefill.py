"""The engine's prefill: the choices of a request share one prefill of their prompt, a prompt
is prefilled in chunks between the running rows' steps, and requests waiting for a row are
admitted in order. Each sequence samples what it samples alone."""

from __future__ import annotations

import pytest
import torch

from ferrolm.lm.engine import Engine, Finished, Piece, PromptLogprobs, SamplingParams
from ferrolm.lm.generate import generate
from ferrolm.lm.model import TransformerLM

CTX = 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TransformerLM(64, CTX, d_model=32, num_layers=2, num_heads=4, d_ff=64).eval()


def _prefilled(model) -> list[int]:
    """Counts the prompt tokens the model runs (calls of more than one token per row), in a list."""
    counted = [0]

    def hook(module, args, kwargs):
        if args[0].shape[1] > 1:
            counted[0] += args[0].shape[1]

    model._count_hook = model.register_forward_pre_hook(hook, with_kwargs=True)
    return counted


def _alone(model, prompt, n, seed, **kw) -> list[int]:
    return list(generate(model, prompt, n, generator=torch.Generator().manual_seed(seed), **kw))


def _submit(engine, prompt, n, seed, group, **kw) -> list:
    events: list = []
    engine.submit(prompt, SamplingParams(max_tokens=n, seed=seed, **kw), events.append, group=group)
    return events


def _tokens(events: list) -> list[int]:
    return [lp.token for e in events if isinstance(e, Piece) for lp in e.logprobs]


PROMPT = [(7 * i) % 60 + 1 for i in range(30)]


@pytest.mark.parametrize("chunk", [None, 7])
def test_the_choices_of_a_request_share_one_prefill_and_each_samples_what_it_samples_alone(model, chunk):
    counted = _prefilled(model)
    try:
        engine = Engine(model, None, None, max_batch=8, prefill_chunk=chunk)
        choices = [_submit(engine, PROMPT, 9, seed, "req", temperature=0.9, logprobs=0) for seed in range(5)]
        other = _submit(engine, PROMPT[:12], 20, 9, "other", temperature=0.9, logprobs=0)  # its own prefill
        engine.run_until_done()
    finally:
        model._count_hook.remove()
    assert counted[0] == len(PROMPT) + 12  # 30 + 9 tokens fit the context: no window slides
    for seed, events in enumerate(choices):
        assert _tokens(events) == _alone(model, PROMPT, 9, seed, temperature=0.9)
        assert events[-1] == Finished("length", 9)
    assert _tokens(other) == _alone(model, PROMPT[:12], 20, 9, temperature=0.9)


def test_a_choice_admitted_after_its_group_mates_prefill_copies_their_row(model):
    counted = _prefilled(model)
    try:
        engine = Engine(model, None, None, max_batch=4)
        first = _submit(engine, PROMPT, 9, 0, "req", temperature=0.0, logprobs=0)
        turns = engine.turns()
        next(turns)  # the first choice prefilled and decoding when the others come
        later = [_submit(engine, PROMPT, 9, seed, "req", temperature=0.0, logprobs=0) for seed in (1, 2)]
        for _ in turns:
            pass
    finally:
        model._count_hook.remove()
    assert counted[0] == len(PROMPT)
    slow = list(generate(model, PROMPT, 9, temperature=0, use_cache=False))
    assert _tokens(first) == _tokens(later[0]) == _tokens(later[1]) == slow


def test_a_cancelled_choice_leaves_its_half_filled_row_to_its_group_mates(model):
    counted = _prefilled(model)
    try:
        engine = Engine(model, None, None, max_batch=4, prefill_chunk=8)
        handles, events = [], []
        for seed in range(3):
            events.append([])
            handles.append(
                engine.submit(PROMPT, SamplingParams(max_tokens=9, seed=seed, logprobs=0), events[-1].append, group=1)
            )
        turns = engine.turns()
        next(turns)  # 8 of the prompt's 30 tokens in the first choice's row
        engine.cancel(handles[0])
        for _ in turns:
            pass
    finally:
        model._count_hook.remove()
    assert counted[0] == len(PROMPT) and events[0] == []
    for seed in (1, 2):
        assert _tokens(events[seed]) == _alone(model, PROMPT, 9, seed)
    assert engine.counts() == (0, 0)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_gives_the_logits_and_tokens_of_a_whole_prefill(model, chunk):
    runs = {}
    for c in (None, chunk):
        engine = Engine(model, None, None, max_batch=3, prefill_chunk=c)
        runs[c] = [
            _submit(engine, p, 15, 5, i, temperature=0.8, logprobs=3, prompt_logprobs=2)
            for i, p in enumerate((PROMPT, PROMPT + PROMPT[:20], [3]))  # the second longer than the context
        ]
        engine.run_until_done()
    for whole, chunked in zip(runs[None], runs[chunk]):
        assert isinstance(chunked[0], PromptLogprobs) and isinstance(whole[0], PromptLogprobs)
        a, b = whole[0].logprobs, chunked[0].logprobs
        assert [e.token for e in a] == [e.token for e in b]
        assert [e.logprob for e in b] == pytest.approx([e.logprob for e in a], abs=1e-4)
        assert [[t for t, _ in e.top] for e in b] == [[t for t, _ in e.top] for e in a]
        assert _tokens(chunked) == _tokens(whole) and chunked[-1] == whole[-1] == Finished("length", 15)
    assert [len(e[0].logprobs) for e in runs[chunk]] == [len(PROMPT) - 1, CTX - 1, 0]


def test_running_rows_decode_a_token_every_turn_while_a_long_prompt_prefills_in_chunks(model):
    engine = Engine(model, None, None, max_batch=4, prefill_chunk=8)
    running = [engine.submit([1 + i, 2], SamplingParams(max_tokens=30, seed=i), lambda e: None) for i in range(2)]
    turns = engine.turns()
    next(turns)
    new = engine.submit(PROMPT, SamplingParams(max_tokens=5, seed=3), lambda e: None)
    seen = []
    for _ in range(4):  # 30 prompt tokens: 8 a turn, the first token in the fourth
        before = [len(h.tokens) for h in running]
        next(turns)
        assert [len(h.tokens) for h in running] == [b + 1 for b in before]
        seen.append(len(new.tokens))
    assert seen[:3] == [0, 0, 0] and seen[3] == 2  # its first token, then a step with the others
    for _ in turns:
        pass
    assert new.tokens == _alone(model, PROMPT, 5, 3)


@pytest.mark.parametrize("chunk", [None, 4])
def test_requests_waiting_for_a_row_are_admitted_in_order(model, chunk):
    engine = Engine(model, lambda t: b"x", None, max_batch=2, max_queue=8, prefill_chunk=chunk)
    order: list[str] = []

    def first_token(name: str):
        def on_event(e) -> None:
            if isinstance(e, Piece) and name not in order:
                order.append(name)

        return on_event

    names = [f"r{i}" for i in range(7)]
    for i, name in enumerate(names):
        prompt = PROMPT[: 3 + 4 * i]
        engine.submit(prompt, SamplingParams(max_tokens=3 + i % 3, seed=i), first_token(name), group=name)
    engine.run_until_done()
    assert order == names


def test_prefill_chunk_is_checked(model):
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1 or None"):
            Engine(model, None, None, prefill_chunk=bad)


def test_a_forward_without_its_head_fills_the_cache_alike_and_returns_the_blocks_output(model):
    ids = torch.tensor([PROMPT[:12]])
    full, bare = model.make_kv_cache(1), model.make_kv_cache(1)
    with torch.no_grad():
        logits = model(ids, kv_cache=full)
        hidden = model(ids, kv_cache=bare, head=False)
        assert hidden.shape == (1, 12, model.config.d_model) and bare.length == 12
        torch.testing.assert_close(model.lm_head(model.ln_final(hidden)), logits)
    for a, b in zip(full.keys + full.values, bare.keys + bare.values):
        assert torch.equal(a, b)

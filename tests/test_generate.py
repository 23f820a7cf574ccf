"""ferrolm.lm.generate: the sampling rules on fixed logits, the KV cache against full
recomputation, and generate()'s stopping, batching, seeding and argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from ferrolm.lm.decoding import _nucleus_candidates
from ferrolm.lm.generate import generate, sample, sampling_probs, top_k_mask, top_p_mask
from ferrolm.lm.model import TransformerLM

VOCAB, CTX = 64, 16


pytestmark = pytest.mark.usefixtures("_single_thread")


@pytest.fixture(scope="module", params=["mha", "gqa-qk-norm"])
def model(request):
    """The plain model, and one with grouped-query attention (2 key/value heads for 4 query
    heads: a narrower cache) and QK-norm (keys cached after the norm)."""
    torch.manual_seed(1234)
    switches = {} if request.param == "mha" else {"num_kv_heads": 2, "qk_norm": True}
    m = TransformerLM(VOCAB, CTX, d_model=32, num_layers=2, num_heads=4, d_ff=64, **switches)
    m.eval()
    return m


def kept(mask: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask).flatten().tolist())


# ------------------------------------------------------------------ top-k / top-p -----


def test_top_k_keeps_the_k_largest_with_ties_broken_by_lowest_id():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 0.0])
    assert kept(top_k_mask(logits, 1)) == {1}
    assert kept(top_k_mask(logits, 2)) == {1, 2}
    assert kept(top_k_mask(logits, 3)) == {1, 2, 4}
    assert kept(top_k_mask(logits, 4)) == {1, 2, 3, 4}
    assert kept(top_k_mask(logits, 5)) == {0, 1, 2, 3, 4}
    assert kept(top_k_mask(logits, 6)) == set(range(6))
    assert kept(top_k_mask(logits, 100)) == set(range(6))
    # batched rows are independent
    rows = torch.tensor([[0.0, 0.0, 0.0, 0.0], [4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 2.0, 5.0]])
    assert [kept(r) for r in top_k_mask(rows, 2)] == [{0, 1}, {0, 1}, {3, 1}]


def test_top_p_is_the_smallest_most_probable_set_reaching_p():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert kept(top_p_mask(probs, 0.05)) == {1}
    assert kept(top_p_mask(probs, 0.4)) == {1}  # 0.4 reaches 0.4
    assert kept(top_p_mask(probs, 0.41)) == {1, 3}
    assert kept(top_p_mask(probs, 0.7)) == {1, 3}  # 0.4 + 0.3 reaches 0.7 (float32 sum 0.70000005 or 0.69999996)
    assert kept(top_p_mask(probs, 0.71)) == {1, 3, 2}
    assert kept(top_p_mask(probs, 0.9)) == {1, 3, 2}
    assert kept(top_p_mask(probs, 0.91)) == {0, 1, 2, 3}
    assert kept(top_p_mask(probs, 1.0)) == {0, 1, 2, 3}


def test_top_p_ties_go_to_the_lowest_ids_and_p_1_keeps_zero_probability_tokens():
    four = torch.full((4,), 0.25)
    assert kept(top_p_mask(four, 0.25)) == {0}
    assert kept(top_p_mask(four, 0.5)) == {0, 1}
    assert kept(top_p_mask(four, 0.5 + 1e-7)) == {0, 1}  # within the documented 1e-6 slack
    assert kept(top_p_mask(four, 0.51)) == {0, 1, 2}
    tied_after_leader = torch.tensor([0.2, 0.2, 0.4, 0.2, 0.0])
    assert kept(top_p_mask(tied_after_leader, 0.5)) == {2, 0}
    assert kept(top_p_mask(tied_after_leader, 0.7)) == {2, 0, 1}
    assert kept(top_p_mask(tied_after_leader, 0.999)) == {0, 1, 2, 3}
    assert kept(top_p_mask(tied_after_leader, 1.0)) == {0, 1, 2, 3, 4}


def _top_p_by_definition(probs: list[float], p: float) -> set[int]:
    """Plain-Python statement of the rule: rank by (-prob, id); the shortest prefix whose
    (float64) sum reaches p - 1e-6."""
    ranking = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    chosen, mass = set(), 0.0
    for i in ranking:
        chosen.add(i)
        mass += probs[i]
        if mass >= p - 1e-6:
            break
    return chosen


def test_top_p_matches_the_definition_on_random_distributions():
    g = torch.Generator().manual_seed(7)
    for trial in range(200):
        n = int(torch.randint(1, 30, (1,), generator=g))
        # coarse values so that ties happen often
        weights = torch.randint(0, 6, (n,), generator=g).double() + (trial % 2) * torch.rand(
            n, generator=g, dtype=torch.float64
        )
        if weights.sum() == 0:
            weights[0] = 1.0
        probs = weights / weights.sum()
        p = float(torch.rand((), generator=g, dtype=torch.float64).clamp_min(1e-3))
        assert kept(top_p_mask(probs, p)) == _top_p_by_definition(probs.tolist(), p), (probs, p)


def test_sampling_probs_applies_temperature_then_top_k_then_top_p_and_renormalizes():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    assert sampling_probs(logits).tolist() == pytest.approx([0.1, 0.4, 0.2, 0.3], abs=1e-6)
    assert sampling_probs(logits, top_p=0.7).tolist() == pytest.approx([0, 4 / 7, 0, 3 / 7], abs=1e-6)
    assert sampling_probs(logits, top_k=3).tolist() == pytest.approx([0, 4 / 9, 2 / 9, 3 / 9], abs=1e-6)
    # top-p acts on the top-k distribution: 4/9 + 3/9 = 0.78 reaches 0.75
    assert sampling_probs(logits, top_k=3, top_p=0.75).tolist() == pytest.approx([0, 4 / 7, 0, 3 / 7], abs=1e-6)
    # temperature 2 flattens: p ∝ sqrt(p)
    roots = [math.sqrt(x) for x in (0.1, 0.4, 0.2, 0.3)]
    assert sampling_probs(logits, temperature=2.0).tolist() == pytest.approx([r / sum(roots) for r in roots], abs=1e-6)
    # top-p is computed after temperature: at T=2 the two leaders hold 0.586 < 0.7, so three are kept
    t2 = [r / sum(roots) for r in roots]
    expect = [0, t2[1], t2[2], t2[3]]
    assert sampling_probs(logits, temperature=2.0, top_p=0.7).tolist() == pytest.approx(
        [x / sum(expect) for x in expect], abs=1e-6
    )
    assert sampling_probs(logits, temperature=0).tolist() == [0, 1, 0, 0]


# Upper 0.1 % points of the chi-square distribution, for df = 1..9 (standard tables).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877}


def _chi2_critical(df: int) -> float:
    """The 0.999 quantile of chi-square(df): scipy when installed, else the table, else
    the Wilson-Hilferty approximation (within 1 % for df >= 10)."""
    try:
        from scipy.stats import chi2  # type: ignore
    except ImportError:
        if df in CHI2_999:
            return CHI2_999[df]
        z = 3.0902  # standard normal 0.999 quantile
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return float(chi2.ppf(0.999, df))


def _chi2_statistic(counts: list[int], expected_probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, expected_probs))


def test_sampled_frequencies_match_the_renormalized_probabilities():
    # Hand-built expectation: T = 0.8, top_k = 6, top_p = 0.9 on 8 tokens.
    base = [0.30, 0.05, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04]
    logits = torch.log(torch.tensor(base, dtype=torch.float64)).float()
    T, k, p = 0.8, 6, 0.9
    tempered = [x ** (1 / T) for x in base]
    rank = sorted(range(8), key=lambda i: -tempered[i])[:k]  # no ties here
    z = sum(tempered[i] for i in rank)
    dist = {i: tempered[i] / z for i in rank}
    chosen, mass = [], 0.0
    for i in sorted(dist, key=lambda i: -dist[i]):
        chosen.append(i)
        mass += dist[i]
        if mass >= p:
            break
    expected = [0.0] * 8
    for i in chosen:
        expected[i] = dist[i] / sum(dist[j] for j in chosen)
    assert 2 <= len(chosen) < k  # both filters act

    n = 20_000
    g = torch.Generator().manual_seed(2024)
    draws = sample(logits.expand(n, 8), temperature=T, top_k=k, top_p=p, generator=g)
    counts = torch.bincount(draws, minlength=8).tolist()
    assert all(counts[i] == 0 for i in range(8) if expected[i] == 0), counts
    kept_ids = [i for i in range(8) if expected[i] > 0]
    stat = _chi2_statistic([counts[i] for i in kept_ids], [expected[i] for i in kept_ids])
    crit = _chi2_critical(len(kept_ids) - 1)
    assert stat < crit, (stat, crit, counts, expected)
    # The test has power: the same counts are far from the kept tokens' probabilities
    # at temperature 1 (i.e. had the temperature been ignored).
    wrong = [base[i] / sum(base[j] for j in kept_ids) for i in kept_ids]
    assert _chi2_statistic([counts[i] for i in kept_ids], wrong) > 10 * crit


def test_top_p_shortlist_gives_the_same_kept_set_as_ranking_the_vocabulary():
    g = torch.Generator().manual_seed(8)
    used = 0
    for trial in range(60):
        scale = [0.5, 3.0, 8.0][trial % 3]
        logits = torch.randn(3, 2000, generator=g) * scale
        if trial % 5 == 0:  # ties, including across the shortlist boundary
            logits = (logits * 2).round() / 2
        probs = torch.softmax(logits, dim=-1)
        p = [0.3, 0.9, 0.99][trial % 3]
        shortlist = _nucleus_candidates(probs, p)
        if shortlist is None:
            continue
        used += 1
        full = top_p_mask(probs, p)
        short = torch.zeros_like(full).scatter(1, shortlist, top_p_mask(probs.gather(1, shortlist), p))
        assert torch.equal(short, full)
    assert used >= 20  # the shortlist path was exercised


def test_sample_draws_from_sampling_probs_on_a_large_peaked_vocabulary():
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(1000, generator=g) * 2.5  # peaked: the shortlist path of top-p
    for kwargs in ({"top_p": 0.5}, {"top_k": 9}, {"top_k": 40, "top_p": 0.6, "temperature": 1.3}, {"temperature": 0.5}):
        probs = sampling_probs(logits, **kwargs)
        support = torch.nonzero(probs > 0).flatten().tolist()
        if "top_p" in kwargs and "top_k" not in kwargs:
            assert _nucleus_candidates(torch.softmax(logits, -1).unsqueeze(0), kwargs["top_p"]) is not None
        n = 20_000
        draws = sample(logits.expand(n, -1), generator=g, **kwargs)
        counts = torch.bincount(draws, minlength=logits.numel())
        assert set(torch.nonzero(counts).flatten().tolist()) <= set(support)
        # pool the rare tokens so every cell expects >= 20 draws
        order = sorted(support, key=lambda i: -float(probs[i]))
        cells, rest_c, rest_q = [], 0, 0.0
        for i in order:
            q = float(probs[i])
            if n * q >= 20:
                cells.append((int(counts[i]), q))
            else:
                rest_c, rest_q = rest_c + int(counts[i]), rest_q + q
        if rest_q > 0:
            cells.append((rest_c, rest_q))
        df = len(cells) - 1
        assert df >= 1
        stat = _chi2_statistic([c for c, _ in cells], [q for _, q in cells])
        assert stat < _chi2_critical(df), (kwargs, stat, cells)


def test_temperature_to_zero_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 100, generator=g) * 3
    argmax = logits.argmax(dim=-1)
    assert torch.equal(sample(logits, temperature=0), argmax)
    for t in (1e-3, 1e-6, 1e-30):
        assert torch.equal(sample(logits, temperature=t, generator=g), argmax)
        assert torch.equal(sample(logits, temperature=t, top_k=5, top_p=0.5, generator=g), argmax)
    # greedy ties: the lowest id
    assert sample(torch.tensor([0.0, 2.0, 2.0, 1.0]), temperature=0).item() == 1


def test_nan_logits_are_an_error_not_a_silent_draw():
    with pytest.raises(ValueError, match="NaN"):
        sample(torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="NaN"):
        sample(torch.full((3,), float("-inf")), top_k=2)


def test_sampling_rejects_bad_arguments():
    logits = torch.zeros(4)
    for kwargs in (
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": -0.5},
        {"top_k": 0},
        {"top_k": -1},
        {"top_k": 2.5},
    ):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            sample(logits, **kwargs)


# ------------------------------------------------------------------- KV cache ---------


def _ref_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq]))[0, -1]


def _ref_greedy(model, prompt: list[int], n: int, keep: int) -> list[int]:
    """The documented decoding, with no cache: the argmax of the model run on the row's window,
    which grows by one a token and, once the context is full, restarts from the last ``keep``."""
    seq, width, out = list(prompt), min(len(prompt), CTX), []
    for _ in range(n):
        t = int(_ref_logits(model, seq[-width:]).argmax())
        out.append(t)
        seq.append(t)
        width = keep if width + 1 > CTX else width + 1
    return out


@pytest.mark.parametrize("keep", [CTX, CTX // 2, 3])
def test_sliding_window_decodes_the_documented_window(model, keep):
    """Within the context the cache gives the model's logits on the whole sequence; past it,
    each step equals the model run on the documented window (window_keep=CTX: the last CTX)."""
    g = torch.Generator().manual_seed(4)
    for n in (3, CTX + 5):  # a short prompt, and one longer than the context
        prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        assert list(generate(model, prompt, 2 * CTX, temperature=0, window_keep=keep)) == _ref_greedy(
            model, prompt, 2 * CTX, keep
        )


# ------------------------------------------------------------------- generate ---------


def test_greedy_generate_with_and_without_cache_agree(model):
    prompt = [3, 1, 4, 1, 5]
    fast = list(generate(model, prompt, 3 * CTX, temperature=0, window_keep=CTX))
    slow = list(generate(model, prompt, 3 * CTX, temperature=0, use_cache=False))
    assert fast == slow == _ref_greedy(model, prompt, 3 * CTX, CTX)
    assert len(fast) == 3 * CTX and all(isinstance(t, int) and 0 <= t < VOCAB for t in fast)


def test_batch_of_different_lengths_equals_each_prompt_alone(model):
    prompts = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
    # Within the context and beyond it: each row slides its own window, so a short row is
    # never cut back when a longer one fills the context.
    for n, keep in ((CTX - 9, None), (2 * CTX, None), (20, CTX), (20, 3)):
        steps = list(generate(model, prompts, n, temperature=0, window_keep=keep))
        assert len(steps) == n and all(len(s) == 3 for s in steps)
        for b, p in enumerate(prompts):
            assert [s[b] for s in steps] == list(generate(model, p, n, temperature=0, window_keep=keep))
    # sampled: row b draws from a generator seeded with the b-th seed drawn from the one given
    steps = list(generate(model, prompts, 2 * CTX, top_k=20, generator=torch.Generator().manual_seed(8)))
    seeds = torch.randint(0, 2**63 - 1, (3,), generator=torch.Generator().manual_seed(8)).tolist()
    for b, (p, seed) in enumerate(zip(prompts, seeds)):
        alone = generate(model, p, 2 * CTX, top_k=20, generator=torch.Generator().manual_seed(seed))
        assert [s[b] for s in steps] == list(alone)
    # a 2-D tensor or array is a batch too; 1-D ones and numpy ints are one prompt
    import numpy as np

    as_lists = list(generate(model, [[1, 2], [3, 4]], 4, temperature=0))
    assert list(generate(model, torch.tensor([[1, 2], [3, 4]]), 4, temperature=0)) == as_lists
    assert list(generate(model, np.array([[1, 2], [3, 4]]), 4, temperature=0)) == as_lists
    assert list(generate(model, [np.array([1, 2]), torch.tensor([3, 4])], 4, temperature=0)) == as_lists
    single = list(generate(model, [1, 2], 4, temperature=0))
    assert single == [s[0] for s in as_lists]
    assert list(generate(model, torch.tensor([1, 2]), 4, temperature=0)) == single
    assert list(generate(model, [np.int64(1), np.int32(2)], 4, temperature=0)) == single


def test_seed_reproduces_and_different_seeds_differ(model):
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return list(generate(model, [1, 2, 3], 40, temperature=1.0, top_k=20, top_p=0.95, generator=g))

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_max_new_tokens_is_respected(model):
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 5, 2 * CTX + 3):
        assert len(list(generate(model, [1, 2], n, generator=g))) == n
    assert list(generate(model, [1, 2], 0)) == []


def test_eos_stops_generation(model):
    greedy = list(generate(model, [5, 6], 30, temperature=0))
    eos = greedy[4]
    first = greedy.index(eos)
    out = list(generate(model, [5, 6], 30, temperature=0, eos_id=eos))
    assert out == greedy[: first + 1]  # the eos is yielded, then nothing
    # sampled: the prefix up to the first eos is unchanged by passing eos_id
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    free = list(generate(model, [5, 6], 40, generator=g1))
    eos = free[10]
    stopped = list(generate(model, [5, 6], 40, generator=g2, eos_id=eos))
    assert stopped == free[: free.index(eos) + 1]


def test_eos_in_a_batch_finishes_rows_one_by_one(model):
    prompts = [[5, 6], [9], [1, 2, 3]]
    free = list(generate(model, prompts, 25, temperature=0))
    eos = free[3][0]
    steps = list(generate(model, prompts, 25, temperature=0, eos_id=eos))
    for b in range(3):
        col = [s[b] for s in free]
        expect = col[: col.index(eos) + 1] if eos in col else col
        got = [s[b] for s in steps]
        assert got[: len(expect)] == expect
        assert all(t is None for t in got[len(expect) :])
    last = max(([s[b] for s in free] + [eos]).index(eos) for b in range(3))
    assert len(steps) == min(25, last + 1)


def test_empty_prompt_starts_from_eos_as_bos(model):
    eos = 0
    out = list(generate(model, [], 12, temperature=0, eos_id=VOCAB - 1))
    assert out == list(generate(model, [VOCAB - 1], 12, temperature=0, eos_id=VOCAB - 1))
    batch = list(generate(model, [[], [4, 5]], 6, temperature=0, eos_id=eos))
    alone = list(generate(model, [eos], 6, temperature=0, eos_id=eos))
    assert [s[0] for s in batch][: len(alone)] == alone
    with pytest.raises(ValueError, match="eos_id"):
        generate(model, [], 5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"prompt_ids": [1, VOCAB]}, "out of range"),
        ({"prompt_ids": [-1]}, "out of range"),
        ({"prompt_ids": [[1], [2, VOCAB + 5]]}, "out of range"),
        ({"prompt_ids": [1.5]}, "ints"),
        ({"prompt_ids": [True]}, "ints"),
        ({"prompt_ids": torch.zeros(1, 1, 2, dtype=torch.long)}, "2-D"),
        ({"prompt_ids": "hello"}, "encode"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"eos_id": VOCAB}, "eos_id"),
        ({"window_keep": CTX + 1}, "window_keep"),
        ({"window_keep": 0}, "window_keep"),
    ],
)
def test_generate_rejects_bad_input_before_the_first_token(model, kwargs, match):
    args = {"prompt_ids": [1, 2], "max_new_tokens": 5}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(model, **args)  # raises on the call itself, not on the first next()


# ------------------------------------------------------------- streaming text ---------


def test_iter_text_emits_only_whole_utf8_characters_as_soon_as_complete():
    from ferrolm.lm.generate import iter_text

    tokens = {
        0: "你".encode()[:1],
        1: "你".encode()[1:],
        2: b"a",
        3: "é".encode()[:1],
        4: "é".encode()[1:] + b"b",
        5: b"\xff",
        6: b"\xe4",
    }
    consumed = []

    def ids(seq):
        for t in seq:
            consumed.append(t)
            yield t

    seq = [0, 1, 2, 3, 4]
    it = iter_text(ids(seq), tokens.__getitem__)
    assert next(it) == "你" and consumed == [0, 1]  # held back after token 0, out right after token 1
    assert next(it) == "a" and consumed == [0, 1, 2]
    assert next(it) == "éb" and consumed == [0, 1, 2, 3, 4]
    assert list(it) == []
    # invalid and truncated bytes: exactly bytes.decode("utf-8", "replace")
    for seq in ([5, 2], [0, 2, 1], [2, 6], [0], [3, 5, 4]):
        whole = b"".join(tokens[t] for t in seq).decode("utf-8", "replace")
        pieces = list(iter_text(seq, tokens.__getitem__))
        assert "".join(pieces) == whole and all(pieces)


# ------------------------------------------------------------------------ CLI ---------


def _tiny_tokenizer():
    from ferrolm.bpe.tokenizer import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"t", b"h"), (b"th", b"e"), (b" ", b"the")]
    for i, (a, b) in enumerate(merges):
        vocab[256 + i] = a + b
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """A tokenizer dir and a checkpoint of a fresh tiny model trained on nothing."""
    from ferrolm.lm.checkpoint import save_checkpoint

    tmp = tmp_path_factory.mktemp("cli")
    tok = _tiny_tokenizer()
    tok.save(tmp / "tok")
    assert tok.eos_id == 259 and tok.vocab_size == 260
    torch.manual_seed(99)
    m = TransformerLM(
        tok.vocab_size + 4, 24, d_model=32, num_layers=2, num_heads=4, d_ff=64
    )  # 4 ids the tokenizer lacks
    save_checkpoint(
        m, None, 7, tmp / "model.pt", config={"model": m.config.to_dict()}, tokenizer_fingerprint=tok.fingerprint
    )
    other = _tiny_tokenizer().fingerprint[::-1]
    save_checkpoint(m, None, 7, tmp / "other.pt", config={"model": m.config.to_dict()}, tokenizer_fingerprint=other)
    small = TransformerLM(100, 24, d_model=32, num_layers=1, num_heads=4, d_ff=64)
    small_cfg = {
        k: v
        for k, v in small.config.to_dict().items()
        if k in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta")
    }
    save_checkpoint(small, None, 1, tmp / "small.pt", config={"model": small_cfg})  # no fingerprint recorded
    return {
        "dir": tmp,
        "tok": tmp / "tok",
        "ckpt": tmp / "model.pt",
        "other": tmp / "other.pt",
        "small": tmp / "small.pt",
        "model": m,
        "tokenizer": tok,
    }


def _cli(capsys, *argv):
    from ferrolm.app.cli import main

    rc = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _expected_text(files, prompt, n, seed, **kw):
    tok, m = files["tokenizer"], files["model"]
    g = torch.Generator().manual_seed(seed)
    ids = [t for t in generate(m, tok.encode(prompt), n, generator=g, eos_id=tok.eos_id, **kw) if t != tok.eos_id]
    text = b"".join(tok.token_bytes(t) if t < tok.vocab_size else "\ufffd".encode() for t in ids).decode(
        "utf-8", "replace"
    )
    return prompt + text + "\n"


def test_cli_generate_prints_what_generate_samples(cli_files, capsys):
    f = cli_files
    base = ["--checkpoint", f["ckpt"], "--tokenizer", f["tok"], "--device", "cpu"]
    rc, out, err = _cli(
        capsys,
        *base,
        "--prompt",
        "the theme",
        "--max-new-tokens",
        40,
        "--seed",
        5,
        "--temperature",
        0.9,
        "--top-k",
        30,
        "--top-p",
        0.95,
    )
    assert rc == 0, err
    assert out == _expected_text(f, "the theme", 40, 5, temperature=0.9, top_k=30, top_p=0.95)
    # same seed, same text; the default seed is fresh and reported on stderr
    assert (
        _cli(
            capsys,
            *base,
            "--prompt",
            "the theme",
            "--max-new-tokens",
            40,
            "--seed",
            5,
            "--temperature",
            0.9,
            "--top-k",
            30,
            "--top-p",
            0.95,
        )[1]
        == out
    )
    rc, out2, err = _cli(capsys, *base, "--prompt", "the theme", "--max-new-tokens", 5)
    assert rc == 0 and err.startswith("seed ")
    # greedy, an empty prompt (starts from <|endoftext|>), several samples
    rc, out, _ = _cli(capsys, *base, "--prompt", "", "--max-new-tokens", 10, "--temperature", 0, "--seed", 1)
    assert rc == 0 and out == _expected_text(f, "", 10, 1, temperature=0)
    rc, out, _ = _cli(capsys, *base, "--prompt", "x", "--max-new-tokens", 8, "--num-samples", 3, "--seed", 2)
    assert rc == 0 and [line for line in out.splitlines() if line.startswith("--- sample")] == [
        f"--- sample {i}/3 ---" for i in (1, 2, 3)
    ]


def test_cli_generate_reads_the_prompt_from_stdin(cli_files, capsys):
    import os
    import subprocess
    import sys

    f = cli_files
    args = ["--checkpoint", f["ckpt"], "--tokenizer", f["tok"], "--device", "cpu", "--max-new-tokens", 30, "--seed", 3]
    proc = subprocess.run(
        [sys.executable, "-m", "ferrolm", "generate", *map(str, args), "--prompt", "-"],
        input="the thé\n".encode(),
        capture_output=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8") == _expected_text(f, "the thé", 30, 3)


def test_cli_generate_takes_text_that_is_not_utf8_as_u_fffd(cli_files, capsys):
    import os
    import subprocess
    import sys

    f = cli_files
    args = ["--checkpoint", f["ckpt"], "--tokenizer", f["tok"], "--device", "cpu", "--max-new-tokens", 8]
    args += ["--temperature", 0]
    # an argument byte that is not UTF-8 reaches Python as a lone surrogate; stdin as bytes
    proc = subprocess.run(
        [sys.executable, "-m", "ferrolm", "generate", *map(str, args), "--prompt", "a\udc80b", "--prompt", "-"],
        input=b"th\xffe\n",
        capture_output=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr.decode()
    rc, out, err = _cli(capsys, *args, "--prompt", "a\ufffdb", "--prompt", "th\ufffde")
    assert rc == 0, err
    assert proc.stdout.decode("utf-8") == out and "--- prompt 1/2 ---\na\ufffdb" in out


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--checkpoint": "other"}, "do not belong together"),
        ({"--checkpoint": "small"}, "do not belong together"),  # tokenizer ids beyond the model's vocab
        ({"--checkpoint": "missing"}, "not found"),
        ({"--top-p": 0}, "top_p"),
        ({"--top-p": 1.5}, "top_p"),
        ({"--temperature": -1}, "temperature"),
        ({"--top-k": 0}, "top_k"),
        ({"--num-samples": 0}, "num-samples"),
    ],
)
def test_cli_generate_bad_input_is_a_clear_error(cli_files, capsys, change, message):
    f = cli_files
    opts = {
        "--checkpoint": f["ckpt"],
        "--tokenizer": f["tok"],
        "--prompt": "the",
        "--device": "cpu",
        "--max-new-tokens": 3,
    }
    for k, v in change.items():
        opts[k] = f["dir"] / f"{v}.pt" if k == "--checkpoint" else v
    rc, out, err = _cli(capsys, *[x for kv in opts.items() for x in kv])
    assert rc == 2 and message in err and out == ""


def test_stop_text_holds_back_a_possible_stop_and_cuts_before_it():
    from ferrolm.lm.generate import StopText

    s = StopText(["END", "\n\n"])
    assert s.feed("abc E") == "abc " and s.feed("N") == "" and s.feed("x") == "ENx"
    assert s.feed("yy\n") == "yy" and s.feed("\nzz") == "" and s.done and s.feed("more") == ""
    assert StopText(["END"]).cut("no stop here") == "no stop here"
    assert StopText([]).cut("E") == "E" and StopText(["ab", "b"]).cut("xab") == "x"


def test_cli_generate_batch_prompt_file_and_stop(cli_files, capsys, tmp_path):
    f = cli_files
    tok, m = f["tokenizer"], f["model"]
    base = ["--checkpoint", f["ckpt"], "--tokenizer", f["tok"], "--device", "cpu", "--temperature", 0]
    n = 12
    (tmp_path / "p.txt").write_text("the theme\n", encoding="utf-8")
    rc, out, _ = _cli(capsys, *base, "--prompt", "the", "--prompt-file", tmp_path / "p.txt", "--max-new-tokens", n)
    assert rc == 0
    rows = [tok.encode("the"), tok.encode("the theme")]
    new = [[], []]
    for step in generate(m, rows, n, temperature=0.0, eos_id=tok.eos_id):
        for r, t in enumerate(step):
            if t is not None and t != tok.eos_id:
                new[r].append(t)
    texts = [b"".join(tok.token_bytes(t) if t < tok.vocab_size else b"\xef\xbf\xbd" for t in ids) for ids in new]
    texts = [t.decode("utf-8", "replace") for t in texts]
    assert out == f"--- prompt 1/2 ---\nthe{texts[0]}\n--- prompt 2/2 ---\nthe theme{texts[1]}\n"
    # a stop string: the sample ends before it, and it is not printed
    full = _expected_text(f, "the", n, 0, temperature=0.0)[len("the") : -1]
    stop = full[3:5]
    rc, out, _ = _cli(capsys, *base, "--prompt", "the", "--max-new-tokens", n, "--stop", stop, "--stop", "\x00never")
    assert rc == 0 and out == "the" + full[: full.index(stop)] + "\n"
    rc, out, err = _cli(capsys, "--checkpoint", f["ckpt"], "--tokenizer", f["tok"], "--device", "cpu")
    assert rc == 2 and "--prompt" in err


# ------------------------------------------------------------- pinned outputs ---------

# `ferrolm generate` on tests/tiny_lm.py's model, recorded before its decoding loop became the
# inference engine's: one prompt (greedy, sampled, several samples from one seed), several
# prompts within the context, a prompt longer than the context (the window slides; the
# prompt's echo left out here), and stop strings.
PINS = {
    "greedy": "The parser efoooding e e e e e e e e e e e e e e e e\n",
    "sampled": 'The parser E stion isrus $ "\\er arg:arser\n        obj.        umentinebje exababare\n',
    "samples3": "--- sample 1/3 ---\nJSON')\n    ers TileHelo '\"-obj'\n--- sample 2/3 ---\nJSON\n    (.d4etrump(\n\n\nathoobj\n--- sample 3/3 ---\nJSON�is aqotx_'pictions pripi\n",
    "batch_greedy": "--- prompt 1/3 ---\nThe parser efoooding e e e e e e e e e e e\n--- prompt 2/3 ---\nLogefoooooooooooooooooooooooooooo\n--- prompt 3/3 ---\n.dulololoduloloduloloodubcis('\n",
    "slide_greedy": "looooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooo\n",
    "slide_sampled": ".    ':\n\n\n\n\n    ...lod ...     Tons the ands s lood\"cromads apFanamauolrileedice conile-onooypy parser'pror etyppomed le no\n",
    "stop": "The parser efoooding \n",
    "batch_stop": "--- prompt 1/2 ---\nThe parser ef\n--- prompt 2/2 ---\nJSONo\n",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_lm import tiny_run

    ckpt, tok, text = tiny_run(tmp_path_factory.mktemp("tiny"))
    return ckpt, " ".join(text.split()[40:120])


def test_cli_generate_outputs_are_pinned(tiny, capsys):
    ckpt, long_prompt = tiny
    greedy, sampled = ["--temperature", 0], ["--seed", 7, "--temperature", 0.9, "--top-k", 40, "--top-p", 0.95]
    cases = {
        "greedy": ["--prompt", "The parser", "--max-new-tokens", 40, *greedy],
        "sampled": ["--prompt", "The parser", "--max-new-tokens", 40, *sampled],
        "samples3": ["--prompt", "JSON", "--max-new-tokens", 20, "--seed", 3, "--num-samples", 3],
        "batch_greedy": ["--prompt", "The parser", "--prompt", "Log", "--prompt", "", "--max-new-tokens", 30, *greedy],
        "slide_greedy": ["--prompt", long_prompt, "--max-new-tokens", 90, *greedy],
        "slide_sampled": ["--prompt", long_prompt, "--max-new-tokens", 90, "--seed", 11, "--temperature", 0.8]
        + ["--top-p", 0.9],
        "stop": ["--prompt", "The parser", "--max-new-tokens", 40, *greedy, "--stop", "e e", "--stop", "zq"],
        "batch_stop": ["--prompt", "The parser", "--prompt", "JSON", "--max-new-tokens", 30, *greedy]
        + ["--stop", "oo", "--stop", "ni"],
    }
    for name, argv in cases.items():
        rc, out, err = _cli(capsys, "--checkpoint", ckpt, "--device", "cpu", *argv)
        assert rc == 0, err
        if name.startswith("slide"):
            assert out.startswith(long_prompt)
            out = out[len(long_prompt) :]
        assert out == PINS[name], name


# ------------------------------------------------------- the engine, in this thread ---------


def test_sequence_text_drops_eos_holds_partial_characters_and_cuts_at_stops():
    from ferrolm.lm.decoding import SequenceText

    pieces = {0: "é".encode()[:1], 1: "é".encode()[1:], 2: b"ab", 3: b"cd", 9: b"<eos>"}
    t = SequenceText(pieces.__getitem__, 9, ["bc"])
    assert t.feed(0) == "" and t.feed(1) == "é" and t.feed(2) == "a" and not t.done
    assert t.feed(3) == "" and t.done and t.stopped and t.finish() == "" and t.feed(2) == ""
    t = SequenceText(pieces.__getitem__, 9, ["bc"])
    assert t.feed(2) == "a" and t.feed(0) == "" and t.feed(9) == "" and t.done and not t.stopped
    assert t.finish() == "b\ufffd"  # what was held back, an unfinished character as U+FFFD
    t = SequenceText(pieces.__getitem__, None)
    assert t.feed(9) == "<eos>" and not t.done and t.finish() == ""


def test_engine_runs_in_the_calling_thread_as_on_its_own(model):
    import threading

    from ferrolm.lm.engine import Engine, Finished, Piece, SamplingParams

    def run(threaded: bool) -> list:
        engine = Engine(model, lambda t: bytes([65 + t % 26]), 5, max_batch=2)
        events: list = [[], [], []]
        params = SamplingParams(12, temperature=0.8, seed=4, stop=("QQ",))
        for r, p in enumerate([[1, 2], [3], [4, 5, 6]]):
            engine.submit(p, params, events[r].append)
        if threaded:
            engine.start().close(timeout=60)
        else:
            before = threading.active_count()
            assert list(engine.turns()) and threading.active_count() == before
            with pytest.raises(RuntimeError, match="own thread"):
                engine.start()
                list(engine.turns())
            engine.close(timeout=60)
        return events

    events = run(False)
    assert events == run(True)
    for ev in events:
        assert all(isinstance(e, Piece) for e in ev[:-1]) and isinstance(ev[-1], Finished)


def test_generate_raises_what_makes_a_row_fail(model):
    broken = TransformerLM(VOCAB, CTX, d_model=32, num_layers=1, num_heads=4, d_ff=64).eval()
    with torch.no_grad():
        broken.lm_head.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        list(generate(broken, [1, 2], 5, generator=torch.Generator().manual_seed(0)))


def test_generate_text_raises_the_callers_own_error_as_it_was(model):
    from ferrolm.lm.generate import generate_text

    def on_piece(row: int, text: str) -> None:
        raise BrokenPipeError("the reader went away")

    with pytest.raises(BrokenPipeError, match="reader went away"):
        generate_text(model, [1, 2], lambda t: b"x", 5, temperature=0, on_piece=on_piece)
    assert generate_text(model, [[1, 2], [3]], lambda t: b"x", 5, temperature=0) == ["xxxxx", "xxxxx"]

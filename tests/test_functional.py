"""ferrolm.lm.functional against hand-worked numbers and against torch's own ops.

Expected values in the hand-worked tests are written out as decimals and re-derived
with the standard library's math.exp / math.log, never with the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ferrolm.lm import functional

pytestmark = pytest.mark.usefixtures("_single_thread")


# ------------------------------------------------------------------- softmax ----------


def test_softmax_of_2_1_minus1_at_temperature_1_and_2():
    x = torch.tensor([2.0, 1.0, -1.0], dtype=torch.float64)
    # τ = 1: e^2 = 7.389056, e^1 = 2.718282, e^-1 = 0.367879, sum 10.475217
    by_hand_t1 = [0.705385, 0.259496, 0.035119]
    exps = [math.exp(2), math.exp(1), math.exp(-1)]
    assert [e / sum(exps) for e in exps] == pytest.approx(by_hand_t1, abs=1e-6)
    # τ = 2: x/τ = (1, 0.5, -0.5): e^1 = 2.718282, e^0.5 = 1.648721, e^-0.5 = 0.606531, sum 4.973534
    by_hand_t2 = [0.546549, 0.331498, 0.121952]
    exps = [math.exp(1), math.exp(0.5), math.exp(-0.5)]
    assert [e / sum(exps) for e in exps] == pytest.approx(by_hand_t2, abs=1e-6)

    assert functional.softmax(x / 1.0, dim=-1).tolist() == pytest.approx(by_hand_t1, abs=1e-6)
    assert functional.softmax(x / 2.0, dim=-1).tolist() == pytest.approx(by_hand_t2, abs=1e-6)
    # a higher temperature flattens the distribution
    assert functional.softmax(x / 2.0, dim=-1)[0] < functional.softmax(x, dim=-1)[0]


def test_softmax_matches_torch_on_any_dim():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g)
    for dim in (0, 1, 2, -1):
        torch.testing.assert_close(functional.softmax(x, dim), F.softmax(x, dim=dim))


def test_softmax_is_stable_for_large_inputs():
    x = torch.tensor([[1e4, 1e4 - 1.0, -1e4], [1000.0, 1000.0, 1000.0]])
    out = functional.softmax(x, dim=-1)
    assert torch.isfinite(out).all()
    # shifting by a constant changes nothing: same as softmax(0, -1, -2e4)
    torch.testing.assert_close(out[0], functional.softmax(torch.tensor([0.0, -1.0, -2e4]), dim=-1))
    torch.testing.assert_close(out[1], torch.full((3,), 1 / 3))


# ------------------------------------------------------------------- silu -------------


def test_silu_by_hand_and_against_torch():
    # silu(0) = 0, silu(1) = 1/(1+e^-1) = 0.731059, silu(-2) = -2/(1+e^2) = -0.238406
    x = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64)
    assert functional.silu(x).tolist() == pytest.approx([0.0, 0.731059, -0.238406], abs=1e-6)
    y = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(functional.silu(y), F.silu(y))


# ------------------------------------------------------------------- cross-entropy ----


def test_cross_entropy_two_token_example():
    # Token 1: uniform logits over 3 classes, target 2: loss = ln 3 = 1.098612.
    # Token 2: logits (2, 1, -1), target 0: loss = ln(e^2 + e^1 + e^-1) - 2
    #          = ln 10.475217 - 2 = 2.349012 - 2 = 0.349012.
    # Mean over the two positions: (1.098612 + 0.349012) / 2 = 0.723812.
    logits = torch.tensor([[0.0, 0.0, 0.0], [2.0, 1.0, -1.0]], dtype=torch.float64)
    targets = torch.tensor([2, 0])
    by_hand = 0.723812
    assert (math.log(3) + math.log(math.exp(2) + math.exp(1) + math.exp(-1)) - 2) / 2 == pytest.approx(
        by_hand, abs=1e-6
    )
    assert functional.cross_entropy(logits, targets).item() == pytest.approx(by_hand, abs=1e-6)


def test_cross_entropy_matches_torch_with_batch_dims():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 6, 11, generator=g) * 3
    targets = torch.randint(0, 11, (4, 6), generator=g)
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    torch.testing.assert_close(functional.cross_entropy(logits, targets), expected)
    # gradients agree too
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    functional.cross_entropy(a, targets).backward()
    F.cross_entropy(b.reshape(-1, 11), targets.reshape(-1)).backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_cross_entropy_is_finite_for_logits_of_1e4():
    logits = torch.tensor([[1e4, 0.0, -1e4], [1e4, 1e4, 1e4], [-1e4, 1e4, 0.0]])
    targets = torch.tensor([0, 1, 0])
    loss = functional.cross_entropy(logits, targets)
    assert torch.isfinite(loss)
    # by hand: position 0 loss ≈ 0, position 1 loss = ln 3, position 2 loss = 2e4
    assert loss.item() == pytest.approx((0.0 + math.log(3) + 2e4) / 3, rel=1e-6)
    x = logits.clone().requires_grad_()
    functional.cross_entropy(x, targets).backward()
    assert torch.isfinite(x.grad).all()


def test_cross_entropy_of_bfloat16_logits_is_computed_in_float32():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 1000, generator=g) * 4).bfloat16()
    targets = torch.randint(0, 1000, (5,), generator=g)
    loss = functional.cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), targets))
    x = logits.clone().requires_grad_()
    functional.cross_entropy(x, targets).backward()
    y = logits.float().requires_grad_()
    F.cross_entropy(y, targets).backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, y.grad.bfloat16())


def test_cross_entropy_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="targets"):
        functional.cross_entropy(torch.zeros(2, 3, 5), torch.zeros(3, 2, dtype=torch.long))


# --------------------------------------------------------- linear_cross_entropy --------


def _head_problem(n=37, d=12, vocab=50, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype)
    w = torch.randn(vocab, d, generator=g, dtype=dtype) * 0.5
    t = torch.randint(0, vocab, (n,), generator=g)
    return h, w, t


def _loss_and_grads(fn, h, w, t):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, t)
    (loss * 3.0).backward()  # an incoming gradient other than 1
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_rows", [1, 8, 10, 37, 64, None])
def test_linear_cross_entropy_equals_cross_entropy_of_the_logits(chunk_rows):
    h, w, t = _head_problem()
    want = _loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.T, t), h, w, t)
    got = _loss_and_grads(lambda h, w, t: functional.linear_cross_entropy(h, w, t, chunk_rows=chunk_rows), h, w, t)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_linear_cross_entropy_plain_backward_and_a_retained_graph_backward_twice():
    # an incoming gradient of exactly 1 hands the formed gradients over as they are: a second
    # backward through the kept graph must add the same again, not a changed copy
    h, w, t = _head_problem()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    F.cross_entropy(hr @ wr.T, t).backward()
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = functional.linear_cross_entropy(hh, ww, t, chunk_rows=10)
    loss.backward(retain_graph=True)
    torch.testing.assert_close(hh.grad, hr.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ww.grad, wr.grad, atol=1e-6, rtol=1e-5)
    loss.backward()
    torch.testing.assert_close(hh.grad, 2 * hr.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ww.grad, 2 * wr.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("width, vocab, rows", [("AVX2", 10_000, 512), ("AVX-512", 10_000, 128), ("AVX2", 512, 4096)])
def test_linear_cross_entropy_chunks_are_larger_on_avx2_cpus(monkeypatch, width, vocab, rows):
    # where the widest vectors are AVX2 the chunk's GEMMs dominate: at least 512 rows;
    # elsewhere the 8 MiB of logits (at least 128 rows) stays as it was
    monkeypatch.setattr(functional, "cpu_vector_width", lambda: width)
    assert functional._chunk_rows(vocab, torch.device("cpu")) == rows
    assert functional._chunk_rows(10_000, torch.device("meta")) == 4096  # not a CPU: 256 MiB, as before


@pytest.mark.parametrize("chunk_rows", [1, 10, None])
def test_soft_capped_linear_cross_entropy_equals_cross_entropy_of_the_capped_logits(chunk_rows):
    h, w, t = _head_problem()
    h = h * 3  # logits well past the cap, where tanh bends
    want = _loss_and_grads(lambda h, w, t: F.cross_entropy(2.5 * torch.tanh((h @ w.T) / 2.5), t), h, w, t)
    got = _loss_and_grads(
        lambda h, w, t: functional.linear_cross_entropy(h, w, t, softcap_at=2.5, chunk_rows=chunk_rows), h, w, t
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(functional.linear_cross_entropy(h, w, t, softcap_at=2.5), want[0])
    with pytest.raises(ValueError, match="softcap_at"):
        functional.linear_cross_entropy(h, w, t, softcap_at=-1.0)


@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_linear_cross_entropy_gradcheck_float64(cap):
    h, w, t = _head_problem(n=9, d=4, vocab=7, dtype=torch.float64)
    h.requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w: functional.linear_cross_entropy(h, w, t, softcap_at=cap, chunk_rows=4), (h, w)
    )


def test_linear_cross_entropy_without_grad_and_with_batch_dims():
    h, w, t = _head_problem(n=24)
    want = F.cross_entropy(h @ w.T, t)
    with torch.no_grad():
        got = functional.linear_cross_entropy(h.reshape(2, 12, -1), w, t.reshape(2, 12), chunk_rows=5)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="targets"):
        functional.linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="weight"):
        functional.linear_cross_entropy(h, w.T, t)


def test_linear_cross_entropy_is_finite_for_huge_logits():
    h = torch.tensor([[1e4, 0.0], [0.0, 1e4]], requires_grad=True)
    w = torch.eye(2) * 1.0
    loss = functional.linear_cross_entropy(h, w, torch.tensor([1, 1]))
    assert loss.item() == pytest.approx(1e4 / 2, rel=1e-6)
    loss.backward()
    assert torch.isfinite(h.grad).all()


def test_linear_cross_entropy_under_bf16_autocast_reduces_in_float32():
    h, w, t = _head_problem(n=16, d=32, vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(lambda h, w, t: functional.linear_cross_entropy(h, w, t, chunk_rows=8), h, w, t)
        want = _loss_and_grads(lambda h, w, t: functional.cross_entropy(h @ w.T, t), h, w, t)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------- attention --------


def test_attention_three_position_causal_example():
    # d_k = 4, so scores are q.k / 2. Queries and keys (one row per position):
    #   q0 = (2,0,0,0)  q1 = (0,2,0,0)  q2 = (2,2,0,0)
    #   k0 = (1,0,0,0)  k1 = (0,1,0,0)  k2 = (0,0,1,0)
    # Scaled scores s[i][j] = q_i.k_j / 2:
    #   row 0: (1, 0, 0)    row 1: (0, 1, 0)    row 2: (1, 1, 0)
    # Causal mask keeps j <= i:
    #   row 0: only key 0 -> weights (1, 0, 0)
    #   row 1: keys 0,1 scores (0, 1) -> (1/(1+e), e/(1+e)) = (0.268941, 0.731059)
    #   row 2: keys 0,1,2 scores (1, 1, 0) -> (e, e, 1)/(2e+1) = (0.422319, 0.422319, 0.155362)
    # Values v0 = (1, 0), v1 = (0, 1), v2 = (10, 10):
    #   out0 = v0 = (1, 0)
    #   out1 = (0.268941, 0.731059)
    #   out2 = 0.422319*(1,0) + 0.422319*(0,1) + 0.155362*(10,10) = (e + 10)/(2e + 1) = (1.975943, 1.975943)
    e = math.e
    assert [1 / (1 + e), e / (1 + e)] == pytest.approx([0.268941, 0.731059], abs=1e-6)
    assert e / (2 * e + 1) + 10 / (2 * e + 1) == pytest.approx(1.975943, abs=1e-6)
    q = torch.tensor([[2.0, 0, 0, 0], [0, 2, 0, 0], [2, 2, 0, 0]], dtype=torch.float64)
    k = torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]], dtype=torch.float64)
    v = torch.tensor([[1.0, 0], [0, 1], [10, 10]], dtype=torch.float64)
    mask = torch.tensor([[True, False, False], [True, True, False], [True, True, True]])
    out = functional.scaled_dot_product_attention(q, k, v, mask)
    expected = [[1.0, 0.0], [0.268941, 0.731059], [1.975943, 1.975943]]
    for row, exp_row in zip(out.tolist(), expected):
        assert row == pytest.approx(exp_row, abs=1e-6)
    # without the mask, position 0 would see the others
    unmasked = functional.scaled_dot_product_attention(q, k, v)
    assert unmasked[0, 0].item() != pytest.approx(1.0, abs=1e-3)


def test_attention_matches_torch_sdpa_with_and_without_mask():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 5, 8, generator=g)
    k = torch.randn(2, 3, 7, 8, generator=g)
    v = torch.randn(2, 3, 7, 6, generator=g)
    torch.testing.assert_close(
        functional.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v)
    )
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.4
    mask[..., 0] = True  # no fully-masked rows
    torch.testing.assert_close(
        functional.scaled_dot_product_attention(q, k, v, mask),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    )
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(
        functional.scaled_dot_product_attention(q, k[:, :, :5], v[:, :, :5], causal),
        F.scaled_dot_product_attention(q, k[:, :, :5], v[:, :, :5], is_causal=True),
    )


def test_attention_masked_keys_get_exactly_zero_weight():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 8, generator=g)
    k = torch.randn(1, 6, 8, generator=g)
    v = torch.randn(1, 6, 3, generator=g)
    mask = torch.tensor([True, True, False, True, False, False]).expand(4, 6)
    out = functional.scaled_dot_product_attention(q, k, v, mask)
    v2 = v.clone()
    v2[:, ~mask[0]] = 1e6  # masked values cannot leak in
    torch.testing.assert_close(out, functional.scaled_dot_product_attention(q, k, v2, mask))


def test_attention_gradcheck_float64():
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 5, 2, dtype=torch.float64, generator=g, requires_grad=True)
    mask = torch.ones(4, 5, dtype=torch.bool).tril(diagonal=1)
    assert torch.autograd.gradcheck(lambda a, b, c: functional.scaled_dot_product_attention(a, b, c, mask), (q, k, v))


# ------------------------------------------------------------- model switches ---------


def test_qk_norm_relu_squared_and_softcap_by_hand():
    # qk_norm of (3, 4): mean of squares 12.5, sqrt(12.5 + 1e-5) = 3.5355353; (0.848528, 1.131371)
    x = torch.tensor([3.0, 4.0], dtype=torch.float64)
    rms = math.sqrt((9 + 16) / 2 + 1e-5)
    assert functional.qk_norm(x, 1e-5).tolist() == pytest.approx([3 / rms, 4 / rms], abs=1e-12)
    assert [3 / rms, 4 / rms] == pytest.approx([0.848528, 1.131371], abs=1e-6)
    assert functional.qk_norm(x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert functional.relu_squared(torch.tensor([-2.0, 0.0, 0.5, 3.0])).tolist() == [0.0, 0.0, 0.25, 9.0]
    # softcap(z, c) = c tanh(z / c): c = 10 gives 10 tanh(0.5) = 4.621172 for 5 and 10 tanh(10) = 9.999999959 for 100
    got = functional.softcap(torch.tensor([5.0, -100.0, 0.0], dtype=torch.float64), 10.0).tolist()
    assert got == pytest.approx([10 * math.tanh(0.5), -10 * math.tanh(10.0), 0.0], abs=1e-12)
    assert got[0] == pytest.approx(4.621172, abs=1e-6)


def test_grouped_query_attention_repeats_each_key_value_head_in_place():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 4, dtype=torch.float64, generator=g)
    k = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=g)
    v = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=g)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    got = functional.grouped_query_attention(q, k, v, mask)
    for h in range(6):  # 3 query heads per key/value head: heads 0-2 read 0, heads 3-5 read 1
        want = functional.scaled_dot_product_attention(q[:, h], k[:, h // 3], v[:, h // 3], mask)
        torch.testing.assert_close(got[:, h], want)
    with pytest.raises(ValueError, match="do not divide"):
        functional.grouped_query_attention(q, k[:, :1].expand(2, 4, 5, 4), v, mask)


def test_document_ids_and_mask_by_hand():
    ids = torch.tensor([7, 0, 3, 4, 0, 5])  # eos = 0 opens a document
    assert functional.document_ids(ids, 0).tolist() == [0, 1, 1, 1, 2, 2]
    want = [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    assert functional.document_mask(functional.document_ids(ids, 0)).int().tolist() == want

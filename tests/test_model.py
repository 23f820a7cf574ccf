"""ferrolm.lm.model: modules against their equations, properties, the KV cache, accounting.

Small shapes throughout so the file runs in seconds on one CPU thread.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F

from ferrolm.lm import functional
from ferrolm.lm.hf import to_hf_state_dict
from ferrolm.lm.model import (
    CausalSelfAttention,
    Embedding,
    Linear,
    ModelConfig,
    ReLU2FFN,
    RMSNorm,
    RotaryEmbedding,
    SiLUFFN,
    SwiGLU,
    TransformerBlock,
    TransformerLM,
    _ReLUSquared,
    _X0Mix,
    count_parameters,
    flops_per_token,
)

pytestmark = pytest.mark.usefixtures("_single_thread")


SMALL = dict(vocab_size=97, context_length=24, d_model=32, num_layers=2, num_heads=4, d_ff=48, rope_theta=10000.0)


def small_model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(**{**SMALL, **kw}).eval()


def random_ids(batch: int, seq: int, seed: int = 1, vocab: int = SMALL["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------- state_dict & init ------


def test_state_dict_keys_are_the_checkpoint_format():
    model = small_model()
    expected = ["token_embeddings.weight"]
    for i in range(2):
        expected += [f"layers.{i}.ln1.weight"]
        expected += [f"layers.{i}.attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "output_proj")]
        expected += [f"layers.{i}.ln2.weight"]
        expected += [f"layers.{i}.ffn.{w}.weight" for w in ("w1", "w2", "w3")]
    expected += ["ln_final.weight", "lm_head.weight"]
    sd = model.state_dict()
    assert list(sd) == expected  # RoPE's cos/sin buffers are not saved
    assert sd["layers.1.attn.q_proj.weight"].shape == (32, 32)
    assert sd["layers.0.ffn.w1.weight"].shape == (48, 32)
    assert sd["layers.0.ffn.w2.weight"].shape == (32, 48)
    assert sd["layers.0.ffn.w3.weight"].shape == (48, 32)
    assert sd["token_embeddings.weight"].shape == sd["lm_head.weight"].shape == (97, 32)
    # but the RoPE buffers exist and move with the module
    assert {n for n, _ in model.named_buffers()} == {"layers.0.attn.rope.cos", "layers.0.attn.rope.sin"}


def test_state_dict_round_trip_and_strict_load():
    a, b = small_model(0), small_model(1)
    ids = random_ids(2, 10)
    assert not torch.allclose(a(ids), b(ids))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    torch.testing.assert_close(a(ids), b(ids), atol=0, rtol=0)
    with pytest.raises(RuntimeError):
        b.load_state_dict({k: v for k, v in a.state_dict().items() if k != "lm_head.weight"})


def test_ablation_state_dicts():
    sd = small_model(norm="none").state_dict()
    assert not any(".ln" in k or k.startswith("ln_") for k in sd)
    sd = small_model(ffn="silu").state_dict()
    assert "layers.0.ffn.w3.weight" not in sd and sd["layers.0.ffn.w1.weight"].shape == (72, 32)  # 3*48/2
    tied = small_model(tie_embeddings=True)
    sd = tied.state_dict()
    assert sd["token_embeddings.weight"].data_ptr() == sd["lm_head.weight"].data_ptr()
    assert tied.token_embeddings.weight is tied.lm_head.weight
    # loading a tied checkpoint restores the shared matrix
    other = small_model(5, tie_embeddings=True)
    other.load_state_dict(sd)
    ids = random_ids(1, 8)
    torch.testing.assert_close(other(ids), tied(ids), atol=0, rtol=0)


def test_init_is_truncated_normal_with_the_documented_std():
    torch.manual_seed(0)
    lin = Linear(300, 500)
    std = math.sqrt(2 / 800)
    w = lin.weight.detach()
    assert w.shape == (500, 300)
    assert w.abs().max() <= 3 * std + 1e-7
    # a normal truncated at ±3σ has std 0.9866σ
    assert w.std().item() == pytest.approx(0.9866 * std, rel=0.02)
    assert w.mean().abs().item() < 0.01 * std * 10
    emb = Embedding(1000, 64).weight.detach()
    assert emb.abs().max() <= 3.0 + 1e-6
    assert emb.std().item() == pytest.approx(0.9866, rel=0.02)
    assert torch.equal(RMSNorm(16).weight.detach(), torch.ones(16))
    # the LM uses the same init: q_proj std sqrt(2/(d+d)), lm_head sqrt(2/(V+d))
    model = small_model()
    assert model.layers[0].attn.q_proj.weight.abs().max() <= 3 * math.sqrt(2 / 64) + 1e-7
    assert model.lm_head.weight.abs().max() <= 3 * math.sqrt(2 / (97 + 32)) + 1e-7
    assert model.token_embeddings.weight.std().item() > 0.8


# ------------------------------------------------------------- modules vs equations ---


def test_linear_and_embedding_compute_their_equations():
    torch.manual_seed(0)
    lin = Linear(5, 3)
    x = torch.randn(2, 4, 5)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    emb = Embedding(10, 6)
    ids = torch.tensor([[3, 0, 9], [9, 9, 1]])
    torch.testing.assert_close(emb(ids), emb.weight[ids])


def test_rmsnorm_against_formula_and_torch():
    torch.manual_seed(0)
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(3, 5, 8) * 4
    by_formula = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), by_formula)
    if hasattr(F, "rms_norm"):
        torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, eps=1e-5))
    # a hand example: x = (3, 4): mean(x²) = 12.5, rms = sqrt(12.5 + 1e-5)
    n2 = RMSNorm(2)
    out = n2(torch.tensor([3.0, 4.0])).tolist()
    assert out == pytest.approx([3 / math.sqrt(12.50001), 4 / math.sqrt(12.50001)], rel=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_rms_normalize_is_the_equation_in_float32_bit_for_bit(monkeypatch, fused):
    # torch's fused kernel where this torch has it, the equation written out otherwise
    from ferrolm.lm import model as M

    if fused and not M._HAS_RMS_NORM:
        pytest.skip("this torch has no F.rms_norm")
    monkeypatch.setattr(M, "_HAS_RMS_NORM", fused)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 9, 64, generator=g) * 3, torch.rand(64, generator=g) + 0.5
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(M.rms_normalize(x, w, 1e-5), x * inv_rms * w)
    assert torch.equal(M.rms_normalize(x, None, 1e-5), x * inv_rms)
    # QK-norm's equation (a division by the RMS) to rounding; in bf16 to one unit in the last place
    torch.testing.assert_close(M.rms_normalize(x, None, 1e-5), functional.qk_norm(x, 1e-5))
    xb = x.bfloat16()
    out = M.rms_normalize(xb, None, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, functional.qk_norm(xb, 1e-5), atol=0, rtol=2**-7)
    # and its gradient is the equation's
    xg = x.double().requires_grad_()
    (M.rms_normalize(xg, w.double(), 1e-5) * torch.arange(64.0, dtype=torch.float64)).sum().backward()
    xr = x.double().requires_grad_()
    (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double() * torch.arange(64.0)).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_normalize_gradient_path_is_the_equation(weighted, dtype):
    # with a gradient on a CPU the written-out backward (_RMSNormalize): the forward bit for
    # bit as without one, the gradients autograd's through the equation
    from ferrolm.lm import model as M

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 7, 64, generator=g) * 3).to(dtype)
    w = torch.rand(64, generator=g) + 0.5 if weighted else None
    up = torch.randn(5, 7, 64, generator=g).to(dtype)
    with torch.no_grad():
        plain = M.rms_normalize(x, w, 1e-5)
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_() if weighted else None
    out = M.rms_normalize(xg, wg, 1e-5)
    assert out.grad_fn is not None and "RMSNormalize" in type(out.grad_fn).__name__
    assert out.dtype == dtype and torch.equal(out, plain)
    (out.float() * up.float()).sum().backward()
    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_() if weighted else None
    ref = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5)
    ((ref * wr if weighted else ref) * up.double()).sum().backward()
    tol = {} if dtype == torch.float32 else {"atol": 0, "rtol": 2**-7}
    torch.testing.assert_close(xg.grad, xr.grad.to(dtype), **tol)
    if weighted:
        torch.testing.assert_close(wg.grad, wr.grad.float(), rtol=1e-4, atol=1e-4)
    # a float64 input stays float64 through it
    x64 = x.double().requires_grad_()
    M.rms_normalize(x64, None, 1e-5).sum().backward()
    assert x64.grad.dtype == torch.float64


def test_rmsnorm_computes_in_float32_and_casts_back():
    torch.manual_seed(0)
    norm = RMSNorm(64)
    x = (torch.randn(4, 64) * 100).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    expected = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(out, expected)


def test_swiglu_and_silu_ffn_against_formula():
    torch.manual_seed(0)
    ffn = SwiGLU(8, 12)
    x = torch.randn(2, 3, 8)
    w1, w2, w3 = ffn.w1.weight, ffn.w2.weight, ffn.w3.weight
    assert w1.shape == w3.shape == (12, 8) and w2.shape == (8, 12)
    expected = (functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
    torch.testing.assert_close(ffn(x), expected)
    plain = SiLUFFN(8, 18)
    torch.testing.assert_close(plain(x), functional.silu(x @ plain.w1.weight.T) @ plain.w2.weight.T)


def _rope_by_rotation_matrices(x: torch.Tensor, positions: list[int], theta: float) -> torch.Tensor:
    """RoPE written as the block-diagonal rotation matrix R_i applied to each x_i."""
    seq, d = x.shape
    out = torch.empty_like(x)
    for i, pos in enumerate(positions):
        R = torch.zeros(d, d, dtype=x.dtype)
        for k in range(d // 2):
            angle = pos * theta ** (-2 * k / d)
            c, s = math.cos(angle), math.sin(angle)
            R[2 * k, 2 * k], R[2 * k, 2 * k + 1] = c, -s
            R[2 * k + 1, 2 * k], R[2 * k + 1, 2 * k + 1] = s, c
        out[i] = R @ x[i]
    return out


def test_rope_against_rotation_matrices():
    rope = RotaryEmbedding(10000.0, 8, 32)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    positions = [0, 1, 7, 30, 3]
    expected = _rope_by_rotation_matrices(x, positions, 10000.0)
    torch.testing.assert_close(rope(x, torch.tensor(positions)), expected, atol=1e-6, rtol=1e-5)
    # default positions are 0..seq-1; position 0 is the identity
    torch.testing.assert_close(rope(x), _rope_by_rotation_matrices(x, list(range(5)), 10000.0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rope(x)[0], x[0])
    assert rope(x.float()).dtype == torch.float32
    # any memory layout: a slice at an odd offset, a transposed view
    wide = torch.randn(5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(rope(wide[:, 1:9]), _rope_by_rotation_matrices(wide[:, 1:9], list(range(5)), 10000.0))
    torch.testing.assert_close(rope(x.T.contiguous().T), rope(x))
    # offset shifts the default positions; the table's end is enforced
    torch.testing.assert_close(rope(x, offset=3), rope(x, torch.arange(3, 8)))
    with pytest.raises(ValueError, match="RoPE table"):
        rope(x, offset=28)
    # a hand example: d=2, theta irrelevant for k=0 (angle = pos): rotate (1, 0) by 1 radian
    r2 = RotaryEmbedding(10000.0, 2, 4)
    assert r2(torch.tensor([[1.0, 0.0]]), torch.tensor([1])).tolist()[0] == pytest.approx(
        [math.cos(1), math.sin(1)], abs=1e-6
    )


def test_rope_dot_product_depends_only_on_distance():
    rope = RotaryEmbedding(10000.0, 16, 64)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)

    def score(m: int, n: int) -> float:
        qm = rope(q[None], torch.tensor([m]))[0]
        kn = rope(k[None], torch.tensor([n]))[0]
        return float(qm @ kn)

    for m, n in [(0, 3), (5, 5), (10, 2), (40, 13)]:
        for shift in (1, 7, 20):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
    assert score(0, 3) != pytest.approx(score(0, 9), abs=1e-3)  # but it does depend on the distance


def test_rope_positions_broadcast_over_heads_and_batch():
    rope = RotaryEmbedding(10000.0, 8, 16)
    x = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(2))  # (batch, heads, seq, d)
    pos = torch.tensor([[0, 1, 2, 3, 4], [4, 6, 8, 10, 12]])  # (batch, seq)
    out = rope(x, pos)
    for b in range(2):
        for h in range(3):
            torch.testing.assert_close(out[b, h], rope(x[b, h], pos[b]))
    torch.testing.assert_close(rope(x, pos[0]), rope(x))  # (seq,) positions == default
    assert "cos" not in rope.state_dict() and "sin" not in rope.state_dict()


def _attention_by_hand(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Per-head loop over the literal equation, with RoPE as rotation matrices."""
    batch, seq, d = x.shape
    H, dh = attn.num_heads, attn.d_head
    Q, K, V = x @ attn.q_proj.weight.T, x @ attn.k_proj.weight.T, x @ attn.v_proj.weight.T
    heads = []
    for h in range(H):
        sl = slice(h * dh, (h + 1) * dh)
        outs = []
        for b in range(batch):
            q, k, v = Q[b, :, sl], K[b, :, sl], V[b, :, sl]
            if attn.rope is not None:
                q = _rope_by_rotation_matrices(q, list(range(seq)), attn.rope.theta)
                k = _rope_by_rotation_matrices(k, list(range(seq)), attn.rope.theta)
            scores = q @ k.T / math.sqrt(dh)
            scores = scores + torch.full((seq, seq), float("-inf"), dtype=x.dtype).triu(1)
            outs.append(torch.softmax(scores, -1) @ v)
        heads.append(torch.stack(outs))
    return torch.cat(heads, dim=-1) @ attn.output_proj.weight.T


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_attention_against_per_head_equation(path):
    torch.manual_seed(0)
    rope = RotaryEmbedding(10000.0, 8, 16, device=None)
    attn = CausalSelfAttention(32, 4, rope, attention=path).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(attn(x), _attention_by_hand(attn, x))
    no_rope = CausalSelfAttention(32, 4, None, attention=path).double()
    torch.testing.assert_close(no_rope(x), _attention_by_hand(no_rope, x))


def test_fast_and_reference_attention_give_the_same_model():
    fast = small_model(3)
    ref = small_model(3, attention="reference")
    ref.load_state_dict(fast.state_dict())
    ids = random_ids(3, 20)
    torch.testing.assert_close(fast(ids), ref(ids), atol=1e-5, rtol=1e-5)
    # gradients too
    lf = functional.cross_entropy(fast(ids[:, :-1]), ids[:, 1:])
    lr = functional.cross_entropy(ref(ids[:, :-1]), ids[:, 1:])
    lf.backward()
    lr.backward()
    for (n, a), b in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("seq", [2, 31, 32, 33, 70])
def test_block_causal_attention_equals_the_equation_and_its_gradients(seq):
    from ferrolm.lm.block_attention import BlockCausalAttention

    gen = torch.Generator().manual_seed(seq)
    q, k, v, grad = (torch.randn(2, 3, seq, 16, generator=gen) for _ in range(4))
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    got = run(BlockCausalAttention.apply)
    want = run(lambda *t: functional.scaled_dot_product_attention(*(x.double() for x in t), mask).float())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("width", ["AVX2", "AVX-512"])
def test_block_causal_attention_trains_on_avx2_cpus_only(monkeypatch, width):
    # AVX2 only: there it beat torch's flash kernel; other CPUs keep torch's
    from ferrolm.lm import block_attention

    monkeypatch.setattr(block_attention, "cpu_vector_width", lambda: width)
    calls = []
    real = block_attention.BlockCausalAttention.apply
    monkeypatch.setattr(block_attention.BlockCausalAttention, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4, RotaryEmbedding(10000.0, 8, 40))
    x = torch.randn(2, 40, 32, requires_grad=True)
    out = attn(x)
    assert len(calls) == (1 if width == "AVX2" else 0)
    out.backward(torch.ones_like(out))
    exact = attn.double()
    xd = x.detach().double().requires_grad_()
    want = _attention_by_hand(exact, xd)
    want.backward(torch.ones_like(want))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), xd.grad, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # generation keeps torch's kernel (no probabilities kept)
        attn.float()(x)
    assert len(calls) == (1 if width == "AVX2" else 0)


def test_pre_norm_block_equation():
    torch.manual_seed(0)
    block = TransformerBlock(16, 2, 24)
    x = torch.randn(1, 5, 16)
    h = x + block.attn(block.ln1(x))
    torch.testing.assert_close(block(x), h + block.ffn(block.ln2(h)))
    post = TransformerBlock(16, 2, 24, norm_position="post")
    h = post.ln1(x + post.attn(x))
    torch.testing.assert_close(post(x), post.ln2(h + post.ffn(h)))


# ------------------------------------------------------------- gradients --------------


def test_gradcheck_float64_rmsnorm_rope_attention_swiglu():
    torch.manual_seed(0)
    gc = torch.autograd.gradcheck
    norm = RMSNorm(6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert gc(lambda t, g: _with_weight(norm, g)(t), (x, norm.weight.detach().clone().requires_grad_()))

    rope = RotaryEmbedding(100.0, 6, 8).double()
    assert gc(lambda t: rope(t, torch.tensor([0, 3, 7])), (x,))

    x12 = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    for path in ("fast", "reference"):
        attn = CausalSelfAttention(12, 2, rope, attention=path).double()  # d_head 6
        assert gc(attn, (x12,))

    ffn = SwiGLU(6, 5).double()
    assert gc(ffn, (x,))
    # and the weights of SwiGLU
    assert gc(
        lambda w1: F.linear(F.silu(F.linear(x, w1)) * ffn.w3(x), ffn.w2.weight),
        (ffn.w1.weight.detach().clone().requires_grad_(),),
    )


def _with_weight(norm: RMSNorm, g: torch.Tensor) -> RMSNorm:
    clone = RMSNorm(norm.d_model, norm.eps)
    del clone.weight
    clone.weight = g  # a plain tensor so gradcheck can differentiate through it
    return clone


# ------------------------------------------------------------- LM properties ----------


@pytest.mark.parametrize(
    "ablation",
    [
        {},
        {"attention": "reference"},
        {"positions": "none"},
        {"norm_position": "post"},
        {"norm": "none"},
        {"ffn": "silu"},
    ],
)
def test_causality_later_tokens_never_change_earlier_logits(ablation):
    model = small_model(4, **ablation)
    ids = random_ids(2, 16, seed=5)
    base = model(ids)
    for t in (0, 7, 14):
        changed = ids.clone()
        changed[:, t + 1 :] = random_ids(2, 16 - t - 1, seed=6 + t)
        assert not torch.equal(changed, ids)
        out = model(changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=1e-6, rtol=0)
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])


def test_without_positions_the_prefix_order_does_not_matter():
    # One layer of causal attention without positions sees its prefix as a set: permuting
    # the tokens before the last leaves the last logits unchanged. RoPE makes order matter.
    # (With more layers each prefix position's own prefix changes, so this is 1-layer only.)
    ids = random_ids(1, 12)
    shuffled = torch.cat([ids[:, :11].flip(1), ids[:, 11:]], dim=1)
    nope = small_model(6, positions="none", num_layers=1)
    assert [n for n, _ in nope.named_buffers()] == []
    torch.testing.assert_close(nope(shuffled)[0, -1], nope(ids)[0, -1], atol=1e-5, rtol=0)
    rope_model = small_model(6, num_layers=1)
    assert not torch.allclose(rope_model(shuffled)[0, -1], rope_model(ids)[0, -1], atol=1e-3)
    # explicit token_positions equal to the defaults change nothing; others do
    torch.testing.assert_close(rope_model(ids, token_positions=torch.arange(12)), rope_model(ids))
    assert not torch.allclose(rope_model(ids, token_positions=torch.arange(12) * 2), rope_model(ids))


def test_lm_rejects_bad_input():
    model = small_model()
    with pytest.raises(ValueError, match="context_length"):
        model(random_ids(1, 25))
    with pytest.raises(ValueError, match="batch, seq"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        TransformerLM(10, 8, 30, 1, 4, 16)
    with pytest.raises(ValueError, match="norm"):
        TransformerLM(10, 8, 32, 1, 4, 16, norm="batch")


def test_config_round_trip():
    cfg = ModelConfig(**SMALL, ffn="silu", tie_embeddings=True)
    model = TransformerLM.from_config(cfg)
    assert model.config == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert all(isinstance(v, (int, float, str, bool)) for v in cfg.to_dict().values())
    assert TransformerLM(**SMALL).config == ModelConfig(**SMALL)
    with pytest.raises(ValueError, match="unknown"):
        ModelConfig.from_dict({**SMALL, "dropout_rate": 0.1})


# ------------------------------------------------------------- KV cache ---------------


@pytest.mark.parametrize(
    "ablation",
    [
        {},
        {"attention": "reference"},
        {"positions": "none"},
        {"num_kv_heads": 2, "qk_norm": True},
        {"num_kv_heads": 1, "attention": "reference"},
        {"value_embeds": True, "x0_mix": True, "num_kv_heads": 2},
    ],
)
def test_kv_cache_stepwise_equals_full_recomputation(ablation):
    model = small_model(7, **ablation)
    ids = random_ids(3, 20, seed=8)
    with torch.no_grad():
        full = model(ids)
        cache = model.make_kv_cache(batch_size=3)
        kv_heads = ablation.get("num_kv_heads", 4)
        assert cache.keys[0].shape == (3, kv_heads, 24, 8) and cache.length == 0
        pieces = [model(ids[:, :5], kv_cache=cache)]  # prefill 5 positions
        assert cache.length == 5
        for t in range(5, 12):  # decode one at a time
            pieces.append(model(ids[:, t : t + 1], kv_cache=cache))
        pieces.append(model(ids[:, 12:20], kv_cache=cache))  # a chunk after the prefix
        assert cache.length == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "ablation",
    [
        {},
        {"attention": "reference"},
        {"positions": "none"},
        {"value_embeds": True, "x0_mix": True, "logit_softcap": 3.0},
    ],
)
def test_kv_cache_rows_at_their_own_positions_get_their_own_logits(ablation):
    # Continuous batching: each row of one step at its own length, seeing only its own slots.
    model = small_model(11, **ablation)
    lengths = [3, 9, 1, 14]
    seqs = [random_ids(1, n + 1, seed=20 + n)[0] for n in lengths]
    with torch.no_grad():
        cache = model.make_kv_cache(len(seqs))
        for b, s in enumerate(seqs):  # each prompt alone into its own row; the rows' tails hold garbage
            model(s[:-1].view(1, -1), kv_cache=cache.rows(b, b + 1), start_pos=0)
        for keys in cache.keys:
            keys[0, :, lengths[0] :] = 1e4  # a stale slot past a row's length must never be seen
        last = torch.stack([s[-1:] for s in seqs])
        out = model(last, kv_cache=cache, start_pos=torch.tensor(lengths))
        for b, s in enumerate(seqs):
            torch.testing.assert_close(out[b, -1], model(s.view(1, -1))[0, -1], atol=1e-5, rtol=0)
        for keys, values in zip(cache.keys, cache.values):  # each new key went to its row's slot
            assert all(keys[b, :, n].abs().sum() > 0 for b, n in enumerate(lengths))
        same = model(last[:2], kv_cache=cache.rows(0, 2), start_pos=torch.tensor([5, 5]))
        assert same.shape == (2, 1, model.config.vocab_size)  # equal positions: the plain path
        with pytest.raises(ValueError, match="one new token per row"):
            model(torch.cat([last, last], dim=1), kv_cache=cache, start_pos=torch.tensor(lengths))


def test_kv_cache_stores_rotated_keys_and_can_be_reset():
    model = small_model(9)
    ids = random_ids(1, 6)
    with torch.no_grad():
        cache = model.make_kv_cache(1, max_seq_len=8)
        model(ids, kv_cache=cache)
        attn = model.layers[0].attn
        x = model.layers[0].ln1(model.token_embeddings(ids))
        k = attn.k_proj(x).view(1, 6, 4, 8).transpose(1, 2)
        torch.testing.assert_close(cache.keys[0][:, :, :6], attn.rope(k, torch.arange(6)))
        assert cache.keys[0][:, :, 6:].abs().sum() == 0
        cache.reset()
        again = model(ids, kv_cache=cache)
        torch.testing.assert_close(again, model(ids))
        with pytest.raises(ValueError, match="do not fit"):
            model(random_ids(1, 3), kv_cache=cache)  # 6 + 3 > 8
        with pytest.raises(ValueError, match="batch"):
            model(random_ids(2, 1), kv_cache=cache, start_pos=0)
    with pytest.raises(ValueError, match="context_length"):
        model.make_kv_cache(1, max_seq_len=25)


# ------------------------------------------------------------- dtype / autocast -------


def test_cpu_bfloat16_autocast_forward_backward():
    model = small_model(11)
    ids = random_ids(2, 16)
    ref = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        loss = functional.cross_entropy(logits[:, :-1], ids[:, 1:])
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert (logits.float() - ref).abs().max() < 0.1 * ref.abs().max()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model.make_kv_cache(2, dtype=torch.bfloat16)
        model(ids[:, :8], kv_cache=cache)
        step = model(ids[:, 8:9], kv_cache=cache)
    assert torch.isfinite(step).all()


def test_model_in_bfloat16_parameters():
    model = small_model(12).to(torch.bfloat16)
    out = model(random_ids(2, 8))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert model.layers[0].attn.rope.cos.dtype == torch.float32  # tables stay float32


# ------------------------------------------------------------- accounting -------------


@pytest.mark.parametrize(
    "ablation",
    [
        {},
        {"tie_embeddings": True},
        {"norm": "none"},
        {"ffn": "silu"},
        {"ffn": "relu2", "d_ff_ungated": 50},
        {"positions": "none", "norm_position": "post"},
        {"num_kv_heads": 2, "qk_norm": True, "logit_softcap": 15.0, "zero_init_output": True},
        {"value_embeds": True, "x0_mix": True, "num_kv_heads": 2},
    ],
)
def test_count_parameters_equals_numel(ablation):
    cfg = ModelConfig(**SMALL, **ablation)
    model = TransformerLM.from_config(cfg)
    assert count_parameters(cfg) == model.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("ffn", ["silu", "relu2"])
def test_ungated_ffns_are_parameter_matched(ffn):
    cfg = ModelConfig(**{**SMALL, "d_ff": 1344, "d_model": 512})
    ungated = ModelConfig(**{**SMALL, "d_ff": 1344, "d_model": 512, "ffn": ffn})
    assert ungated.ffn_hidden == 2016  # 3/2 x 1344: two matrices of 2016 = three of 1344
    assert count_parameters(cfg) == count_parameters(ungated)
    assert ModelConfig(**{**SMALL, "ffn": ffn, "d_ff_ungated": 40}).ffn_hidden == 40
    # configs saved before the rename read as the same model
    assert ModelConfig.from_dict({**SMALL, "ffn": ffn, "d_ff_silu": 40}).ffn_hidden == 40


def test_tinystories_shape_accounting_by_hand():
    # vocab 10,000, context 256, d 512, 4 layers, 16 heads, d_ff 1,344
    cfg = ModelConfig(10_000, 256, 512, 4, 16, 1344)
    per_layer = 4 * 512 * 512 + 3 * 512 * 1344 + 2 * 512  # 1,048,576 + 2,064,384 + 1,024 = 3,113,984
    assert per_layer == 3_113_984
    assert count_parameters(cfg) == 2 * 5_120_000 + 4 * 3_113_984 + 512 == 22_696_448
    # forward FLOPs/token: 2 * (4 * (1,048,576 + 2,064,384) + 5,120,000) + 4 * 4 * 256 * 512
    #                    = 2 * 17,571,840 + 2,097,152 = 37,240,832
    assert flops_per_token(cfg) == 37_240_832
    assert flops_per_token(cfg, seq_len=128) == 2 * 17_571_840 + 4 * 4 * 128 * 512
    # short_window 64 in layers 0-2 (pattern "SSSL"): their attention counts 64 positions each
    short = ModelConfig(10_000, 256, 512, 4, 16, 1344, short_window=64)
    assert short.short_window_layers == [0, 1, 2]
    assert flops_per_token(short) == 2 * 17_571_840 + 2 * 2 * (3 * 64 + 256) * 512
    assert flops_per_token(short, seq_len=32) == flops_per_token(cfg, seq_len=32)  # shorter than the window


# ------------------------------------------------------------- HF parity --------------


@pytest.mark.slow
def test_logits_equal_hf_llama_with_converted_weights():
    """Independent check of the whole stack: HF's LlamaForCausalLM with our weights.

    HF rotates halves (x[i], x[i + d/2]) where we rotate pairs (x[2i], x[2i+1]), so each
    head's q/k rows are permuted (evens, then odds) in the conversion.
    """
    transformers = pytest.importorskip("transformers")
    model = small_model(13)
    c = SMALL
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["d_model"],
        intermediate_size=c["d_ff"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_heads"],
        max_position_embeddings=c["context_length"],
        rms_norm_eps=1e-5,
        rope_theta=c["rope_theta"],
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    new = to_hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(new, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    ids = random_ids(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_rope_real_form_equals_complex_form():
    # the form used under torch.compile (inductor has no complex codegen) is the same map
    from ferrolm.lm.model import rotate_pairs_real

    rope = RotaryEmbedding(10000.0, 8, 16)
    x = torch.randn(2, 3, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(rotate_pairs_real(x, rope.cos.double(), rope.sin.double()), rope(x))


def test_hf_export_refuses_an_ablation_it_cannot_map():
    model = TransformerLM(64, 16, 32, 1, 4, 64, ffn="silu")
    with pytest.raises(ValueError, match="model.ffn = 'silu'.*cannot be exported"):
        to_hf_state_dict(model)
    for ablation in (
        {"norm": "none"},
        {"norm_position": "post"},
        {"positions": "none"},
        {"value_embeds": True},
        {"x0_mix": True},
    ):
        with pytest.raises(ValueError, match=f"model.{next(iter(ablation))}"):
            to_hf_state_dict(TransformerLM(64, 16, 32, 1, 4, 64, **ablation))
    tied = to_hf_state_dict(TransformerLM(64, 16, 32, 1, 4, 64, tie_embeddings=True))
    assert "lm_head.weight" not in tied  # HF ties it to model.embed_tokens.weight


@pytest.mark.parametrize("ablation", [{}, dict(tie_embeddings=True)])
def test_targets_give_the_cross_entropy_of_the_logits_and_its_gradients(ablation):
    a, b = small_model(**ablation).train(), small_model(**ablation).train()
    x, y = random_ids(3, 20), random_ids(3, 20, seed=2)
    want = functional.cross_entropy(a(x), y)
    want.backward()
    got = b(x, targets=y)
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(b(x, targets=y), want.detach(), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------- torch.compile ----------


def _loss_of(model, fused_head: bool = True):
    """The training loss (LM head fused with the loss, as the loop runs it) or, with
    ``fused_head=False``, the cross-entropy of the full logits."""

    def loss(x, y):
        return model(x, targets=y) if fused_head else functional.cross_entropy(model(x), y)

    return loss


@pytest.mark.parametrize("fused_head", [True, False])
@pytest.mark.parametrize(
    "ablation",
    [
        {},
        dict(norm="none", positions="none", ffn="silu", tie_embeddings=True),
        dict(ffn="relu2", qk_norm=True, value_embeds=True, x0_mix=True, logit_softcap=15.0, num_kv_heads=2),
    ],
)
def test_model_and_loss_trace_as_one_graph(ablation, fused_head):
    # a graph break would split the step into several compiled pieces with Python between
    torch._dynamo.reset()
    model = small_model(**ablation).train()
    x, y = random_ids(2, 16), random_ids(2, 16, seed=2)
    explanation = torch._dynamo.explain(_loss_of(model, fused_head))(x, y)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("fused_head", [True, False])
def test_compiled_step_equals_eager_forward_and_backward(fused_head):
    # aot_eager traces exactly what inductor receives (the real-arithmetic RoPE, the
    # custom losses' backward) without generating C++: the same numbers as eager
    torch._dynamo.reset()
    eager, compiled = small_model().train(), small_model().train()
    x, y = random_ids(3, 20), random_ids(3, 20, seed=2)
    loss_eager = _loss_of(eager, fused_head)(x, y)
    loss_eager.backward()
    loss_compiled = torch.compile(_loss_of(compiled, fused_head), backend="aot_eager", fullgraph=True)(x, y)
    loss_compiled.backward()
    torch.testing.assert_close(loss_compiled, loss_eager, atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


# ------------------------------------------------------------- switches ---------------


def test_every_switch_is_off_by_default_and_adds_no_state_dict_key():
    cfg = ModelConfig(**SMALL)
    switches = ("num_kv_heads", "qk_norm", "logit_softcap", "zero_init_output", "doc_mask", "value_embeds", "x0_mix")
    assert [getattr(cfg, name) for name in switches] == [0, False, 0.0, False, False, False, False]
    plain = small_model().state_dict()
    on = small_model(num_kv_heads=2, qk_norm=True, logit_softcap=30.0, zero_init_output=True, doc_mask=True)
    assert list(on.state_dict()) == list(plain)
    # the two switches that add parameters add only their own keys
    more = small_model(num_kv_heads=2, value_embeds=True, x0_mix=True).state_dict()
    assert set(more) - set(plain) == {"residual_scales", "x0_scales", "value_embeddings.1.weight"}
    assert set(plain) <= set(more)
    assert on.state_dict()["layers.0.attn.k_proj.weight"].shape == (16, 32)  # 2 heads x d_head 8
    for bad, message in (
        ({"num_kv_heads": 3}, r"model.num_kv_heads \(3\) must divide model.num_heads \(4\)"),
        ({"logit_softcap": -1.0}, "model.logit_softcap must be >= 0"),
        ({"ffn": "gelu"}, "model.ffn must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            ModelConfig(**SMALL, **bad)


def _switched_attention_by_hand(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """The attention equation written per head: query head h reads key/value head
    h // (H / H_kv); with qk_norm, q and k are divided by their RMS after RoPE."""
    seq, H, Hkv, dh = x.shape[1], attn.num_heads, attn.num_kv_heads, attn.d_head
    pos = torch.arange(seq)
    heads = []
    for h in range(H):
        g = h // (H // Hkv)
        outs = []
        for b in range(x.shape[0]):
            q = x[b] @ attn.q_proj.weight[h * dh : (h + 1) * dh].T
            k = x[b] @ attn.k_proj.weight[g * dh : (g + 1) * dh].T
            v = x[b] @ attn.v_proj.weight[g * dh : (g + 1) * dh].T
            q, k = attn.rope(q, pos), attn.rope(k, pos)
            if attn.qk_norm:
                q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + attn.eps)
                k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + attn.eps)
            scores = q @ k.T / math.sqrt(dh) + torch.full((seq, seq), float("-inf"), dtype=x.dtype).triu(1)
            outs.append(torch.softmax(scores, -1) @ v)
        heads.append(torch.stack(outs))
    return torch.cat(heads, dim=-1) @ attn.output_proj.weight.T


@pytest.mark.parametrize("path", ["fast", "reference"])
@pytest.mark.parametrize("kv_heads,qk_norm", [(2, False), (1, False), (4, True), (2, True)])
def test_grouped_query_attention_and_qk_norm_against_the_per_head_equation(path, kv_heads, qk_norm):
    torch.manual_seed(0)
    rope = RotaryEmbedding(10000.0, 8, 16)
    attn = CausalSelfAttention(32, 4, rope, attention=path, num_kv_heads=kv_heads, qk_norm=qk_norm).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(attn(x), _switched_attention_by_hand(attn, x))


def test_qk_norm_after_rope_equals_before_rope():
    # RoPE rotates pairs, which keeps a head's norm: normalizing after it (ferrolm) equals
    # normalizing before it (Qwen3's order) -- what lets the export carry this switch.
    rope = RotaryEmbedding(10000.0, 8, 16)
    q = torch.randn(2, 3, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(16)
    torch.testing.assert_close(functional.qk_norm(rope(q, pos)), rope(functional.qk_norm(q), pos))


def test_relu_squared_ffn_against_formula():
    torch.manual_seed(0)
    ffn = ReLU2FFN(16, 24).double()
    x = torch.randn(3, 16, dtype=torch.float64)
    hidden = x @ ffn.w1.weight.T
    want = (torch.where(hidden > 0, hidden, torch.zeros_like(hidden)) ** 2) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), want)
    model = small_model(ffn="relu2")
    assert isinstance(model.layers[0].ffn, ReLU2FFN) and model.layers[0].ffn.w1.weight.shape == (72, 32)
    # its gradient, written out in the FFN, against autograd through the equation
    h = (torch.randn(5, 24, dtype=torch.float64) * 2).requires_grad_()
    g = torch.randn(5, 24, dtype=torch.float64)
    (want_grad,) = torch.autograd.grad(functional.relu_squared(h), h, g)
    (got_grad,) = torch.autograd.grad(_ReLUSquared.apply(h), h, g)
    torch.testing.assert_close(got_grad, want_grad)
    assert torch.autograd.gradcheck(_ReLUSquared.apply, (h,))


def test_logit_softcap_caps_the_logits_and_the_loss_uses_the_capped_logits():
    plain, capped = small_model(4).train(), small_model(4, logit_softcap=2.0).train()
    x, y = random_ids(2, 12), random_ids(2, 12, seed=3)
    z = plain(x)
    torch.testing.assert_close(capped(x), 2.0 * torch.tanh(z / 2.0))
    assert capped(x).abs().max() < 2.0 < z.abs().max()
    want = F.cross_entropy((2.0 * torch.tanh(z / 2.0)).flatten(0, 1), y.flatten())
    got = capped(x, targets=y)
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    for (name, p), q in zip(capped.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_zero_init_output_makes_every_block_the_identity():
    model = small_model(5, zero_init_output=True)
    plain = small_model(5)
    for layer, ref in zip(model.layers, plain.layers):
        assert layer.attn.output_proj.weight.abs().sum() == 0 and layer.ffn.w2.weight.abs().sum() == 0
        torch.testing.assert_close(layer.attn.q_proj.weight, ref.attn.q_proj.weight)  # the rest as before
    ids = random_ids(2, 10)
    torch.testing.assert_close(model(ids), model.lm_head(model.ln_final(model.token_embeddings(ids))))


def test_document_ids_mask_attention_to_each_document():
    model = small_model(6, doc_mask=True)
    eos = 0
    first, second = [eos, 5, 9, 13, 2], [eos, 7, 7, 3, 40, 11]
    row = torch.tensor([first + second])
    docs = functional.document_ids(row, eos)
    assert docs.tolist() == [[1] * 5 + [2] * 6]
    with torch.no_grad():
        masked = model(row, document_ids=docs)
        # each document's logits are those of the document alone (RoPE sees only distances)
        torch.testing.assert_close(masked[0, :5], model(torch.tensor([first]))[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(masked[0, 5:], model(torch.tensor([second]))[0], atol=1e-5, rtol=0)
        assert not torch.allclose(model(row)[0, 5:], masked[0, 5:], atol=1e-4)  # unmasked, the first leaks in
        ref = small_model(6, doc_mask=True, attention="reference")
        torch.testing.assert_close(ref(row, document_ids=docs), masked, atol=1e-5, rtol=0)
        y = torch.tensor([first[1:] + second + [eos]])
        torch.testing.assert_close(
            model(row, targets=y, document_ids=docs), functional.cross_entropy(masked, y), atol=1e-6, rtol=0
        )
    with pytest.raises(ValueError, match="document_ids must be"):
        model(row, document_ids=docs[:, :3])


@pytest.mark.parametrize("num_layers,layers", [(1, [0]), (2, [1]), (3, [0, 2]), (4, [1, 3]), (5, [0, 2, 4])])
def test_value_embeddings_sit_in_the_last_layer_and_every_second_before_it(num_layers, layers):
    cfg = ModelConfig(**{**SMALL, "num_layers": num_layers}, value_embeds=True, num_kv_heads=2)
    assert cfg.value_embed_layers == layers
    model = TransformerLM.from_config(cfg)
    assert sorted(model.value_embeddings) == [str(i) for i in layers]
    assert all(table.weight.shape == (SMALL["vocab_size"], 16) for table in model.value_embeddings.values())
    assert ModelConfig(**SMALL).value_embed_layers == []


def test_value_embeds_and_x0_mix_against_the_equations_by_hand():
    """Three layers, written out: block i reads a_i x + b_i x0, and layers 0 and 2 (the
    last and every second before it) attend over values x W_V^T + E_v[ids]."""
    model = small_model(8, num_layers=3, value_embeds=True, x0_mix=True).double()
    with torch.no_grad():  # scalars away from their (1, 0) start, so the mix matters
        model.residual_scales.copy_(torch.tensor([0.9, 1.2, 0.7]))
        model.x0_scales.copy_(torch.tensor([0.3, -0.5, 0.25]))
    ids = random_ids(2, 11)
    seq = ids.shape[1]
    x = x0 = model.token_embeddings.weight[ids]
    for i, layer in enumerate(model.layers):
        x = model.residual_scales[i] * x + model.x0_scales[i] * x0
        attn, h = layer.attn, layer.ln1(x)

        def heads(t, d_head=attn.d_head):
            return t.view(2, seq, -1, d_head).transpose(1, 2)

        q, k, v = h @ attn.q_proj.weight.T, h @ attn.k_proj.weight.T, h @ attn.v_proj.weight.T
        if i in (0, 2):
            v = v + model.value_embeddings[str(i)].weight[ids]
        pos = torch.arange(seq)
        q, k, v = attn.rope(heads(q), pos), attn.rope(heads(k), pos), heads(v)
        mixed = functional.scaled_dot_product_attention(q, k, v, torch.ones(seq, seq).tril().bool())
        x = x + mixed.transpose(1, 2).reshape(2, seq, -1) @ attn.output_proj.weight.T
        x = x + layer.ffn(layer.ln2(x))
    want = model.ln_final(x) @ model.lm_head.weight.T
    torch.testing.assert_close(model(ids), want)
    assert "1" not in model.value_embeddings
    torch.testing.assert_close(functional.x0_mix(x, x0, 2.0, 0.5), 2.0 * x + 0.5 * x0)


def test_x0_mix_gradients_written_out_equal_autograd_through_the_equation():
    g = torch.Generator().manual_seed(7)
    x, x0, out_grad = (torch.randn(2, 5, 8, dtype=torch.float64, generator=g) for _ in range(3))
    a, b = torch.tensor(0.8, dtype=torch.float64), torch.tensor(-0.3, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, x0, a, b)]
    got = _X0Mix.apply(*leaves)
    mine = torch.autograd.grad(got, leaves, out_grad)
    ref_leaves = [t.clone().requires_grad_() for t in (x, x0, a, b)]
    want = functional.x0_mix(*ref_leaves)
    theirs = torch.autograd.grad(want, ref_leaves, out_grad)
    torch.testing.assert_close(got, want)
    for m, t in zip(mine, theirs):
        torch.testing.assert_close(m, t)
    assert torch.autograd.gradcheck(_X0Mix.apply, tuple(t.clone().requires_grad_() for t in (x, x0, a, b)))


def test_x0_mix_starts_as_the_plain_residual_and_value_embeds_train():
    plain, mixed = small_model(3), small_model(3, x0_mix=True)
    ids = random_ids(2, 9)
    torch.testing.assert_close(mixed(ids), plain(ids))  # a = 1, b = 0: the same model
    model = small_model(3, value_embeds=True, x0_mix=True).train()
    model(ids, targets=random_ids(2, 9, seed=4)).backward()
    for name in ("value_embeddings.1.weight", "residual_scales", "x0_scales"):
        assert dict(model.named_parameters())[name].grad.abs().sum() > 0, name

"""Micro-benchmarks behind ferrolm.lm.model's implementation choices (CPU, forward+backward).

Each choice is timed at the CS336 TinyStories shape (batch 8, context 256, d_model 512,
16 heads, vocab 10,000) on one thread, by process CPU time (min of --reps), so the
numbers stay meaningful on a busy machine:

- RoPE: the complex product (ferrolm's eager form) vs the real 2x2 rotation of
  interleaved pairs (ferrolm's form under torch.compile) vs HF's rotate-half;
- cross-entropy: ferrolm.lm.functional.cross_entropy vs autograd through logsumexp+gather
  vs torch's F.cross_entropy;
- Q, K, V projections: three GEMMs (ferrolm) vs one GEMM on the concatenated weight.

    python benches/bench_model_ops.py [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ferrolm.lm import functional
from ferrolm.lm.model import RotaryEmbedding, rotate_pairs_real


def cpu_ms(fn, inputs, reps):
    best = float("inf")
    for _ in range(reps):
        xs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        c0 = time.process_time()
        out = fn(*xs)
        out.backward(torch.ones_like(out))
        best = min(best, time.process_time() - c0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    B, T, H, dh, V = 8, 256, 16, 32, 10_000
    D = H * dh
    rows = []

    rope = RotaryEmbedding(10000.0, dh, T)
    cos, sin = rope.cos, rope.sin
    q = torch.randn(B, T, H, dh)  # as it comes out of the projection, viewed per head

    def rope_half(x):
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
        return x * c + torch.cat((-x2, x1), -1) * s

    rows.append(("RoPE, complex product (ferrolm eager)", cpu_ms(lambda x: rope(x.transpose(1, 2)), [q], args.reps)))
    rows.append(
        (
            "RoPE, real pair rotation (ferrolm compiled)",
            cpu_ms(lambda x: rotate_pairs_real(x.transpose(1, 2), cos, sin), [q], args.reps),
        )
    )
    rows.append(("RoPE, rotate-half (HF Llama)", cpu_ms(lambda x: rope_half(x.transpose(1, 2)), [q], args.reps)))

    logits = torch.randn(B * T, V)
    targets = torch.randint(0, V, (B * T,))

    def ce_autograd(x):
        return (torch.logsumexp(x, -1) - x.gather(-1, targets[:, None]).squeeze(-1)).mean()

    rows.append(
        (
            "cross-entropy, ferrolm.lm.functional",
            cpu_ms(lambda x: functional.cross_entropy(x, targets), [logits], args.reps),
        )
    )
    rows.append(("cross-entropy, autograd logsumexp+gather", cpu_ms(ce_autograd, [logits], args.reps)))
    rows.append(("cross-entropy, F.cross_entropy", cpu_ms(lambda x: F.cross_entropy(x, targets), [logits], args.reps)))

    x = torch.randn(B, T, D)
    wq, wk, wv = (torch.randn(D, D) * D**-0.5 for _ in range(3))

    def separate(x, a, b, c):
        return F.linear(x, a) + F.linear(x, b) + F.linear(x, c)

    def fused(x, a, b, c):
        q, k, v = F.linear(x, torch.cat([a, b, c])).chunk(3, dim=-1)
        return q + k + v

    rows.append(("Q,K,V: three GEMMs (ferrolm)", cpu_ms(separate, [x, wq, wk, wv], args.reps)))
    rows.append(("Q,K,V: one GEMM on concatenated weight", cpu_ms(fused, [x, wq, wk, wv], args.reps)))

    qa, ka, va = (torch.randn(B, H, T, dh) for _ in range(3))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    rows.append(
        (
            "attention, F.scaled_dot_product_attention is_causal",
            cpu_ms(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), [qa, ka, va], args.reps),
        )
    )
    rows.append(
        (
            "attention, functional (literal softmax(QK^T/sqrt d + M) V)",
            cpu_ms(lambda a, b, c: functional.scaled_dot_product_attention(a, b, c, causal), [qa, ka, va], args.reps),
        )
    )
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        rows.append(
            (
                "attention, SDPA math backend",
                cpu_ms(
                    lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), [qa, ka, va], args.reps
                ),
            )
        )

    print(f"# torch {torch.__version__}, 1 thread, min of {args.reps}, forward+backward, CPU ms")
    print("| operation | CPU ms |")
    print("|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()

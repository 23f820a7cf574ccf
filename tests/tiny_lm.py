"""A tiny language model fitted to a bit of Python's standard-library prose in a second:
a ferrolm tokenizer trained on the text, a TransformerLM trained a few dozen AdamW steps
on it (so its greedy choices are clear, not near-ties of a random model), and a checkpoint
whose config names the tokenizer folder, as `ferrolm train` writes it."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import torch


def stdlib_text() -> str:
    """Prose from the standard library's own docstrings (the same on every install of a version)."""
    import argparse
    import collections
    import json
    import logging

    docs = [inspect.getdoc(m) or "" for m in (argparse, collections, json, logging, textwrap)]
    return "\n\n".join(docs)


def tiny_run(
    root, *, steps: int = 40, vocab_size: int = 320, d_ff: int = 64, tie_embeddings: bool = False, **model_switches
):
    """(checkpoint path, tokenizer, text) under ``root``."""
    from ferrolm import Tokenizer
    from ferrolm.lm.checkpoint import save_checkpoint
    from ferrolm.lm.model import TransformerLM

    root = Path(root)
    text = stdlib_text()
    tok = Tokenizer.train(iter([text]), vocab_size, ["<|endoftext|>"], progress=False)
    tokdir = tok.save(root / "tok")
    torch.manual_seed(0)
    model = TransformerLM(
        tok.vocab_size,
        64,
        32,
        2,
        4,
        d_ff,
        rope_theta=10_000.0,
        tie_embeddings=tie_embeddings,
        **model_switches,
    )
    ids = torch.tensor(tok.encode(text))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=g)
        x = torch.stack([ids[s : s + 64] for s in starts])
        y = torch.stack([ids[s + 1 : s + 65] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    ckpt = root / "tiny.pt"
    config = {"model": model.config.to_dict(), "data": {"tokenizer": str(tokdir)}}
    save_checkpoint(model, None, steps, ckpt, config=config, tokenizer_fingerprint=tok.fingerprint)
    return ckpt, tok, text

"""Write small shard files (.bin + .json per the shard contract) with numpy, for tests."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np

FP = "ab" * 32  # a fake tokenizer fingerprint (64 hex digits)


def write_shard(prefix, tokens, vocab_size=256, eos_id=0, fingerprint=FP, part=None, dtype=None, num_documents=None):
    """Write PREFIX.bin and PREFIX.json (or PREFIX.part-I-of-N.* when part=(I, N)); return the prefix written."""
    prefix = Path(prefix)
    if part is not None:
        prefix = prefix.with_name(f"{prefix.name}.part-{part[0]}-of-{part[1]}")
    dtype = dtype or ("uint16" if vocab_size <= 65536 else "uint32")
    arr = np.asarray(tokens, dtype="<u2" if dtype == "uint16" else "<u4")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    arr.tofile(prefix.with_name(prefix.name + ".bin"))
    meta = {
        "format": "ferrolm-shard",
        "format_version": 1,
        "dtype": dtype,
        "num_tokens": int(arr.size),
        "num_documents": int(
            num_documents
            if num_documents is not None
            else (np.count_nonzero(arr == eos_id) if eos_id is not None else 0)
        ),
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer_fingerprint": fingerprint,
        "inputs": [{"path": "synthetic.txt", "bytes": int(arr.size), "sha256": "00" * 32}],
        "part": list(part) if part is not None else None,
        "byte_range": None,
        "ferrolm_version": "test",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    prefix.with_name(prefix.name + ".json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return prefix


def synthetic_corpus(n_tokens, vocab_size=64, seed=0, eos_id=0):
    """A learnable token stream: short repeating 'documents' of a few patterns, eos-separated."""
    rng = np.random.default_rng(seed)
    patterns = [rng.integers(1, vocab_size, size=rng.integers(5, 12)) for _ in range(8)]
    out = []
    while sum(len(p) for p in out) < n_tokens:
        out.append(patterns[rng.integers(len(patterns))])
        out.append(np.array([eos_id]))
    return np.concatenate(out)[:n_tokens]


def trained_run(root, model: dict, steps: int = 4, vocab_size: int = 400):
    """A real pipeline in miniature under ``root``: a ferrolm tokenizer trained on generated
    stories (tests/texts.py), train/val shards encoded with it, a model trained ``steps``
    steps whose config names the tokenizer folder. Returns (run_dir, tokenizer, val prefix)."""
    from texts import stories_text

    from ferrolm import Tokenizer
    from ferrolm.bpe import shards
    from ferrolm.lm.config import TrainConfig
    from ferrolm.lm.train import train

    root = Path(root)
    text = stories_text(330_000)
    (root / "train.txt").write_text(text[:300_000], encoding="utf-8")
    (root / "val.txt").write_text(text[300_000:330_000], encoding="utf-8")
    tok = Tokenizer.train(str(root / "train.txt"), vocab_size, ["<|endoftext|>"], progress=False)
    tokdir = tok.save(root / "tok")
    for name in ("train", "val"):
        shards.encode(tok, [root / f"{name}.txt"], root / name, progress=False)
    cfg = TrainConfig()
    cfg.update(
        {
            "model": {"vocab_size": tok.vocab_size, **model},
            "data": {"train": str(root / "train"), "val": str(root / "val"), "tokenizer": str(tokdir)},
            "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
            "schedule": {"max_steps": steps, "warmup_steps": 1, "batch_size": 2},
            "run": {
                "out_dir": str(root / "run"),
                "device": "cpu",
                "autocast_bf16": False,
                "eval_every": steps,
                "eval_batches": 1,
                "log_every": steps,
                "checkpoint_every": steps,
                "progress": False,
                "num_threads": 1,
            },
        }
    )
    train(cfg.validate())
    return root / "run", tok, root / "val"

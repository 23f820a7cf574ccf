"""ferrolm: from raw text to a trained language model.

A Rust byte-level BPE tokenizer (trainer, encoder, shard writer) and a readable
PyTorch Transformer LM with its own training loop and sampler.

The tokenizer side imports without torch; the model side (``ferrolm.model``,
``ferrolm.optim``, ``ferrolm.train`` ...) imports torch when first used.
"""

from __future__ import annotations

from ferrolm._core import version as _core_version

__version__ = _core_version()

__all__ = ["__version__", "Tokenizer", "train_bpe"]


def __getattr__(name: str):
    # Lazy so `import ferrolm` stays fast and never pulls in torch.
    if name == "Tokenizer":
        from ferrolm.tokenizer import Tokenizer

        return Tokenizer
    if name == "train_bpe":
        from ferrolm.bpe_trainer import train_bpe

        return train_bpe
    raise AttributeError(f"module 'ferrolm' has no attribute {name!r}")

"""The language-model side: a Transformer LM in PyTorch and what trains and samples it.

- ``model``: the Transformer and its parts
- ``functional``: softmax, SiLU, cross-entropy and attention written out
- ``optim``: AdamW, Muon, the cosine and warmup-stable-decay schedules, gradient clipping
- ``data``: token shards as training batches
- ``config``: the training config (TOML) and its presets
- ``train``: the training loop
- ``checkpoint``: saving and resuming
- ``generate``: sampling
"""

"""The language-model side: a Transformer LM in PyTorch and what trains and samples it.

- ``model``: the Transformer and its parts
- ``functional``: softmax, SiLU, cross-entropy and attention written out
- ``optim``: AdamW, Muon, the cosine and warmup-stable-decay schedules, gradient clipping
- ``data``: token shards as training batches
- ``config``: the training config (TOML) and its presets
- ``train``: the training loop
- ``memory``: the memory a training configuration needs, checked before allocating
- ``checkpoint``: saving and resuming; ``load_model`` for inference
- ``decoding``: a decoding step's rules: sampling from logits, tokens to text
- ``engine``: the one decoding loop (continuous batching; in the calling thread or its own)
- ``generate``: sampling for library users, on the engine
"""

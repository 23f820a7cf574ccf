"""The language-model side: a Transformer LM in PyTorch and what trains, samples, scores and
exports it.

- ``model``: the Transformer and its parts
- ``functional``: softmax, SiLU, cross-entropy and attention written out
- ``block_attention``: the training attention by blocks of queries (AVX2 CPUs)
- ``gemm``: torch's BLAS or oneDNN for the float32 CPU matrices
- ``device``: which device a name means, and what runs fastest on it
- ``optim``: AdamW, Muon, the cosine and warmup-stable-decay schedules, gradient clipping
- ``data``: token shards as training batches
- ``chat`` and ``conversations``: chat tokens and rendering; conversations as training data
- ``config``: the training config (TOML) and its presets
- ``train``: the training loop
- ``sharding``: FSDP2 sharding of the model over processes
- ``memory``: the memory a training configuration needs, checked before allocating
- ``metrics``: where a run's records go
- ``checkpoint``: saving and resuming; ``load_model`` for inference
- ``decoding``: a decoding step's rules: sampling from logits, tokens to text
- ``engine``: the one decoding loop (continuous batching; in the calling thread or its own)
- ``generate``: sampling for library users, on the engine
- ``evaluate`` and ``harness``: scoring on token shards; a model for lm-evaluation-harness
- ``export``, ``hf``, ``hf_remote`` and ``gguf_export``: Hugging Face and GGUF exports
"""

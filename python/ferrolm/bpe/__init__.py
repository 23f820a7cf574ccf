"""The tokenizer side: byte-level BPE training, encoding, files and shards.

Nothing here imports torch (tests/test_package.py checks it with torch blocked).

- ``tokenizer``: ``Tokenizer``, backed by the Rust core
- ``trainer``: ``train_bpe`` and the trainer behind ``Tokenizer.train``
- ``reference``: the same trainer and tokenizer in pure Python (the ground truth)
- ``files``: tokenizer directories (vocab.json, merges.txt and ferrolm's own record)
- ``patterns``: the built-in pre-tokenization patterns
- ``shards``: text to token shards (``NAME.bin`` + ``NAME.json``)
"""

"""``ferrolm.ray``: the tokenizer's work on Ray (``ferrolm.bpe.ray``), under its short name.

import ferrolm.ray
ferrolm.ray.encode("tok/", ["owt_train.txt"], "data/owt", parts=64)
"""

from ferrolm.bpe.ray import DEFAULT_MAX_RETRIES, RAY_EXTRA, encode, init, manifest_path, train_tokenizer

__all__ = ["DEFAULT_MAX_RETRIES", "RAY_EXTRA", "encode", "init", "manifest_path", "train_tokenizer"]

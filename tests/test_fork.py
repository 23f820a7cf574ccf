"""Fork safety: a process forked after ferrolm used its worker threads (multiprocessing's
default start method on Linux, PyTorch DataLoader workers) encodes and trains in
parallel without hanging, and gets the parent's results."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import numpy as np
import pytest

from ferrolm import Tokenizer
from ferrolm.bpe import shards

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs fork() (Linux)")

EOT = "<|endoftext|>"
WORDS = "the cat sat on a mat while seven dogs ran far away from home tonight".split()


def _docs(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(40 + i % 30)) for i in range(n)]


# Set in the parent before the fork; the child inherits it.
_TOK: Tokenizer | None = None


def _child_work(tmp: str) -> tuple[list[list[int]], list[int], list[int], int]:
    tok = _TOK
    assert tok is not None
    docs = _docs(3000)
    batch = tok.encode_batch(docs, num_threads=2)
    default = tok.encode_batch(docs)
    big = EOT.join(docs * 4)  # over 1 MB: encoded in parallel
    arr = tok.encode_to_numpy(big)
    path = os.path.join(tmp, "corpus.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(big)
    shards.encode(tok, [path], os.path.join(tmp, "child"), progress=False)
    written = np.fromfile(os.path.join(tmp, "child.bin"), dtype=np.uint16).tolist()
    retrained = Tokenizer.train(iter(docs), 300, [EOT], num_threads=2, progress=False)
    return batch + default, arr.tolist(), written, len(retrained.merges)


def test_forked_child_encodes_and_trains_in_parallel(tmp_path):
    global _TOK
    docs = _docs(3000)
    tok = Tokenizer.train(iter(docs), 300, [EOT], num_threads=2, progress=False)
    _TOK = tok
    # The parent uses its worker pools first: the child must not inherit them as they are.
    expected_batch = tok.encode_batch(docs, num_threads=2)
    assert tok.encode_batch(docs) == expected_batch
    big = EOT.join(docs * 4)
    expected_ids = tok.encode_to_numpy(big).tolist()
    assert len(big) > 1 << 20 and expected_ids == tok.encode(big)

    with mp.get_context("fork").Pool(1) as pool:
        result = pool.apply_async(_child_work, (str(tmp_path),))
        try:
            batch, arr, written, n_merges = result.get(timeout=60)
        except mp.TimeoutError:
            pool.terminate()
            pytest.fail("the forked child hung in a parallel ferrolm call")
    assert batch == expected_batch + expected_batch
    assert arr == expected_ids
    assert written == expected_ids + tok.encode(EOT)  # the last document gets its end-of-text
    assert n_merges == len(tok.merges)

"""Shared test fixtures: paths to ../shared data and peers built offline.

Tests that need the shared corpora or fixtures skip with a clear reason when absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ferrolm.bpe import patterns

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("FERROLM_SHARED", REPO.parent / "shared"))
FIXTURES = SHARED / "fixtures"
CORPORA = SHARED / "corpora"


def shared_file(relpath: str) -> Path:
    """Path of a file under ../shared, or skip the test saying what is missing."""
    path = SHARED / relpath
    if not path.exists():
        pytest.skip(f"shared data not present: {path} (set FERROLM_SHARED to the shared/ folder)")
    return path


def corpus_files() -> list[Path]:
    """Every corpus text under ../shared/corpora (empty when absent)."""
    if not CORPORA.is_dir():
        return []
    return sorted(CORPORA.rglob("*.txt"))


@pytest.fixture(scope="session")
def gpt2_vocab_merges():
    """(vocab, merges) of GPT-2 read from the fixtures in ferrolm's types; <|endoftext|> is id 50256."""
    from ferrolm.bpe.files import read_merges, read_vocab

    vocab = read_vocab(shared_file("fixtures/gpt2_vocab.json"), ["<|endoftext|>"])
    merges = read_merges(shared_file("fixtures/gpt2_merges.txt"))
    return vocab, merges


@pytest.fixture(scope="session")
def tiktoken_gpt2(gpt2_vocab_merges):
    """tiktoken's GPT-2 Encoding built offline from the fixture files (no download)."""
    tiktoken = pytest.importorskip("tiktoken")
    vocab, _ = gpt2_vocab_merges
    ranks = {b: i for i, b in vocab.items() if i != 50256}
    return tiktoken.Encoding(
        "gpt2-offline", pat_str=patterns.GPT2, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
    )

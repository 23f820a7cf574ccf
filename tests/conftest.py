"""Shared test fixtures: the GPT-2 tokenizer from the data files under tests/fixtures, and
peers built offline. The suite reads no data from outside the repository (see texts.py for
the corpora the tests use).
"""

from __future__ import annotations

import pytest
from texts import fixture_file

from ferrolm.bpe import patterns

#: Appended to a skip for a missing package: every test dependency is in the test extra.
INSTALL_HINT = 'pip install ".[test]" installs every package the tests use'


def _with_install_hint(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        path, line, reason = report.longrepr
        if "could not import" in reason and INSTALL_HINT not in reason:
            report.longrepr = (path, line, f"{reason} ({INSTALL_HINT})")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _with_install_hint(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _with_install_hint(outcome.get_result())


@pytest.fixture(scope="session")
def gpt2_vocab_merges():
    """(vocab, merges) of GPT-2 read from the fixtures in ferrolm's types; <|endoftext|> is id 50256."""
    from ferrolm.bpe.files import read_merges, read_vocab

    vocab = read_vocab(fixture_file("gpt2_vocab.json"), ["<|endoftext|>"])
    merges = read_merges(fixture_file("gpt2_merges.txt"))
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


@pytest.fixture(scope="module")
def _single_thread():
    """One intra-op torch thread for a module's tests, restored after: tiny tensors run faster on one
    thread, and spin-waiting threads crawl on a busy machine. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("_single_thread")``."""
    import torch  # here, not at the top: the tests that never touch torch do not pay for loading it

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

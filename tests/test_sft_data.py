"""Conversations as training data: reading (JSON Lines, .gz, .zst, Parquet, iterables), the
bad-row report and its threshold, cropping, masked best-fit packing, its state, the fixed
validation rows, and the loss over the assistant's tokens only."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_lm import stdlib_text

from ferrolm import Tokenizer
from ferrolm.lm import functional
from ferrolm.lm.chat import add_chat_tokens, render
from ferrolm.lm.conversations import (
    ConversationData,
    ConversationDataError,
    is_conversation_source,
    read_conversations,
)
from ferrolm.lm.data import BatchPrefetcher, ConversationRows, masked_targets, packed_rows
from ferrolm.lm.model import TransformerLM

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    base = Tokenizer.train(iter([stdlib_text()]), 300, ["<|endoftext|>"], progress=False)
    return add_chat_tokens(base)


def chat(q: str, a: str, system: str | None = None) -> dict:
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if system is not None:
        msgs.insert(0, {"role": "system", "content": system})
    return {"messages": msgs}


CHATS = [chat("What is 2 + 3?", "5"), chat("Reverse: abc", "cba", system="Be brief."), chat("Hi", "Hello there")]


def write_jsonl(path, rows, opener=open) -> None:
    with opener(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def expected_arrays(tok, rows):
    ids, mask = [], []
    for r in rows:
        i, m = render(tok, r["messages"] if isinstance(r, dict) else r)
        ids += i
        mask += m
    return ids, mask


# ------------------------------------------------------------------- reading ------------


def test_jsonl_rows_render_as_chat_render_does(tok, tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [CHATS[0], "", CHATS[1]["messages"], CHATS[2]])  # a blank line, a bare list
    data = read_conversations(tmp_path / "c.jsonl", tok, row_len=1000)
    ids, mask = expected_arrays(tok, CHATS)
    assert data.ids.tolist() == ids and data.mask.tolist() == mask
    lengths = [len(render(tok, c["messages"])[0]) for c in CHATS]
    assert data.offsets.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert (data.kept, data.bad, data.cropped) == (3, 0, 0)
    assert data.ids.dtype == np.uint32 and data.mask.dtype == np.uint8 and data.offsets.dtype == np.int64


def test_gz_zst_parquet_folders_and_iterables_read_the_same(tok, tmp_path):
    write_jsonl(tmp_path / "a.jsonl.gz", CHATS, opener=gzip.open)
    zstandard = pytest.importorskip("zstandard")
    with zstandard.open(tmp_path / "b.jsonl.zst", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(c) + "\n" for c in CHATS))
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"messages": [c["messages"] for c in CHATS], "id": [1, 2, 3]}), tmp_path / "c.parquet")
    ids, mask = expected_arrays(tok, CHATS)
    for source in (tmp_path / "a.jsonl.gz", str(tmp_path / "b.jsonl.zst"), tmp_path / "c.parquet", iter(CHATS)):
        data = read_conversations(source, tok, row_len=1000)
        assert data.ids.tolist() == ids and data.mask.tolist() == mask, source
    both = read_conversations([str(tmp_path / "a.jsonl.gz"), str(tmp_path / "c.parquet")], tok, row_len=1000)
    assert both.kept == 6 and both.ids.tolist() == ids + ids
    folder = read_conversations(tmp_path, tok, row_len=1000)  # every file below, sorted
    assert folder.kept == 9 and folder.paths == sorted(str(p) for p in tmp_path.iterdir())
    assert read_conversations([c["messages"] for c in CHATS], tok, row_len=1000).kept == 3  # a list of conversations


def test_a_parquet_file_without_messages_is_named(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "t.parquet")
    with pytest.raises(ConversationDataError, match=r"t\.parquet: has no 'messages' column \(columns: text\)"):
        read_conversations(tmp_path / "t.parquet", tok, row_len=100)


def test_conversation_sources_are_told_from_shards_by_name(tmp_path):
    for name in ("a.jsonl", "a.JSONL.gz", "a.ndjson.zst", "a.parquet"):
        assert is_conversation_source(name), name
    for name in ("data/train", "train.bin", "train", "train.json"):  # a .json is a shard sidecar or manifest
        assert not is_conversation_source(name), name
    assert is_conversation_source(["a.jsonl", "b.parquet"]) and not is_conversation_source(["a.jsonl", "shards/x"])
    assert is_conversation_source(iter(CHATS)) and is_conversation_source([CHATS[0]["messages"]])


BAD_ROWS = [
    "{not json",
    {"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "x"}]},
    {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
    {"messages": []},
    {"text": "no messages"},
]


def test_malformed_rows_are_counted_and_named_by_file_and_row(tok, tmp_path):
    rows = CHATS * 200 + BAD_ROWS[:1]  # 1 bad row of 601: under 1 %
    write_jsonl(tmp_path / "c.jsonl", rows)
    data = read_conversations(tmp_path / "c.jsonl", tok, row_len=1000)
    assert (data.kept, data.bad) == (600, 1)
    assert data.bad_rows == [
        f"{tmp_path / 'c.jsonl'}:601: not valid JSON (Expecting property name enclosed in double quotes at column 2)"
    ]
    assert "1 malformed row(s) skipped" in data.summary("data.train") and data.report("train")["train_bad_rows"] == 1
    with pytest.raises(
        ConversationDataError, match=r"1 of 601 rows are not usable conversations; data.max_bad_share = 0 allows 0:\n"
    ):
        read_conversations(tmp_path / "c.jsonl", tok, row_len=1000, max_bad_share=0)


def test_too_many_bad_rows_refuse_listing_the_first_ten_and_counting_all(tok, tmp_path):
    rows = [CHATS[0]] + BAD_ROWS * 3  # 18 bad of 19
    write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(ConversationDataError) as e:
        read_conversations(tmp_path / "c.jsonl", tok, row_len=1000, name="data.train")
    msg = str(e.value)
    where = tmp_path / "c.jsonl"
    assert msg.startswith("data.train: 18 of 19 rows are not usable conversations; data.max_bad_share = 0.01 allows 0:")
    for line in (
        f"{where}:2: not valid JSON",
        f"{where}:3: message 0 has no role",
        f"{where}:4: roles out of order at message 0 (assistant)",
        f"{where}:5: message 0 (user) has a int content, not a string",
        f"{where}:6: the conversation is empty",
        f"{where}:7: the row has no 'messages' list",
    ):
        assert line in msg
    assert msg.count(f"{where}:") == 10 and msg.endswith("... and 8 more")
    assert read_conversations(tmp_path / "c.jsonl", tok, row_len=1000, max_bad_share=1).kept == 1
    write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    with pytest.raises(ConversationDataError, match="holds no conversation"):
        read_conversations(tmp_path / "bad.jsonl", tok, row_len=1000, max_bad_share=1)
    with pytest.raises(ConversationDataError, match=r"conversations:2: message 0 has no role"):
        read_conversations(iter([CHATS[0], BAD_ROWS[1]]), tok, row_len=1000, max_bad_share=0)


def test_conversations_longer_than_a_row_are_cropped_and_counted(tok):
    long = chat("tell me " * 50, "ok " * 50)
    data = read_conversations(iter([CHATS[0], long]), tok, row_len=32)
    assert data.cropped == 1 and data.lengths().tolist() == [len(render(tok, CHATS[0]["messages"])[0]), 32]
    assert data.ids[data.offsets[1] :].tolist() == render(tok, long["messages"])[0][:32]
    assert "1 longer than a row, cropped to it" in data.summary("data.train")


# ------------------------------------------------------------------- packing ------------


def literal_data(lengths, eos=0) -> ConversationData:
    """Conversation i: [eos, 10 i + 1, 10 i + 2, ...] with mask 1 on its second half."""
    ids, mask = [], []
    for i, n in enumerate(lengths):
        ids += [eos] + [10 * i + j for j in range(1, n)]
        mask += [0] * (n - n // 2) + [1] * (n // 2)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return ConversationData(
        np.array(ids, np.uint32), np.array(mask, np.uint8), offsets, ["literal"], eos, 100, "f" * 64
    )


def test_packing_takes_the_longest_that_fits_then_pads_with_a_masked_eos():
    data = literal_data([5, 4])  # A = [0 1 2 3 4], B = [0 11 12 13]
    rows = ConversationRows(
        data, batch_size=1, context_length=7, generator=torch.Generator().manual_seed(0), buffer_size=2
    )
    ids, mask = rows.next_rows()
    # A (the longest), then B does not fit in the 3 left: padding, the end-of-text id with mask 0
    assert ids.tolist() == [[0, 1, 2, 3, 4, 0, 0, 0]]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 0]]
    assert (rows.real, rows.total) == (5, 8)
    two = ConversationRows(literal_data([5, 3]), 2, 7, torch.Generator().manual_seed(0), buffer_size=2)
    ids, mask = two.next_rows()  # each row: A then B, filled exactly
    assert ids.tolist() == [[0, 1, 2, 3, 4, 0, 11, 12]] * 2 and mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 1]] * 2
    assert two.real == two.total == 16


def test_packed_rows_hold_whole_conversations_with_their_masks():
    data = literal_data([6, 2, 3, 7, 4, 5], eos=99)
    rows = ConversationRows(data, 8, 11, torch.Generator().manual_seed(3), buffer_size=3)
    for _ in range(5):
        ids, mask = rows.next_rows()
        for r in range(len(ids)):
            at, row = 0, ids[r].tolist()
            while any(t != 99 for t in row[at:]):  # conversation i opens with 99, 10 i + 1
                i = (row[at + 1] - 1) // 10
                a, b = int(data.offsets[i]), int(data.offsets[i + 1])
                assert row[at : at + b - a] == data.ids[a:b].tolist()
                assert mask[r, at : at + b - a].tolist() == data.mask[a:b].tolist()
                at += b - a
            assert all(t == 99 for t in row[at:]) and not mask[r, at:].any()  # the rest is masked padding


def test_padding_is_a_small_share_of_best_fit_rows():
    rng = np.random.default_rng(0)
    data = literal_data(rng.integers(10, 60, size=3000).tolist())
    rows = ConversationRows(data, 16, 256, torch.Generator().manual_seed(1), buffer_size=1000)
    for _ in range(20):
        rows.next_rows()
    assert rows.real / rows.total >= 0.97


def test_the_loader_state_replays_the_same_rows_through_the_prefetcher():
    data = literal_data(np.random.default_rng(2).integers(3, 14, size=40).tolist())
    straight = ConversationRows(data, 3, 15, torch.Generator().manual_seed(7), buffer_size=8)
    expected = [straight.next_rows() for _ in range(30)]  # several passes over the 40
    pre = BatchPrefetcher(None, 3, 15, "cpu", rows=ConversationRows(data, 3, 15, torch.Generator().manual_seed(7), 8))
    try:
        got = [pre.next_counted() for _ in range(12)]
        state = pre.loader_state()  # before batch 12, although it is already built
    finally:
        pre.close()
    for (x, y, n), (ids, mask) in zip(got, expected):
        assert torch.equal(x, torch.from_numpy(ids[:, :-1]))
        want = np.where(mask[:, 1:] == 1, ids[:, 1:], functional.IGNORE_INDEX)
        assert torch.equal(y, torch.from_numpy(want)) and n == int(mask[:, 1:].sum())
    other = ConversationRows(data, 3, 15, torch.Generator().manual_seed(99), buffer_size=8)
    assert not np.array_equal(other.next_rows()[0], expected[0][0])
    other.set_state(state)
    for ids, mask in expected[12:]:
        got_ids, got_mask = other.next_rows()
        assert np.array_equal(got_ids, ids) and np.array_equal(got_mask, mask)
    with pytest.raises(ValueError, match="buffer of 9 conversations"):
        ConversationRows(data, 3, 15, torch.Generator(), buffer_size=9).set_state(state)


def test_validation_rows_are_fixed_in_order_and_padded():
    data = literal_data([5, 3, 4, 2, 7], eos=0)
    ids, mask = packed_rows(data, 7)  # rows of 8: [A B] [C D pad pad] [E pad]
    assert ids.tolist() == [
        [0, 1, 2, 3, 4, 0, 11, 12],
        [0, 21, 22, 23, 0, 31, 0, 0],
        [0, 41, 42, 43, 44, 45, 46, 0],
    ]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0]]
    assert packed_rows(data, 7, max_rows=2)[0].shape == (2, 8)


def test_masked_targets_ignore_what_the_mask_turns_off():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 0]], dtype=torch.uint8)
    x, y = masked_targets(ids, mask)
    assert x.tolist() == [[5, 6, 7, 8]] and y.tolist() == [[-100, 7, 8, -100]]
    assert ids.tolist() == [[5, 6, 7, 8, 9]]  # the rows themselves are left as they were (validation reuses them)


# ------------------------------------------------------------------- masked loss --------


@pytest.mark.parametrize("cap, smoothing", [(0.0, 0.0), (5.0, 0.0), (0.0, 0.1), (5.0, 0.1)])
def test_linear_cross_entropy_leaves_out_ignored_targets_in_loss_and_gradients(cap, smoothing):
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    t[::3] = functional.IGNORE_INDEX
    loss = functional.linear_cross_entropy(h, w, t, chunk_rows=8, softcap_at=cap, label_smoothing=smoothing)
    loss.backward()
    got = (loss.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    logits = h @ w.T
    logits = functional.softcap(logits, cap) if cap else logits
    kept = t != functional.IGNORE_INDEX
    logp = torch.log_softmax(logits[kept], -1)  # over kept positions only
    by_hand = (-(1 - smoothing) * logp.gather(-1, t[kept, None]) - smoothing * logp.mean(-1, keepdim=True)).mean()
    by_hand.backward()
    torch.testing.assert_close(got[0], by_hand.detach())
    torch_loss = F.cross_entropy(logits.detach(), t, label_smoothing=smoothing)  # torch's ignore_index is -100 too
    torch.testing.assert_close(got[0], torch_loss)
    torch.testing.assert_close(got[1], h.grad)
    torch.testing.assert_close(got[2], w.grad)
    assert got[1][~kept].abs().max() == 0


def test_all_targets_ignored_is_a_zero_loss_and_gradient():
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    loss = functional.linear_cross_entropy(h, w, torch.full((6,), functional.IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_the_models_loss_on_a_masked_row_is_the_mean_over_assistant_positions(tok):
    torch.manual_seed(0)
    model = TransformerLM(tok.vocab_size, 64, 32, 2, 2, 64, rope_theta=10_000.0)
    ids, mask = render(tok, CHATS[1]["messages"])
    x, y = masked_targets(torch.tensor([ids]), torch.tensor([mask]))
    with torch.no_grad():
        loss = model(x, targets=y)
        logp = torch.log_softmax(model(x)[0].double(), -1)
    positions = [i for i in range(len(ids) - 1) if mask[i + 1]]  # predicting an assistant token or its end
    assert positions and len(positions) < len(ids) - 1
    by_hand = -sum(float(logp[i, ids[i + 1]]) for i in positions) / len(positions)
    assert loss.item() == pytest.approx(by_hand, rel=1e-5)

"""ferrolm.lm.data: get_batch windows and TokenShards over shard files written per the contract."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from shard_util import FP, write_shard

from ferrolm.lm.data import ShardError, TokenShards, get_batch, tokenizer_fingerprint

# ------------------------------------------------------------------- get_batch ----------


def test_get_batch_shapes_shift_and_dtype():
    tokens = np.arange(100, dtype=np.uint16)
    x, y = get_batch(tokens, batch_size=8, context_length=10, device="cpu")
    assert x.shape == y.shape == (8, 10)
    assert x.dtype == y.dtype == torch.int64
    # arange data: each row is consecutive and targets are inputs + 1
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)


def test_get_batch_starts_cover_exactly_the_allowed_range():
    # starts must be uniform over [0, n - context - 1] inclusive: with n=12, T=3 that is 0..8.
    tokens = np.arange(12)
    g = torch.Generator().manual_seed(0)
    x, _ = get_batch(tokens, batch_size=4000, context_length=3, device="cpu", generator=g)
    starts = x[:, 0].numpy()
    assert starts.min() == 0 and starts.max() == 8
    counts = np.bincount(starts, minlength=9)
    assert len(counts) == 9
    # each of 9 starts expected 444.4 times; a non-uniform sampler would be far off
    assert counts.min() > 360 and counts.max() < 530


def test_get_batch_matches_cs336_statistics():
    # The CS336 check: starts over a 100-token arange, T=7 -> mean ~ 46, std ~ 26.8 (uniform 0..92).
    dataset = np.arange(0, 100)
    g = torch.Generator().manual_seed(1)
    starts = np.concatenate([get_batch(dataset, 32, 7, "cpu", generator=g)[0][:, 0].numpy() for _ in range(100)])
    assert starts.max() <= 100 - 7 - 1
    assert abs(starts.mean() - 46) < 1.5
    assert abs(starts.std() - np.sqrt((93**2 - 1) / 12)) < 1.5


def test_get_batch_is_reproducible_with_a_generator_and_accepts_tensors():
    tokens = np.random.default_rng(0).integers(0, 1000, size=500)
    a = get_batch(tokens, 4, 16, "cpu", generator=torch.Generator().manual_seed(5))
    b = get_batch(torch.from_numpy(tokens), 4, 16, "cpu", generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = get_batch(tokens, 4, 16, "cpu", generator=torch.Generator().manual_seed(6))
    assert not torch.equal(a[0], c[0])


def test_get_batch_invalid_device_raises():
    tokens = np.arange(100)
    with pytest.raises(RuntimeError):
        get_batch(tokens, 2, 4, device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            get_batch(tokens, 2, 4, device="cuda:99")


def test_get_batch_too_short_raises():
    with pytest.raises(ValueError, match="context_length \\+ 1"):
        get_batch(np.arange(8), 2, 8, "cpu")
    # exactly one window: the only start is 0
    x, y = get_batch(np.arange(9), 3, 8, "cpu")
    assert torch.equal(x, torch.arange(8).repeat(3, 1)) and torch.equal(y, torch.arange(1, 9).repeat(3, 1))


def test_get_batch_on_memmap(tmp_path):
    arr = np.arange(1000, dtype=np.uint16)
    arr.tofile(tmp_path / "t.bin")
    mm = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    x, y = get_batch(mm, 5, 32, "cpu")
    assert torch.equal(y, x + 1)


# ------------------------------------------------------------------- TokenShards -------


def test_single_shard_by_prefix_json_and_bin(tmp_path):
    toks = np.arange(500) % 256
    prefix = write_shard(tmp_path / "train", toks)
    for src in (prefix, f"{prefix}.json", f"{prefix}.bin", str(prefix)):
        s = TokenShards(src)
        assert len(s) == 500
        assert s.vocab_size == 256 and s.eos_id == 0 and s.fingerprint == FP and s.dtype == "uint16"
        assert np.array_equal(s[:], toks)
        assert isinstance(s._parts[0].tokens, np.memmap), "shards must be memory-mapped, not read into RAM"


def test_parts_are_concatenated_in_part_order_and_slices_cross_parts(tmp_path):
    chunks = [np.arange(i * 100, i * 100 + 100) for i in range(3)]
    # written out of order on purpose: part order, not directory order, decides
    for i in (2, 0, 1):
        write_shard(tmp_path / "web", chunks[i], vocab_size=1000, part=(i, 3))
    s = TokenShards(tmp_path / "web")
    whole = np.concatenate(chunks)
    assert len(s) == 300
    assert np.array_equal(s[:], whole)
    assert np.array_equal(s[95:205], whole[95:205])
    assert np.array_equal(s[-7:], whole[-7:])
    assert np.array_equal(s[10:290:7], whole[10:290:7])
    assert np.array_equal(s[::-1], whole[::-1])
    assert s[150] == 150 and s[-1] == 299
    assert len(s[5:5]) == 0
    with pytest.raises(IndexError):
        s[300]
    # windows drawn across part boundaries are contiguous pieces of the concatenation
    x, y = s.get_batch(64, 50, "cpu", generator=torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], x[:, :-1] + 1) and torch.equal(y, x + 1)


def test_missing_part_is_refused(tmp_path):
    write_shard(tmp_path / "web", np.arange(10), part=(0, 3))
    write_shard(tmp_path / "web", np.arange(10), part=(2, 3))
    with pytest.raises(ShardError, match=r"1 of 3 parts missing.*part-1-of-3"):
        TokenShards(tmp_path / "web")


def test_manifest_and_list(tmp_path):
    a = write_shard(tmp_path / "a", np.arange(0, 50))
    b = write_shard(tmp_path / "sub" / "b", np.arange(50, 80))
    manifest = tmp_path / "all.json"
    manifest.write_text(json.dumps({"format": "ferrolm-shards-manifest", "parts": ["a", "sub/b"]}))
    assert np.array_equal(TokenShards(manifest)[:], np.arange(80))
    assert np.array_equal(TokenShards([b, a])[:], np.concatenate([np.arange(50, 80), np.arange(50)]))


def test_uint32_shards(tmp_path):
    toks = np.array([0, 70000, 123456, 5, 99999], dtype=np.int64)
    s = TokenShards(write_shard(tmp_path / "big", toks, vocab_size=200_000))
    assert s.dtype == "uint32"
    assert np.array_equal(s[:], toks)


def test_parts_must_agree(tmp_path):
    a = write_shard(tmp_path / "a", np.arange(20))
    b = write_shard(tmp_path / "b", np.arange(20), fingerprint="cd" * 32)
    with pytest.raises(ShardError, match="tokenizer_fingerprint"):
        TokenShards([a, b])
    c = write_shard(tmp_path / "c", np.arange(20), vocab_size=512)
    with pytest.raises(ShardError, match="vocab_size"):
        TokenShards([a, c])


def test_tokenizer_fingerprint_is_checked(tmp_path):
    prefix = write_shard(tmp_path / "t", np.arange(20))
    TokenShards(prefix, tokenizer=FP)  # the same fingerprint is accepted
    with pytest.raises(ShardError, match="tokenizer mismatch"):
        TokenShards(prefix, tokenizer="cd" * 32)

    # a tokenizer directory: its tokenizer.json carries the fingerprint
    from ferrolm.bpe.files import write_config

    tokdir = tmp_path / "tok"
    tokdir.mkdir()
    write_config(tokdir / "tokenizer.json", ["<|endoftext|>"], "gpt2", "ef" * 32)
    assert tokenizer_fingerprint(tokdir) == "ef" * 32
    with pytest.raises(ShardError, match="tokenizer mismatch"):
        TokenShards(prefix, tokenizer=tokdir)

    class Tok:
        fingerprint = FP

    TokenShards(prefix, tokenizer=Tok())


def test_truncated_bin_and_bad_sidecars(tmp_path):
    prefix = write_shard(tmp_path / "t", np.arange(100))
    bin_path = tmp_path / "t.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:150])
    with pytest.raises(ShardError, match="size 150 bytes.*num_tokens 100"):
        TokenShards(prefix)

    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ShardError, match="not valid JSON"):
        TokenShards(tmp_path / "x.json")

    write_shard(tmp_path / "y", np.arange(10))
    meta = json.loads((tmp_path / "y.json").read_text())
    meta["dtype"] = "int8"
    (tmp_path / "y.json").write_text(json.dumps(meta))
    with pytest.raises(ShardError, match="dtype"):
        TokenShards(tmp_path / "y")

    write_shard(tmp_path / "z", np.arange(10))
    (tmp_path / "z.bin").unlink()
    with pytest.raises(FileNotFoundError, match="z.bin"):
        TokenShards(tmp_path / "z")

    with pytest.raises(FileNotFoundError, match="no shards found"):
        TokenShards(tmp_path / "nothing-here")


def test_windows_at_fixed_positions(tmp_path):
    s = TokenShards(write_shard(tmp_path / "t", np.arange(200) % 256))
    x, y = s.windows_at([0, 10, 199 - 8], 8)
    assert x[:, 0].tolist() == [0, 10, 191] and torch.equal(y, x + 1)
    with pytest.raises(IndexError):
        s.windows_at([192], 8)


def test_prefetcher_hands_out_get_batch_s_batches_and_the_state_to_replay_them():
    from ferrolm.lm.data import BatchPrefetcher

    tokens = np.arange(5_000, dtype=np.uint16)
    g_ref = torch.Generator().manual_seed(3)
    expected = [get_batch(tokens, 4, 16, generator=g_ref) for _ in range(5)]
    pre = BatchPrefetcher(tokens, 4, 16, "cpu", torch.Generator().manual_seed(3))
    try:
        got = [pre.next() for _ in range(3)]
        state = pre.generator_state()  # before batch 3, although batch 3 is already drawn
    finally:
        pre.close()
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    resumed = torch.Generator()
    resumed.set_state(state)
    x, y = get_batch(tokens, 4, 16, generator=resumed)
    assert torch.equal(x, expected[3][0]) and torch.equal(y, expected[3][1])


def test_a_bin_without_sidecar_opens_with_its_dtype(tmp_path):
    ids = np.arange(1000, dtype="<u2") * 37
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(ShardError, match="dtype='uint16'"):
        TokenShards(tmp_path / "train.bin")
    ds = TokenShards(tmp_path / "train.bin", dtype="uint16")
    assert len(ds) == 1000 and ds[5] == 185 and ds.vocab_size is None and ds.fingerprint is None
    assert TokenShards(tmp_path / "train", dtype="uint32")[:2].tolist() == [37 << 16, (111 << 16) | 74]
    ds.check_tokenizer("ab" * 32)  # no fingerprint to check
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ShardError, match="whole number"):
        TokenShards(tmp_path / "odd.bin", dtype="uint16")
    write_shard(tmp_path / "s", [1, 2, 3])
    with pytest.raises(ShardError, match="uint32"):
        TokenShards(tmp_path / "s", dtype="uint32")


# ------------------------------------------------------------- document-aligned rows ---


def _documents(lengths, eos=0, seed=0):
    """A stream of documents of the given lengths (content ids 1..49), each followed by eos."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.append(rng.integers(1, 50, size=n), eos) for n in lengths]).astype(np.uint16)


def _best_fit_by_hand(tokens, eos, batch, context, begin, buffer_size, n_batches):
    """The packing rule written plainly: documents run from one eos to the next, read in
    order from the first eos at or after `begin`, wrapping around; a document longer than a
    row is cropped to one; each row takes the longest buffered document that fits (the
    oldest among equals), or else the shortest (the oldest among equals), cropped."""
    row_len = context + 1
    eos_at = [i for i, t in enumerate(tokens) if t == eos]
    order = [p for p in eos_at if p >= begin] + [p for p in eos_at if p < begin]

    def stream():
        while True:
            for p in order:
                nxt = [q for q in eos_at if q > p]
                end = nxt[0] if nxt else len(tokens)
                if end - p >= 2:
                    yield (p, min(end - p, row_len))

    docs, buffer, out = stream(), [], []
    for _ in range(n_batches):
        rows = []
        for _ in range(batch):
            row = []
            while len(row) < row_len:
                while len(buffer) < buffer_size:
                    buffer.append(next(docs))  # arrival order
                room = row_len - len(row)
                fits = [d for d in buffer if d[1] <= room]
                if fits:
                    pick = max(fits, key=lambda d: d[1])  # max() keeps the first (oldest) of equals
                    take = pick[1]
                else:
                    pick = min(buffer, key=lambda d: d[1])
                    take = room
                buffer.remove(pick)
                row += [int(t) for t in tokens[pick[0] : pick[0] + take]]
            rows.append(row)
        out.append(rows)
    return out


@pytest.mark.parametrize("buffer_size", [1, 4, 50])
def test_document_rows_start_at_a_document_and_pack_best_fit(tmp_path, buffer_size):
    from ferrolm.lm.data import DocumentRows

    rng = np.random.default_rng(1)
    tokens = _documents(rng.integers(1, 40, size=30), seed=2)  # some documents longer than a row
    shards = TokenShards(write_shard(tmp_path / "d", tokens, vocab_size=64))
    begin = int(torch.randint(0, len(tokens), (1,), generator=torch.Generator().manual_seed(5)))
    want = _best_fit_by_hand(tokens.tolist(), 0, 3, 16, begin, buffer_size, 20)  # > one pass of the stream
    rows = DocumentRows(shards, 0, 3, 16, torch.Generator().manual_seed(5), buffer_size=buffer_size)
    got = [rows.next_rows().tolist() for _ in range(20)]
    assert got == want
    assert all(r[0] == 0 for batch in got for r in batch)  # every row opens with an eos
    assert rows.passes >= 1


def test_document_rows_state_replays_the_same_rows_through_the_prefetcher():
    from ferrolm.lm.data import BatchPrefetcher, DocumentRows

    tokens = _documents(np.random.default_rng(3).integers(2, 30, size=300), seed=4)
    straight = DocumentRows(tokens, 0, 4, 16, torch.Generator().manual_seed(7), buffer_size=8)
    expected = [straight.next_rows() for _ in range(6)]
    pre = BatchPrefetcher(
        tokens, 4, 16, "cpu", rows=DocumentRows(tokens, 0, 4, 16, torch.Generator().manual_seed(7), 8)
    )
    try:
        got = [pre.next() for _ in range(3)]
        state = pre.loader_state()  # before batch 3, although batch 3 is already built
    finally:
        pre.close()
    for (x, y), rows in zip(got, expected):
        assert torch.equal(x, torch.from_numpy(rows[:, :-1])) and torch.equal(y, torch.from_numpy(rows[:, 1:]))
    other_seed = DocumentRows(tokens, 0, 4, 16, torch.Generator().manual_seed(99), buffer_size=8)
    other_seed.set_state(state)
    assert all(np.array_equal(other_seed.next_rows(), rows) for rows in expected[3:])
    with pytest.raises(ValueError, match="buffer of 9"):
        DocumentRows(tokens, 0, 4, 16, torch.Generator(), buffer_size=9).set_state(state)


def test_document_rows_need_end_of_text_tokens():
    from ferrolm.lm.data import DocumentRows

    with pytest.raises(ShardError, match="end-of-text id 0"):
        DocumentRows(np.arange(1, 100), 0, 2, 8, torch.Generator())
    with pytest.raises(ShardError, match="no document of 2 tokens"):
        DocumentRows(np.zeros(50, dtype=np.int64), 0, 2, 8, torch.Generator()).next_rows()


def test_document_rows_refuse_an_id_past_the_vocab(tmp_path):
    from ferrolm.lm.data import DocumentRows

    tokens = _documents([5, 6, 7, 8])
    tokens[22] = 300  # inside the longest document, which fills the first row
    shards = TokenShards(write_shard(tmp_path / "bad", tokens, vocab_size=256))
    with pytest.raises(ShardError, match="token id 300, not below their vocab_size 256"):
        DocumentRows(shards, 0, 2, 8, torch.Generator().manual_seed(0), buffer_size=4).next_rows()

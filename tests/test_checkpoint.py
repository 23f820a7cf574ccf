"""ferrolm.lm.checkpoint: round trips, weights_only loading, atomic writes, clear errors."""

from __future__ import annotations

import errno
import io
import random
import struct
import zipfile

import numpy as np
import pytest
import torch

from ferrolm.lm import checkpoint as ck
from ferrolm.lm.checkpoint import (
    CheckpointError,
    get_rng_state,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from ferrolm.lm.model import TransformerLM
from ferrolm.lm.optim import AdamW

torch.set_num_threads(1)  # tiny models: threads only add overhead


def tiny(seed=0, d_model=16):
    torch.manual_seed(seed)
    return TransformerLM(
        vocab_size=32, context_length=8, d_model=d_model, num_layers=1, num_heads=2, d_ff=32, rope_theta=10000.0
    )


def trained(seed=0):
    model = tiny(seed)
    opt = AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))
    for _ in range(3):
        loss = model(ids).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            assert_same_state(a[k], b[k])
        else:
            assert a[k] == b[k], k


def test_round_trip_to_path_and_file_object(tmp_path):
    model, opt = trained()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(model, opt, 7, path, config={"model": {"d_model": 16}})
    # loadable with plain torch.load(weights_only=True): no pickled Python objects inside
    raw = torch.load(path, weights_only=True)
    assert raw["iteration"] == 7 and raw["config"] == {"model": {"d_model": 16}}

    model2 = tiny(seed=1)
    opt2 = AdamW(model2.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert not torch.equal(model2.lm_head.weight, model.lm_head.weight)
    assert load_checkpoint(path, model2, opt2) == 7
    assert_same_state(model.state_dict(), model2.state_dict())
    assert_same_state(opt.state_dict()["state"], opt2.state_dict()["state"])

    buf = io.BytesIO()
    save_checkpoint(model, opt, 9, buf)
    buf.seek(0)
    model3 = tiny(seed=2)
    assert load_checkpoint(buf, model3, None) == 9
    assert_same_state(model.state_dict(), model3.state_dict())


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    model = tiny()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    save_checkpoint(model, None, 0, tmp_path / "c.pt", rng=get_rng_state())
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    set_rng_state(read_checkpoint(tmp_path / "c.pt")["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_corrupt_or_foreign_files_give_clear_errors(tmp_path):
    model, opt = trained()
    good = tmp_path / "good.pt"
    save_checkpoint(model, opt, 1, good)
    data = good.read_bytes()

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(truncated, tiny(), None)

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint" * 100)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(garbage, tiny(), None)

    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(CheckpointError, match="not a ferrolm checkpoint"):
        load_checkpoint(foreign, tiny(), None)

    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "missing.pt", tiny(), None)


def test_checkpoint_from_a_different_config_is_refused(tmp_path):
    model, opt = trained()
    path = tmp_path / "c.pt"
    save_checkpoint(model, opt, 3, path, config={"model": {"d_model": 16}})
    other = tiny(d_model=32)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        CheckpointError,
        match=r"different config.*shape mismatch.*token_embeddings.weight: checkpoint \(32, 16\) vs model \(32, 32\)",
    ):
        load_checkpoint(path, other, None)
    assert_same_state(before, other.state_dict())  # nothing was half-loaded


def test_failed_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    model, opt = trained()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(model, opt, 1, path)
    before = path.read_bytes()

    real_save = torch.save

    def disk_full(obj, f, *a, **k):
        real_save(obj, f, *a, **k)  # some bytes reach the temporary file ...
        f.truncate(100)
        raise OSError(errno.ENOSPC, "No space left on device")  # ... then the disk is full

    monkeypatch.setattr(ck.torch, "save", disk_full)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(model, opt, 2, path)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"], "the temporary file must be removed"
    assert load_checkpoint(path, tiny(), None) == 1


def test_reserved_keys_cannot_be_overwritten(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tiny(), None, 0, tmp_path / "c.pt", format="mine")


def flip_a_weight_bit(path):
    """Flip one bit in the middle of the largest tensor's bytes (stored uncompressed in the zip)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_flipped_bit_is_caught_by_the_checksum(tmp_path):
    model, opt = trained()
    path = tmp_path / "c.pt"
    save_checkpoint(model, opt, 3, path)
    flip_a_weight_bit(path)
    torch.load(path, weights_only=True)  # torch itself does not notice
    with pytest.raises(CheckpointError, match=r"c\.pt is corrupt: its contents do not match the checksum"):
        read_checkpoint(path)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path, tiny(), None)


def test_a_checkpoint_without_a_checksum_still_loads(tmp_path):
    model, opt = trained()
    save_checkpoint(model, opt, 3, tmp_path / "new.pt")
    obj = read_checkpoint(tmp_path / "new.pt")
    assert len(obj.pop("checksum")) == 64
    torch.save(obj, tmp_path / "old.pt")  # what earlier versions wrote
    fresh = tiny(seed=1)
    assert load_checkpoint(tmp_path / "old.pt", fresh, None) == 3
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))

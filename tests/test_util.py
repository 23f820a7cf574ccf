"""ferrolm._util: atomic writes (whole or absent, the umask respected, leftovers found)."""

from __future__ import annotations

import os
import stat

import pytest

from ferrolm._util import atomic_open, atomic_write_bytes, check_special_tokens, fix_surrogates, stale_temporaries


@pytest.fixture
def umask():
    """Set the process umask for one test (and restore it after)."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda m: os.umask(m)
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.skipif(os.name != "posix", reason="permission bits are POSIX")
def test_atomic_write_respects_the_umask(tmp_path, umask):
    umask(0o022)
    atomic_write_bytes(tmp_path / "a", b"x")
    assert mode(tmp_path / "a") == 0o644
    umask(0o027)
    atomic_write_bytes(tmp_path / "b", b"x")
    assert mode(tmp_path / "b") == 0o640


def test_atomic_open_leaves_the_old_file_on_failure(tmp_path):
    target = tmp_path / "t.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_open(target) as f:
            f.write(b"new, half written")
            raise RuntimeError("killed")
    assert target.read_bytes() == b"old"
    assert stale_temporaries(tmp_path) == []  # the temporary went with the failure


def test_atomic_write_errors_name_the_file_asked_for_not_the_temporary(tmp_path):
    target = tmp_path / "missing-folder" / "t.json"
    with pytest.raises(FileNotFoundError) as e:
        atomic_write_bytes(target, b"x")
    assert str(e.value) == f"[Errno 2] No such file or directory: '{target}'"
    # The rename onto a directory: the error names the file, not its hidden temporary.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "inside").write_bytes(b"keep")
    with pytest.raises(OSError) as e:
        atomic_write_bytes(tmp_path / "d", b"x")
    assert e.value.filename == str(tmp_path / "d") and ".tmp" not in str(e.value)
    assert stale_temporaries(tmp_path) == []


def test_stale_temporaries_finds_what_an_interrupted_write_leaves(tmp_path):
    # The names an interrupted write leaves: atomic_open's and tempfile.mkstemp's.
    left = [tmp_path / ".step_00000005.pt.0a1b2c3d.tmp", tmp_path / ".best.pt.k2_x9qz1.tmp"]
    for p in left:
        p.write_bytes(b"partial")
    for name in ("step_00000005.pt", ".hidden", "notes.tmp", ".x.tmp"):
        (tmp_path / name).write_bytes(b"keep")
    assert stale_temporaries(tmp_path) == sorted(left)
    assert stale_temporaries(tmp_path / "missing") == []


def test_text_helpers():
    assert fix_surrogates("ok") == "ok"
    assert fix_surrogates("a\ud83d\ude00b\ud800") == "a\U0001f600b\ufffd"
    assert check_special_tokens(None) == []
    with pytest.raises(TypeError, match="not a single str"):
        check_special_tokens("<|endoftext|>")

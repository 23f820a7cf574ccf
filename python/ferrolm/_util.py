"""What both halves of the package use: atomic file writes, special-token lists, surrogate repair.

Imports only the standard library (the tokenizer side must import without torch).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Union

PathInput = Union[str, "os.PathLike[str]"]

# ---------------------------------------------------------------------------------------
# Atomic writes: a temporary name in the same directory, fsync, rename
# ---------------------------------------------------------------------------------------

# `.NAME.XXXXXXXX.tmp`: what atomic_open writes to before the rename (eight characters of
# [a-z0-9_], which also covers tempfile.mkstemp's names).
_TEMPORARY_RE = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


def _open_temporary(path: Path) -> tuple[int, Path]:
    # os.open with mode 0o666 lets the umask decide the permissions, as for any new file
    # (tempfile.mkstemp would make every output 0600).
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:  # pragma: no cover - 2**32 names
            continue


def fsync_dir(directory: PathInput) -> None:
    """Make a rename in `directory` durable (where the platform can; errors are ignored)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: PathInput) -> Iterator[BinaryIO]:
    """A binary file to write that appears at `path` only once it is complete.

    The data goes to a temporary name beside `path`, is fsynced, then renamed over it: on
    any failure (an exception, a full disk, a kill) `path` is left as it was. The file gets
    the permissions of any new file (0666 less the umask).
    """
    path = Path(path)
    fd, tmp = _open_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: PathInput, data: bytes) -> None:
    """Write `data` to `path` so that `path` is either as it was or complete (see atomic_open)."""
    with atomic_open(path) as f:
        f.write(data)


def stale_temporaries(directory: PathInput) -> list[Path]:
    """Temporaries an interrupted atomic write left in `directory` (none when it is missing)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(Path(directory) / n for n in names if _TEMPORARY_RE.match(n))


# ---------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


def fix_surrogates(text: str) -> str:
    """What tiktoken does to a str that is not valid Unicode: join surrogate pairs and
    replace lone surrogates by U+FFFD (a valid str comes back as it is)."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def is_high_surrogate(c: str) -> bool:
    """Whether `c` (one char) is a high surrogate, which may pair with the next chunk's first char."""
    return "\ud800" <= c <= "\udbff"


def check_special_tokens(special_tokens: Iterable[str] | None) -> list[str]:
    """`special_tokens` as a list of distinct non-empty str (None: no special tokens)."""
    if special_tokens is None:
        return []
    if isinstance(special_tokens, (str, bytes)):
        raise TypeError(
            f"special_tokens must be a list of str, not a single {type(special_tokens).__name__} ({special_tokens!r})"
        )
    specials = list(special_tokens)
    for s in specials:
        if not isinstance(s, str):
            raise TypeError(f"special tokens must be str, got {type(s).__name__} ({s!r})")
        if not s:
            raise ValueError("a special token must not be the empty string")
    duplicates = sorted({s for s in specials if specials.count(s) > 1})
    if duplicates:
        raise ValueError(f"special token(s) listed twice: {duplicates}")
    return specials

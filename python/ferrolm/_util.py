"""What both halves of the package use: atomic file writes, special-token lists, surrogate repair.

Imports only the standard library (the tokenizer side must import without torch).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Union

PathInput = Union[str, "os.PathLike[str]"]

# ---------------------------------------------------------------------------------------
# Output whose reader may be gone
# ---------------------------------------------------------------------------------------


class ForgivingStream:
    """A text stream that stops writing, instead of raising, once its reader is gone.

    Ctrl-C of ``cmd 2>&1 | tee log`` interrupts the whole pipeline, so the pipe closes before
    the command has handled the signal; its next progress line would raise BrokenPipeError
    and cost what it was about to save. Here that write and every later one are dropped, and
    the stream's file descriptor is pointed at the null device, so that what is still
    buffered flushes quietly at exit. ``lost`` says whether the reader went away.
    """

    def __init__(self, stream: Any):
        self.stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):  # a closed pipe, a vanished terminal (EIO), a closed file
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._lose()

    def _lose(self) -> None:
        self.lost = True
        silence(self.stream)

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno ... of the stream
        return getattr(self.stream, name)


def silence(stream: Any) -> None:
    """Point ``stream``'s file descriptor (when it has one) at the null device."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is an OSError
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def say_where_possible(text: str, *streams: ForgivingStream) -> bool:
    """Write the line ``text`` to the first of ``streams`` whose reader is still there;
    whether one was."""
    for stream in streams:
        stream.write(text + "\n")
        stream.flush()
        if not stream.lost:
            return True
    return False


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
    try:
        fd, tmp = _open_temporary(path)
    except OSError as e:
        raise _naming(e, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename == os.fspath(tmp):
            raise _naming(e, path) from None
        raise
    fsync_dir(path.parent)


def _naming(e: OSError, path: Path) -> OSError:
    """`e` naming `path`, the file the user asked for, not the hidden temporary one."""
    return type(e)(e.errno, e.strerror, os.fspath(path))


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
# Atomic directories: a temporary sibling directory, fsync, then one swap
# ---------------------------------------------------------------------------------------

# Test-only: called after a directory's files are written and synced, before its rename.
_before_dir_rename: Callable[[], None] | None = None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _check_replaceable(target: Path, owned: Iterable[str]) -> None:
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    others = sorted(set(os.listdir(target)) - set(owned))
    if others:
        raise FileExistsError(
            f"{target} holds files this would delete ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): "
            "write into a new or empty directory"
        )


def _remove_stale(target: Path) -> None:
    """Temporary siblings left by an earlier write into ``target`` that was killed."""
    prefix = f".{target.name}."
    for p in target.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False when unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _swap_in(tmp: Path, target: Path) -> None:
    """Put ``tmp`` at ``target``; what was at ``target`` ends at ``tmp``'s name (or is gone)."""
    if not target.exists():
        os.rename(tmp, target)
    elif not _exchange(tmp, target):
        # Two renames: between them ``target`` is absent, never half-written.
        old = tmp.with_name(tmp.name[: -len(".tmp")] + ".old.tmp")
        os.rename(target, old)
        os.rename(tmp, target)
        os.rename(old, tmp)


def atomic_write_dir(target: PathInput, files: dict[str, bytes], owned: Iterable[str]) -> Path:
    """Write ``files`` ({name: content}) as the directory ``target``, whole or not at all.

    The files go into a temporary sibling directory, are fsynced, and the directory is
    renamed to ``target`` (swapped in when ``target`` exists). An existing ``target`` may
    hold only names in ``owned`` (the files a previous write made), so nothing else is lost.
    """
    target = Path(target)
    _check_replaceable(target, owned)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        for name, data in files.items():
            _write_synced(tmp / name, data)
        fsync_dir(tmp)
        if _before_dir_rename is not None:
            _before_dir_rename()
        _swap_in(tmp, target)
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------
# Outputs: never over an input, never over what this did not write unless forced
# ---------------------------------------------------------------------------------------


def _refuse_own_input(out: Path, inputs: Iterable[Any], flag: str = "--out") -> None:
    """An output never replaces what its writer reads, nor a folder holding it, even when forced."""
    target = out.resolve()
    for given in inputs:
        if given is None or not Path(given).exists():
            continue
        source = Path(given).resolve()
        if target == source or (out.exists() and os.path.samefile(out, source)):
            how = "is"
        elif target in source.parents:
            how = "holds"
        else:
            continue
        raise ValueError(
            f"{flag} {out} {how} {given}, which this command reads: choose another {flag} "
            "(--force never replaces its own input)"
        )


def _refuse_current_folder(out: Path, example: str) -> None:
    """Replacing a folder swaps it whole: the current folder (or one holding it) would vanish
    from under the shell that asked."""
    here = Path.cwd().resolve()
    target = out.resolve()
    if target == here or target in here.parents:
        how = "is" if target == here else "holds"
        raise ValueError(
            f"--out {out} {how} the current folder: the output replaces its folder whole; "
            f"give a new folder, e.g. --out {out / example}"
        )


def check_out(
    out: PathInput,
    inputs: Iterable[Any],
    *,
    force: bool,
    judge: Callable[[Path], Union[str, None]],
    folder: bool = False,
    example: str = "out",
    flag: str = "--out",
) -> Path:
    """The check every writer of a named output (an export, a plot) makes before it writes
    ``out``, a folder when ``folder`` else a file; returns ``out`` as a Path. ``example``: a
    name to suggest (e.g. model.gguf); ``flag``: the option that named ``out``, for the messages.

    Refused even with ``force``: one of ``inputs`` (what the writer reads, as given and as
    found) or a folder holding one; for a folder, the current folder or one holding it; a
    folder where a file goes, a file where a folder goes. Refused unless ``force``: an
    existing ``out`` for which ``judge(out)`` says what it holds (None: an earlier output of
    this kind, which may be replaced)."""
    path = Path(out)
    _refuse_own_input(path, inputs, flag)
    if folder:
        _refuse_current_folder(path, example)
    if not path.exists():
        return path
    if folder and not path.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder: give a new folder")
    if not folder and path.is_dir():
        raise IsADirectoryError(f"{flag} {out} is a folder: give a file name, e.g. {flag} {path / example}")
    found = None if force else judge(path)
    if found is not None:
        raise FileExistsError(f"{flag} {out} {found}, or pass --force (force=True) to replace it")
    return path


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

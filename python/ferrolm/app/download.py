"""`ferrolm download`: fetch public corpora with resume, checksums and a progress bar.

Downloads go to ``NAME.partial`` beside the destination; an interrupted download resumes
with an HTTP Range request; the final name appears only when the whole file is there and
its sha256 matches (a pinned checksum when the dataset has one, otherwise the checksum
is recorded in ``NAME.sha256`` on the first complete download and verified afterwards).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

CHUNK = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    url: str
    filename: str
    sha256: str | None = None  # pinned checksum, when known


# Public files users train on. Checksums are not pinned: this project is built on
# machines without internet access, so they could not be measured here; the first
# complete download records its sha256 and later runs verify against it.
DATASETS: dict[str, list[RemoteFile]] = {
    "tinystories": [
        RemoteFile(
            "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-train.txt",
            "TinyStoriesV2-GPT4-train.txt",
        ),
        RemoteFile(
            "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-valid.txt",
            "TinyStoriesV2-GPT4-valid.txt",
        ),
    ],
    "owt-sample": [
        RemoteFile(
            "https://huggingface.co/datasets/stanford-cs336/owt-sample/resolve/main/owt_train.txt.gz",
            "owt_train.txt.gz",
        ),
        RemoteFile(
            "https://huggingface.co/datasets/stanford-cs336/owt-sample/resolve/main/owt_valid.txt.gz",
            "owt_valid.txt.gz",
        ),
    ],
}


class DownloadError(OSError):
    """A download failed or its content does not match the expected checksum."""


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def download_file(
    remote: RemoteFile, out_dir: str | os.PathLike, *, progress: bool = True, timeout: float = 30.0
) -> Path:
    """Download one file into `out_dir`, resuming a partial download; returns the final path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / remote.filename
    recorded = out_dir / (remote.filename + ".sha256")
    expected = remote.sha256 or (recorded.read_text().split()[0] if recorded.exists() else None)
    if final.exists():
        if expected is None or _sha256_of(final) == expected:
            return final
        raise DownloadError(f"{final} exists but its sha256 does not match {expected}; delete it to download again")

    partial = out_dir / (remote.filename + ".partial")
    have = partial.stat().st_size if partial.exists() else 0
    request = urllib.request.Request(remote.url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to fetch: the partial file is whole
            response = None
        else:
            raise DownloadError(f"{remote.url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise DownloadError(f"{remote.url}: {getattr(e, 'reason', e)} (is there a network connection?)") from None

    if response is not None:
        with response:
            resumed = have and response.status == 206
            if have and not resumed:  # the server ignored Range: start over
                have = 0
            length = response.headers.get("Content-Length")
            total = have + int(length) if length is not None else None
            with (
                open(partial, "ab" if resumed else "wb") as f,
                tqdm(
                    total=total, initial=have, unit="B", unit_scale=True, desc=remote.filename, disable=not progress
                ) as bar,
            ):
                try:
                    while block := response.read(CHUNK):
                        f.write(block)
                        bar.update(len(block))
                except (http.client.IncompleteRead, ConnectionError, TimeoutError) as e:
                    raise DownloadError(f"{remote.url}: connection lost ({e}); run again to resume") from None
                finally:
                    f.flush()
                    os.fsync(f.fileno())
                os.fsync(f.fileno())
            if total is not None and partial.stat().st_size != total:
                raise DownloadError(
                    f"{remote.url}: connection closed after {partial.stat().st_size} of {total} bytes; run again to resume"
                )

    digest = _sha256_of(partial)
    if expected is not None and digest != expected:
        partial.unlink()
        raise DownloadError(
            f"{remote.url}: sha256 {digest} does not match the expected {expected}; the partial file was removed"
        )
    os.replace(partial, final)
    if remote.sha256 is None and not recorded.exists():
        recorded.write_text(f"{digest}  {remote.filename}\n")
    return final


def download_dataset(name: str, out_dir: str | os.PathLike, *, progress: bool = True) -> list[Path]:
    """Download every file of a named dataset (see DATASETS) into `out_dir`."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(sorted(DATASETS))}")
    return [download_file(remote, out_dir, progress=progress) for remote in DATASETS[name]]

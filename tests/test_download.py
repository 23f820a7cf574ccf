"""`ferrolm download` against a local HTTP server on loopback: resume, checksums, errors."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ferrolm.app.download import DownloadError, RemoteFile, download_dataset, download_file

PAYLOAD = bytes(range(256)) * 4096 + b"tail"  # about 1 MB


class Handler(BaseHTTPRequestHandler):
    cut_first_response = False  # when set, the next response stops halfway through the body
    requests: list = []

    def do_GET(self):  # noqa: N802 (http.server's naming)
        Handler.requests.append(self.headers.get("Range"))
        if self.path != "/data.bin":
            self.send_error(404)
            return
        start = 0
        if rng := self.headers.get("Range"):
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(PAYLOAD):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(PAYLOAD) - 1}/{len(PAYLOAD)}")
        else:
            self.send_response(200)
        body = PAYLOAD[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if Handler.cut_first_response:
            Handler.cut_first_response = False
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Handler.requests = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_download_verifies_pinned_checksum(server, tmp_path):
    sha = hashlib.sha256(PAYLOAD).hexdigest()
    path = download_file(RemoteFile(f"{server}/data.bin", "data.bin", sha), tmp_path, progress=False)
    assert path.read_bytes() == PAYLOAD
    assert not (tmp_path / "data.bin.partial").exists()


def test_interrupted_download_resumes_with_range(server, tmp_path):
    Handler.cut_first_response = True
    remote = RemoteFile(f"{server}/data.bin", "data.bin")
    with pytest.raises(DownloadError, match="resume"):
        download_file(remote, tmp_path, progress=False)
    partial = tmp_path / "data.bin.partial"
    assert 0 < partial.stat().st_size < len(PAYLOAD)
    assert not (tmp_path / "data.bin").exists()
    path = download_file(remote, tmp_path, progress=False)
    assert path.read_bytes() == PAYLOAD
    assert Handler.requests[-1] == f"bytes={len(PAYLOAD) // 2}-"
    # The checksum of the first complete download is recorded and verified from then on.
    assert (tmp_path / "data.bin.sha256").read_text().split()[0] == hashlib.sha256(PAYLOAD).hexdigest()
    path.write_bytes(b"corrupted")
    with pytest.raises(DownloadError, match="does not match"):
        download_file(remote, tmp_path, progress=False)


def test_checksum_mismatch_removes_partial_and_keeps_no_final(server, tmp_path):
    remote = RemoteFile(f"{server}/data.bin", "data.bin", "0" * 64)
    with pytest.raises(DownloadError, match="does not match"):
        download_file(remote, tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_http_errors_and_unknown_names_are_clear(server, tmp_path):
    with pytest.raises(DownloadError, match="HTTP 404"):
        download_file(RemoteFile(f"{server}/missing", "missing"), tmp_path, progress=False)
    with pytest.raises(ValueError, match="unknown dataset"):
        download_dataset("nope", tmp_path)

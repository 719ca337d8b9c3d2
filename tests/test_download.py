"""Download against a local HTTP server on 127.0.0.1 that serves a fixture with Range
support and can cut a transfer in the middle (no network)."""
import hashlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from protein_performer.data.download import DownloadError, download

DATA = os.urandom(300_000)
MD5 = hashlib.md5(DATA).hexdigest()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        srv = self.server
        srv.requests.append(self.headers.get("Range"))
        if self.path.endswith(".404"):
            self.send_error(404)
            return
        if self.path.endswith(".metalink"):
            body = (f'<metalink><files><file name="data.bin"><size>{len(DATA)}</size>'
                    f'<verification><hash type="md5">{srv.md5}</hash></verification></file></files></metalink>').encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        start = 0
        rng = self.headers.get("Range")
        if rng and srv.ranges:
            start = int(rng.split("=")[1].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(DATA) - 1}/{len(DATA)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(DATA) - start))
        self.end_headers()
        body = DATA[start:]
        if srv.cuts:  # send part of the body, then drop the connection
            srv.cuts -= 1
            self.wfile.write(body[: len(body) // 3])
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.requests, srv.cuts, srv.ranges, srv.md5 = [], 0, True, MD5
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_plain_download_is_complete_and_atomic(server, tmp_path):
    srv, base = server
    out = download(f"{base}/data.bin", tmp_path / "d.bin", progress=False)
    assert out.read_bytes() == DATA and not (tmp_path / "d.bin.part").exists()
    assert srv.requests == [None]
    download(f"{base}/data.bin", tmp_path / "d.bin", progress=False)  # already there: no request
    assert srv.requests == [None]


def test_cut_transfer_resumes_with_range_requests(server, tmp_path):
    srv, base = server
    srv.cuts = 2
    out = download(f"{base}/data.bin", tmp_path / "d.bin", md5=MD5, progress=False, backoff=0)
    assert out.read_bytes() == DATA
    first = len(DATA) // 3
    second = first + (len(DATA) - first) // 3
    assert srv.requests == [None, f"bytes={first}-", f"bytes={second}-"]


def test_partial_file_from_an_earlier_run_is_resumed(server, tmp_path):
    srv, base = server
    (tmp_path / "d.bin.part").write_bytes(DATA[:1000])
    download(f"{base}/data.bin", tmp_path / "d.bin", progress=False)
    assert (tmp_path / "d.bin").read_bytes() == DATA and srv.requests == ["bytes=1000-"]


def test_server_without_ranges_restarts_from_zero(server, tmp_path):
    srv, base = server
    srv.ranges = False
    (tmp_path / "d.bin.part").write_bytes(b"x" * 5000)  # stale bytes must not survive
    download(f"{base}/data.bin", tmp_path / "d.bin", progress=False)
    assert (tmp_path / "d.bin").read_bytes() == DATA


def test_metalink_checksum_is_verified(server, tmp_path):
    srv, base = server
    download(f"{base}/data.bin", tmp_path / "ok.bin", metalink=f"{base}/RELEASE.metalink", progress=False)
    srv.md5 = "0" * 32
    with pytest.raises(DownloadError, match="MD5 .* does not match"):
        download(f"{base}/data.bin", tmp_path / "bad.bin", metalink=f"{base}/RELEASE.metalink", progress=False)
    assert not (tmp_path / "bad.bin").exists() and not (tmp_path / "bad.bin.part").exists()


def test_gives_up_with_a_clear_error_and_keeps_the_part(server, tmp_path):
    srv, base = server
    srv.cuts = 10
    with pytest.raises(DownloadError, match=r"gave up after 3 failed attempts.*next run resumes"):
        download(f"{base}/data.bin", tmp_path / "d.bin", retries=2, progress=False, backoff=0)
    assert not (tmp_path / "d.bin").exists() and (tmp_path / "d.bin.part").stat().st_size > 0
    with pytest.raises(DownloadError, match=r"missing\.404: HTTP 404"):
        download(f"{base}/missing.404", tmp_path / "e.bin", progress=False, backoff=0)

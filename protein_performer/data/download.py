"""Resumable, verified download of a large file (the 50 GB TrEMBL FASTA) over HTTP(S).

Bytes go to ``<dest>.part``; an interrupted transfer continues with a ``Range`` request
(from where the ``.part`` file ends, in this run or a later one). The finished file is
checked against the size the server announced and, when known, an MD5 (given, or read
from a UniProt ``RELEASE.metalink``), and only then renamed to ``dest``: a file at
``dest`` is always complete.
"""
from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import UserError

log = logging.getLogger(__name__)


class DownloadError(UserError):
    """A download that could not be completed or verified (message names URL and file)."""


def metalink_checksum(metalink_url: str, name: str, timeout: float = 60) -> tuple[int | None, str | None]:
    """(size, md5) of file ``name`` in a metalink document (UniProt publishes one per release)."""
    with urllib.request.urlopen(metalink_url, timeout=timeout) as r:
        text = r.read().decode("utf-8", "replace")
    m = re.search(r'<file\s+name="' + re.escape(name) + r'"\s*>(.*?)</file>', text, re.S)
    if not m:
        return None, None
    size = re.search(r"<size>(\d+)</size>", m.group(1))
    md5 = re.search(r'<hash\s+type="md5">([0-9a-fA-F]{32})</hash>', m.group(1))
    return (int(size.group(1)) if size else None), (md5.group(1).lower() if md5 else None)


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


class _BadRange(DownloadError):
    """The server answered a Range request with other bytes: retrying would not help."""


def download(url: str, dest: str | Path, *, md5: str | None = None, metalink: str | None = None,
             retries: int = 5, timeout: float = 60, chunk: int = 1 << 20, progress: bool = True,
             backoff: float = 1.0) -> Path:
    """Fetch ``url`` to ``dest`` (skipped if ``dest`` exists); return ``dest``."""
    dest = Path(dest)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    expected_size, md5 = _published(url, metalink, md5, timeout)
    transfer = _Transfer(url, part, expected_size, timeout, chunk, dest.name if progress else None)
    try:
        transfer.run(retries, backoff, dest)
    finally:
        transfer.close()
    size = _verify(url, part, transfer.total, md5)
    os.replace(part, dest)
    log.info("downloaded %s -> %s (%d bytes%s)", url, dest, size, ", MD5 verified" if md5 else "")
    return dest


def _published(url: str, metalink: str | None, md5: str | None, timeout: float) -> tuple[int | None, str | None]:
    """(size, md5) the publisher announces: ``md5`` as given, else the metalink's; an unreadable
    metalink is a warning (the download goes on unchecked)."""
    if not metalink:
        return None, md5
    try:
        size, md5_ml = metalink_checksum(metalink, url.rsplit("/", 1)[-1], timeout)
        return size, md5 or md5_ml
    except (urllib.error.URLError, OSError) as e:
        log.warning("%s: no checksum (metalink %s unreadable: %s)", url, metalink, e)
        return None, md5


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


class _Transfer:
    """Bytes of ``url`` into ``part`` until it holds the whole file: each request continues where
    ``part`` ends; ``total`` is the file's size once a server or the metalink has said it."""

    def __init__(self, url: str, part: Path, expected_size: int | None, timeout: float, chunk: int,
                 progress: str | None):
        self.url, self.part, self.expected_size, self.timeout, self.chunk = url, part, expected_size, timeout, chunk
        self.total = expected_size
        self.progress, self.bar = progress, None

    def run(self, retries: int, backoff: float, dest: Path) -> None:
        """Request until complete; a failure is retried ``retries`` times (the n-th after n x
        ``backoff`` seconds), then a DownloadError saying what ``part`` keeps."""
        failures = 0
        while True:
            have = _size(self.part)
            if self.total is not None and have == self.total:
                return
            try:
                self.request(have)
                have = _size(self.part)
                if self.total is None or have == self.total:
                    return
                raise DownloadError(f"{self.url}: connection closed at byte {have} of {self.total}")
            except urllib.error.HTTPError as e:
                if e.code == 416 and self.total is not None and have == self.total:
                    return
                if e.code == 416 and have:  # our partial file does not fit the remote one
                    self.part.unlink()
                    failures += 1
                elif e.code < 500:
                    raise DownloadError(f"{self.url}: HTTP {e.code} {e.reason}") from e
                failures += 1
                err = e
            except _BadRange:
                raise
            except (urllib.error.URLError, OSError, DownloadError, http.client.HTTPException) as e:
                failures += 1
                err = e
            if failures > retries:
                raise self.gave_up(failures, err, dest)
            log.warning("%s: %s; retry %d of %d from byte %d", self.url, err, failures, retries, _size(self.part))
            time.sleep(backoff * failures)

    def request(self, have: int) -> None:
        """One request for the bytes after ``have`` (all of them if the server ignores ranges)."""
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={have}-"} if have else {})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            if have and r.status == 206:
                m = re.match(r"bytes (\d+)-\d+/(\d+|\*)", r.headers.get("Content-Range", ""))
                if not m or int(m.group(1)) != have:
                    raise _BadRange(f"{self.url}: server answered range {have}- with "
                                    f"{r.headers.get('Content-Range')!r}")
                if m.group(2) != "*":
                    self.total = int(m.group(2))
                mode = "ab"
            else:  # 200: the server ignores ranges, start over
                have, mode = 0, "wb"
                length = r.headers.get("Content-Length")
                self.total = int(length) if length is not None else self.total
            if self.expected_size is not None and self.total is not None and self.total != self.expected_size:
                raise DownloadError(f"{self.url}: server says {self.total} bytes, metalink says {self.expected_size}")
            if self.progress and self.bar is None:
                from tqdm import tqdm
                self.bar = tqdm(total=self.total, initial=have, unit="B", unit_scale=True, desc=self.progress)
            with open(self.part, mode) as fh:
                while piece := r.read(self.chunk):
                    fh.write(piece)
                    if self.bar is not None:
                        self.bar.update(len(piece))

    def gave_up(self, failures: int, err: BaseException, dest: Path) -> DownloadError:
        self.close()
        have = _size(self.part)
        if self.part.exists() and not have:
            self.part.unlink()
        kept = f"; {self.part} keeps {have:,} bytes and the next run resumes it" if have else ""
        return DownloadError(f"{self.url}: gave up after {failures} failed attempts to download it to {dest} "
                             f"({' '.join(str(err).split())}){kept}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _verify(url: str, part: Path, total: int | None, md5: str | None) -> int:
    """The finished ``part``'s size, checked against ``total`` and ``md5`` (a mismatch removes it)."""
    size = part.stat().st_size
    if total is not None and size != total:
        raise DownloadError(f"{url}: {part} has {size} bytes, expected {total}")
    if md5:
        got = _md5(part)
        if got != md5.lower():
            part.unlink()
            raise DownloadError(f"{url}: MD5 {got} does not match the published {md5}; the partial file "
                                f"was removed, run again to download afresh")
    return size

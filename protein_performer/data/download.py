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


def download(url: str, dest: str | Path, *, md5: str | None = None, metalink: str | None = None,
             retries: int = 5, timeout: float = 60, chunk: int = 1 << 20, progress: bool = True,
             backoff: float = 1.0) -> Path:
    """Fetch ``url`` to ``dest`` (skipped if ``dest`` exists); return ``dest``."""
    dest = Path(dest)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    expected_size = None
    if metalink:
        try:
            expected_size, md5_ml = metalink_checksum(metalink, url.rsplit("/", 1)[-1], timeout)
            md5 = md5 or md5_ml
        except (urllib.error.URLError, OSError) as e:
            log.warning("%s: no checksum (metalink %s unreadable: %s)", url, metalink, e)
    bar = None
    failures = 0
    total = expected_size
    while True:
        have = part.stat().st_size if part.exists() else 0
        if total is not None and have == total:
            break
        req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                if have and r.status == 206:
                    m = re.match(r"bytes (\d+)-\d+/(\d+|\*)", r.headers.get("Content-Range", ""))
                    if not m or int(m.group(1)) != have:
                        raise DownloadError(f"{url}: server answered range {have}- with "
                                            f"{r.headers.get('Content-Range')!r}")
                    if m.group(2) != "*":
                        total = int(m.group(2))
                    mode = "ab"
                else:  # 200: the server ignores ranges, start over
                    have, mode = 0, "wb"
                    length = r.headers.get("Content-Length")
                    total = int(length) if length is not None else total
                if expected_size is not None and total is not None and total != expected_size:
                    raise DownloadError(f"{url}: server says {total} bytes, metalink says {expected_size}")
                if progress and bar is None:
                    from tqdm import tqdm
                    bar = tqdm(total=total, initial=have, unit="B", unit_scale=True, desc=dest.name)
                with open(part, mode) as fh:
                    while piece := r.read(chunk):
                        fh.write(piece)
                        if bar is not None:
                            bar.update(len(piece))
            have = part.stat().st_size
            if total is None or have == total:
                break
            raise DownloadError(f"{url}: connection closed at byte {have} of {total}")
        except urllib.error.HTTPError as e:
            if e.code == 416 and total is not None and have == total:
                break
            if e.code == 416 and have:  # our partial file does not fit the remote one
                part.unlink()
                failures += 1
            elif e.code < 500:
                raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from e
            failures += 1
            err = e
        except (urllib.error.URLError, OSError, DownloadError, http.client.HTTPException) as e:
            if isinstance(e, DownloadError) and "server answered" in str(e):
                raise
            failures += 1
            err = e
        else:
            continue
        if failures > retries:
            if bar is not None:
                bar.close()
            have = part.stat().st_size if part.exists() else 0
            if part.exists() and not have:
                part.unlink()
            kept = f"; {part} keeps {have:,} bytes and the next run resumes it" if have else ""
            raise DownloadError(f"{url}: gave up after {failures} failed attempts to download it to {dest} "
                                f"({' '.join(str(err).split())}){kept}")
        log.warning("%s: %s; retry %d of %d from byte %d", url, err, failures, retries,
                    part.stat().st_size if part.exists() else 0)
        time.sleep(backoff * failures)
    if bar is not None:
        bar.close()
    size = part.stat().st_size
    if total is not None and size != total:
        raise DownloadError(f"{url}: {part} has {size} bytes, expected {total}")
    if md5:
        got = _md5(part)
        if got != md5.lower():
            part.unlink()
            raise DownloadError(f"{url}: MD5 {got} does not match the published {md5}; the partial file "
                                f"was removed, run again to download afresh")
    os.replace(part, dest)
    log.info("downloaded %s -> %s (%d bytes%s)", url, dest, size, ", MD5 verified" if md5 else "")
    return dest

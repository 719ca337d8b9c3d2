"""Files on disk: hashing, locks, atomic writes, and the record of what a run wrote.

Every writer in the project goes through here, so three promises hold everywhere:

- a file that exists is whole (written beside, then renamed over the old one);
- a command deletes or replaces only files it wrote itself, recorded as it wrote them in a
  :class:`WrittenFiles` journal (never by name or by pattern; the one exception, where the
  process owns the folder: :func:`dead_temporaries`, the hidden ``.<name>.<pid>.tmp`` of a
  recorded file or journal that a killed process of this tool left mid-write);
- one output has one writer at a time (:func:`exclusive_lock`; a second process gets one
  line, not a mixed file).

No torch import: the data preparation and the CLI use this module too.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from .errors import UserError

#: the files that make a folder a model's (hub/load.py opens them): an export's config.json, and what
#: finetune writes beside its weights; kept here, below hub/ and training/, which both ask
MODEL_CONFIG, FINETUNE_CONFIG = "config.json", "finetune.json"


def is_model_folder(path) -> bool:
    """True for a folder an export or finetune wrote (or began to write)."""
    p = Path(path)
    return p.is_dir() and ((p / MODEL_CONFIG).is_file() or (p / FINETUNE_CONFIG).is_file())


# --- hashing ----------------------------------------------------------------------------
def file_sha256(path: str | Path, cache_dir: str | Path | None = None) -> str:
    """SHA-256 of a file's bytes; with ``cache_dir``, remembered by (path, size, mtime) so a
    50 GB source is hashed once, not at every start."""
    path = Path(path).resolve()
    memo = None
    if cache_dir is not None:
        st = path.stat()
        key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
        memo = Path(cache_dir) / "checksums" / f"{key}.sha256"
        if memo.is_file():
            return memo.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        write_text(memo, digest + "\n")
    return digest


# --- atomic writes ----------------------------------------------------------------------
def temp_path(path: str | Path) -> Path:
    """Where ``path``'s new content is written before the rename: beside it, hidden, per process."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def dead_temporaries(path: str | Path) -> list[Path]:
    """``temp_path(path)`` files of processes that no longer run: what a kill inside
    :func:`atomic_path` leaves, named by its pid (only this tool writes that name). Pids are
    this machine's: act on them only where this process owns the folder (a lock, rank zero),
    never where a process on another node may be writing."""
    path = Path(path)
    prefix = f".{path.name}."
    found = []
    for p in sorted(path.parent.glob(f"{glob.escape(prefix)}*.tmp")) if path.parent.is_dir() else ():
        pid = p.name[len(prefix):-len(".tmp")]
        if pid.isascii() and pid.isdigit() and not process_alive(int(pid)):
            found.append(p)
    return found


def remove_dead_temporaries(path: str | Path) -> None:
    """Remove :func:`dead_temporaries` of ``path`` (only where this process owns the folder)."""
    for p in dead_temporaries(path):
        remove_path(p)


def process_alive(pid: int) -> bool:
    """False only when no process ``pid`` exists here (unsure: True, the file stays)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # someone else's process, or no valid pid
        return True
    return True


@contextlib.contextmanager
def atomic_path(path: str | Path, *, fixed_temp: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block ends without error, rename it
    over ``path`` (a file or a folder); on error, remove it. The old ``path`` stays until the
    new one is whole. ``fixed_temp``: the temporary is ``<name>.tmp``, not hidden and per process,
    for a writer that holds its output's lock (data preparation): a rerun replaces what a kill left."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp") if fixed_temp else temp_path(path)
    remove_path(tmp)
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():  # a folder cannot be renamed over a folder: swap
            old = path.with_name(f".{path.name}.{os.getpid()}.old")
            os.replace(path, old)
            os.replace(tmp, path)
            remove_path(old)
        else:
            os.replace(tmp, path)
    finally:
        remove_path(tmp)


def remove_path(p: str | Path) -> None:
    p = Path(p)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes, *, fixed_temp: bool = False) -> Path:
    with atomic_path(path, fixed_temp=fixed_temp) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | Path, text: str, *, fixed_temp: bool = False) -> Path:
    return write_bytes(path, text.encode(), fixed_temp=fixed_temp)


def write_json(path: str | Path, obj, indent: int | None = 1, *, fixed_temp: bool = False) -> Path:
    """``obj`` as JSON (and a newline), written whole or not at all (:func:`atomic_path`)."""
    return write_text(path, json.dumps(obj, indent=indent) + "\n", fixed_temp=fixed_temp)


# --- locks ------------------------------------------------------------------------------
@contextlib.contextmanager
def exclusive_lock(path: str | Path, *, wait: bool = False, what: str | None = None,
                   remove: bool = False) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing; released if the process
    dies). ``wait=False``: when another process holds it, a one-line :class:`UserError` naming
    ``what`` (the output it guards) instead of waiting. ``remove``: delete the lock file on
    release if this call created it (a lock file that was there stays); a process that locked
    a file removed meanwhile tries again on the new one, so two never hold one output."""
    import fcntl
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        created = not os.path.lexists(path)
        fh = open(path, "a")
        try:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                raise UserError(f"{what or path}: another process is writing it now (lock {path}); "
                                f"wait for it to finish or choose another output") from None
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current != os.fstat(fh.fileno()).st_ino:  # its holder removed it when done: lock the new one
                continue
            try:
                yield
            finally:
                if remove and created:
                    path.unlink(missing_ok=True)  # still locked: a waiting process sees the removal
                fcntl.flock(fh, fcntl.LOCK_UN)
            return
        finally:
            fh.close()
    raise UserError(f"{what or path}: could not lock {path} (it keeps being replaced)")


# --- what a run wrote -------------------------------------------------------------------
class WrittenFiles:
    """A journal (one JSON file) of the paths a command created, appended as it creates them,
    so a cleanup or an ``overwrite`` removes exactly those and nothing a user put beside them.

    ``record`` is called *before* the file is created (a kill between the two leaves a
    recorded name with no file, which is harmless); ``seal``, where a writer calls it, notes what
    the file holds once written, so that a user's later edit shows (:meth:`unchanged`);
    ``remove_all`` deletes the recorded paths, then the journal itself."""

    def __init__(self, journal: str | Path):
        self.journal = Path(journal)
        self.paths: list[str] = []
        self.hashes: dict[str, str] = {}  # key -> SHA-256 of what was written (sealed paths only)
        if self.journal.is_file():
            try:
                data = json.loads(self.journal.read_text())
                self.paths, self.hashes = list(data.get("written", [])), dict(data.get("sha256", {}))
            except (ValueError, AttributeError, TypeError):
                raise UserError(f"{self.journal}: not a journal this tool wrote (unreadable JSON)") from None
        self._keys = set(self.paths)  # membership in O(1): a run may write 100,000 files

    def _key(self, p: str | Path) -> str:
        p = Path(p)
        try:
            return str(p.resolve().relative_to(self.journal.parent.resolve()))
        except ValueError:
            return str(p.resolve())

    def __contains__(self, p: str | Path) -> bool:
        return self._key(p) in self._keys

    def record(self, p: str | Path, *more: str | Path) -> Path:
        """Record ``p`` (and ``more``: a batch costs one journal write, not one per file)."""
        new = [k for k in dict.fromkeys(self._key(x) for x in (p, *more)) if k not in self._keys]
        if new:
            self.paths += new
            self._keys.update(new)
            self._save()
        return Path(p)

    def seal(self, *paths: str | Path) -> None:
        """Note what ``paths`` (recorded, just written whole) hold: a file the tool wrote and a user
        then changed is the user's (:meth:`unchanged`)."""
        self.hashes.update((self._key(p), file_sha256(p)) for p in paths)
        self._save()

    def unchanged(self, p: str | Path) -> bool:
        """``p`` holds what was written there (:meth:`seal`); False for a path never sealed."""
        digest = self.hashes.get(self._key(p))
        return digest is not None and Path(p).is_file() and file_sha256(p) == digest

    def forget(self, p: str | Path) -> None:
        key = self._key(p)
        if key in self._keys:
            self.paths.remove(key)
            self._keys.discard(key)
            self.hashes.pop(key, None)
            self._save()

    def _save(self) -> None:
        write_json(self.journal, {"written": self.paths, **({"sha256": self.hashes} if self.hashes else {})})

    def remove_dead_temporaries(self) -> None:
        """What a kill inside the journal's own atomic write left (it cannot record its own
        temporary file); only where this process owns the folder."""
        remove_dead_temporaries(self.journal)

    def path_of(self, key: str) -> Path:
        p = Path(key)
        return p if p.is_absolute() else self.journal.parent / p

    def remove(self, p: str | Path) -> None:
        """Delete ``p`` only if this journal recorded it."""
        if p in self:
            remove_path(p)
            self.forget(p)

    def remove_all(self) -> None:
        for key in reversed(self.paths):
            remove_path(self.path_of(key))
        self.paths, self._keys, self.hashes = [], set(), {}
        self.journal.unlink(missing_ok=True)

"""The one output guard every command's writer goes through.

Before a command does any work it names its inputs and every path it will write; the guard
answers, in one line (:class:`~protein_performer.errors.UserError`), an output that would
destroy something the command did not make:

- an output that **is an input**, or **lies inside one** (a file of an exported directory given
  as ``ckpt``), or (an output folder replaced or filled as a whole) **holds one**: paths compared
  as the file system resolves them (symlinks followed; hard links by inode);
- a **name derived from a user's value** (``evaluate names=...``, a file of an input folder) that
  would leave the command's output folder: an absolute name, ``..``, a ``/``, or a symlink out;
- **two outputs at one path** (``names=[metrics.json]`` beside ``metrics.json``);
- an **existing file the command cannot tell it wrote** (its folder's journal,
  :data:`JOURNAL`, lists what it wrote and what each file held: one a user changed since is the
  user's), unless ``overwrite=true``; and even then only after a warning line naming it on stderr,
  before any work.

:meth:`OutputGuard.sweep` removes what a killed run of the command left beside its outputs.

Folder outputs with their own journal (export, finetune, embed's pt_dir, a training run folder)
use :meth:`OutputGuard.folder` for the path checks and keep their journal's rules for the files
inside. No torch import: the CLI and the data preparation use this module too.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import UserError
from .files import WrittenFiles, remove_dead_temporaries

#: the journal of the files a command wrote into an output folder of its own (evaluate's
#: output_dir, compare's): what it may replace again without ``overwrite=true``
JOURNAL = ".protein-performer-written.json"


def real(path: str | Path) -> Path:
    """``path`` as the file system resolves it: absolute, ``~`` expanded, symlinks followed
    (also a path that does not exist yet: its existing part is resolved)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _same(a: Path, b: Path) -> bool:
    """``a`` and ``b`` (resolved) are one file: the same path, or hard links of one inode."""
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _flatten(inputs: Mapping[str, Any]) -> dict[str, str]:
    """``{key: path | [paths] | None}`` -> ``{key or key[i]: path}``, the Nones and empties left out."""
    out = {}
    for key, value in inputs.items():
        if value is None or value == "":
            continue
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if v is not None and v != "":
                    out[f"{key}[{i}]"] = str(v)
        else:
            out[key] = str(value)
    return out


class OutputGuard:
    """The checks for one command's outputs (see the module's docstring).

    ``command``: how warnings name the command. ``inputs``: ``{key: path | [paths] | None}``,
    every file or folder the command reads (checkpoint, export directory, input table, FASTA,
    embeddings, labels). ``overwrite``: the command's ``overwrite=true``. ``folder``: the
    command's own output folder, whose :data:`JOURNAL` records what it wrote there (``journal``
    true) so that a rerun replaces its own files without ``overwrite``; :meth:`record` adds to it
    just before a file is written, :meth:`seal` notes what it holds once written."""

    def __init__(self, command: str, inputs: Mapping[str, Any] | None = None, *, overwrite: bool = False,
                 folder: str | Path | None = None, journal: bool = False):
        self.command, self.overwrite = command, bool(overwrite)
        self.inputs = {k: (v, real(v)) for k, v in _flatten(inputs or {}).items()}
        self.claimed: dict[Path, tuple[str, bool]] = {}  # resolved path -> (key=path, a file?)
        self.folder = None if folder is None else Path(folder)
        self._journal = None
        if journal and self.folder is not None:
            self._journal = WrittenFiles(self.folder / JOURNAL) if (self.folder / JOURNAL).is_file() else None
        self._journal_wanted = journal and self.folder is not None
        self.warned: list[Path] = []
        self.files: list[Path] = []  # the output files checked, as given: what :meth:`sweep` looks beside

    # --- the checks ---------------------------------------------------------------------
    def overlap(self, key: str, path: str | Path, *, holds: bool = False) -> None:
        """One line when ``path`` is an input or lies inside one; ``holds=False`` also when it
        holds one (a folder the command replaces or fills as a whole)."""
        op = real(path)
        for ik, (given, ip) in self.inputs.items():
            if _same(op, ip):
                raise UserError(f"{key}={path}: is the input {ik}={given}; choose another {key}")
            if op.is_relative_to(ip):
                raise UserError(f"{key}={path}: lies inside the input {ik}={given}; choose another {key}")
            if not holds and ip.is_relative_to(op):
                raise UserError(f"{key}={path}: holds the input {ik}={given}; choose another {key}")

    def _claim(self, key: str, path: str | Path, is_file: bool) -> None:
        """Two outputs at one path, or one inside an output file (or a file around another output)."""
        rp = real(path)
        for other, (okey, other_file) in self.claimed.items():
            if rp == other or (other_file and rp.is_relative_to(other)) or (is_file and other.is_relative_to(rp)):
                raise UserError(f"{key}={path}: {'is' if rp == other else 'overlaps'} the output {okey}; "
                                f"give each output its own path")
        self.claimed[rp] = (f"{key}={path}", is_file)

    def file(self, key: str, path: str | Path | None, *, ours: Callable[[Path], bool] | None = None,
             holds: bool = False) -> Path | None:
        """Check an output file (None: none): not an input nor inside one, no other output's path,
        not a folder, and if it exists, one this command wrote (the folder's journal, or
        ``ours(path)``) or ``overwrite=true`` (and then a warning line now)."""
        if path is None:
            return None
        p = Path(path)
        self.overlap(key, p, holds=holds)
        self._claim(key, p, True)
        above = next((d for d in p.parents if d.exists() and not d.is_dir()), None)
        if above is not None:
            raise UserError(f"{key}={path}: {above} is a file, not a folder")
        if p.is_dir():
            raise UserError(f"{key}={path}: is a directory; give a file path")
        if os.path.lexists(p) and not self.wrote(p, ours):
            if not self.overwrite:
                raise UserError(f"{key}={path}: exists; pass overwrite=true to replace it ({self._whose(p)}) "
                                f"or choose another {key}")
            self.warn(p, key)
        self.files.append(p)
        return p

    def folder_path(self, key: str, path: str | Path | None, *, holds: bool = True) -> Path | None:
        """Check an output folder (None: none): not an input nor inside one, no other output's path,
        not a file; ``holds=False`` for a folder replaced or filled as a whole (it must not hold an
        input). What may be replaced inside it is the folder's own journal's business."""
        if path is None:
            return None
        p = Path(path)
        self.overlap(key, p, holds=holds)
        self._claim(key, p, False)
        for d in (p, *p.parents):
            if d.exists():
                if not d.is_dir():
                    raise UserError(f"{key}={path}: {d} is a file, not a folder" if d != p else
                                    f"{key}={path}: exists and is not a directory")
                break
        return p

    def child(self, folder: str | Path, name: Any, key: str, folder_key: str = "output_dir") -> Path:
        """``folder / name`` for a ``name`` taken from a user's value (a label, a file name): one
        folder or file name that stays inside ``folder``, or one line."""
        text = str(name)
        if (not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text
                or os.path.isabs(text)):
            raise UserError(f"{key}={text!r}: not a plain name; it names a path inside {folder_key}={folder}, "
                            f"so it must be one file name without '/' or '..'")
        p = Path(folder) / text
        if not real(p).is_relative_to(real(folder)):
            raise UserError(f"{key}={text!r}: {p} leads out of {folder_key}={folder} (a symlink); choose another name")
        return p

    # --- what the command wrote ---------------------------------------------------------
    def wrote(self, path: Path, ours: Callable[[Path], bool] | None = None) -> bool:
        """Whether the command can tell it wrote ``path``: recorded in its folder's journal and holding
        what it wrote there (a file a user changed since is the user's), or ``ours(path)`` (which may
        also refuse in one line itself, raising a UserError)."""
        if self._journal is not None and self._journal.unchanged(path):
            return True
        if ours is not None:
            try:
                return bool(ours(Path(path)))
            except OSError:
                return False
        return False

    def record(self, *paths: str | Path) -> None:
        """Record ``paths`` in the output folder's journal just before they are written (only
        those inside the folder; a no-op without a journal)."""
        if not self._journal_wanted:
            return
        inside = [p for p in paths if real(p).is_relative_to(real(self.folder))]
        if not inside:
            return
        if self._journal is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._journal = WrittenFiles(self.folder / JOURNAL)
        self._journal.record(*inside)

    def seal(self, *paths: str | Path) -> None:
        """Note in the journal what ``paths`` (recorded, just written) hold: a later change makes them
        the user's (a no-op without a journal)."""
        inside = [p for p in paths if self._journal is not None and Path(p) in self._journal and Path(p).is_file()]
        if inside:
            self._journal.seal(*inside)

    def sweep(self) -> None:
        """Remove the hidden temporaries that a killed run of this command left beside the output files
        checked (and the folder's journal): those of dead processes, as finetune sweeps its output_dir
        (:func:`~protein_performer.files.remove_dead_temporaries`). Pids are this machine's: for commands
        that write from one process."""
        for p in [*self.files, *([self.folder / JOURNAL] if self._journal_wanted else [])]:
            remove_dead_temporaries(p)

    def _whose(self, path: Path) -> str:
        if self._journal is not None and Path(path) in self._journal:
            return f"changed since {self.command} wrote it"
        return f"a file {self.command} did not record writing"

    def warn(self, path: Path, key: str) -> None:
        if path not in self.warned:
            self.warned.append(path)
            print(f"warning: {key}: overwrite=true replaces {path}, {self._whose(path)}", file=sys.stderr,
                  flush=True)


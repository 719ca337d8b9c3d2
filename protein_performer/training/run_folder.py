"""Where a training run writes, what it may replace, and what a failed one leaves there.

A run folder holds one run: ``config.yaml``, ``checkpoints/``, Hydra's ``.hydra/`` and
``<job>.log``, and a journal (``.protein-performer.json``, :class:`files.WrittenFiles`)
of the files the tool wrote there. Everything that deletes or replaces a file goes by
that journal, never by name:

- before Hydra writes anything (``cli.run`` composes the config first), :func:`open_run_folder`
  refuses a folder whose ``config.yaml`` / ``<job>.log`` / ``.hydra/`` the tool did not write
  (``hydra.run.dir=.`` in a project of the user's own) or that holds another run's
  checkpoints, and notes which paths this invocation is about to create;
- a run that stops on a user error (:meth:`RunFolder.discard_on_user_error`) removes exactly
  those paths again, so a typo leaves no folder and the user's files stay as they were;
- ``overwrite=true`` moves the old checkpoints and config aside only when training starts and
  deletes them once it succeeded (:func:`replacing_run`): a run that fails puts them back;
- an old best checkpoint is deleted only if this folder's journal recorded it (a resume
  from another folder never deletes that folder's files).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import UserError, user_error
from ..files import WrittenFiles

JOURNAL = ".protein-performer.json"
HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")
REPLACED = ".replaced"  # <run>/.replaced/: the old run's checkpoints and config while overwrite=true trains


def journal(run_dir: str | Path) -> WrittenFiles:
    return WrittenFiles(Path(run_dir) / JOURNAL)


def checkpoints_in(ckpt_dir: str | Path) -> list[Path]:
    ckpt_dir = Path(ckpt_dir)
    return sorted(ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []


def check_run_folder(ckpt_dir: str | Path, ckpt_path: str | None, overwrite: bool) -> None:
    """Refuse a folder that already holds checkpoints, unless resuming from it or overwriting."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir.parent / REPLACED).exists():
        raise UserError(f"{ckpt_dir.parent / REPLACED}: holds the checkpoints and config.yaml an interrupted "
                        f"overwrite=true run was replacing; move them back (checkpoints into {ckpt_dir}) "
                        f"or delete them, then rerun")
    found = checkpoints_in(ckpt_dir)
    if not found or overwrite:
        return
    if ckpt_path and Path(ckpt_path).resolve().parent == ckpt_dir.resolve():
        return  # resuming this very run: it goes on writing its own last.ckpt
    names = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
    raise UserError(f"{ckpt_dir}: already holds checkpoints ({names}) of another run: resume it with "
                    f"ckpt_path={ckpt_dir / 'last.ckpt'}, train into a new folder (hydra.run.dir=...), "
                    f"or set overwrite=true to replace them")


def check_own_files(run_dir: str | Path, names: tuple[str, ...]) -> None:
    """Refuse to write ``names`` into ``run_dir`` where a file of that name exists that no run
    of this tool wrote (not in the journal; a folder holding checkpoints is a run's, journal or not)."""
    run_dir = Path(run_dir)
    if checkpoints_in(run_dir / "checkpoints"):
        return
    ours = journal(run_dir)
    foreign = [n for n in names if (run_dir / n).exists() and run_dir / n not in ours]
    if foreign:
        raise UserError(f"{run_dir}: already holds {', '.join(foreign)}, not written by a training run; "
                        f"a run would replace them: train into a new folder (hydra.run.dir=...)")


def check_folder_path(path: str | Path, key: str) -> None:
    """A folder to create, below a regular file: one line before anything is written."""
    for d in (Path(path), *Path(path).parents):
        if d.exists():
            if not d.is_dir():
                raise UserError(f"{key}={path}: {d} is a file, not a folder")
            return


class RunFolder:
    """What this invocation is about to create in a run folder (see :func:`open_run_folder`)."""

    def __init__(self, run_dir: Path, created: list[Path]):
        self.dir, self.created = run_dir, created

    @contextlib.contextmanager
    def discard_on_user_error(self):
        """On a user error, remove the paths this invocation created (Hydra's files, the
        config, the journal, the folders), unless it wrote checkpoints; a bug keeps all."""
        try:
            yield
        except Exception as e:
            if user_error(e) is not None and not checkpoints_in(self.dir / "checkpoints"):
                self.discard()
            raise

    def discard(self) -> None:
        written = journal(self.dir)
        for p in reversed(self.created):  # files first, then folders deepest first (only if empty)
            if p.is_dir() and not p.is_symlink():
                with contextlib.suppress(OSError):
                    p.rmdir()
            elif p.name != JOURNAL:
                p.unlink(missing_ok=True)
                written.forget(p)
            elif p.exists():  # a journal this invocation created: nothing of it stays
                written.journal.unlink()


def open_run_folder(run_dir: str | Path, job_name: str, ckpt_path: str | None, overwrite: bool) -> RunFolder:
    """Check a training run folder before Hydra writes into it; record (in its journal) the
    files Hydra and the run will write, and return what this invocation creates."""
    run_dir = Path(run_dir).absolute()
    check_folder_path(run_dir, "hydra.run.dir")
    names = (*HYDRA_FILES, f"{job_name}.log", "config.yaml")
    check_run_folder(run_dir / "checkpoints", ckpt_path, overwrite)
    check_own_files(run_dir, names)
    missing_dirs = [d for d in (run_dir, *run_dir.parents) if not d.exists()][::-1]
    created = missing_dirs + [p for p in (run_dir / ".hydra", run_dir / "checkpoints", run_dir / JOURNAL,
                                          *(run_dir / n for n in names)) if not p.exists()]
    written = journal(run_dir)
    for n in names:  # recorded before they are written
        written.record(run_dir / n)
    return RunFolder(run_dir, created)


@contextlib.contextmanager
def replacing_run(run_dir: str | Path, written: WrittenFiles, enabled: bool):
    """``overwrite=true``: the old run's checkpoints and ``config.yaml`` wait in ``.replaced/``
    while the new run trains; they are deleted when it succeeded and put back when it fails
    (what it wrote removed first). Rank zero only."""
    run_dir = Path(run_dir)
    old = checkpoints_in(run_dir / "checkpoints") if enabled else []
    if not old:
        yield
        return
    old += [p for p in (run_dir / "config.yaml",) if p.is_file()]
    aside = run_dir / REPLACED
    aside.mkdir()
    for p in old:
        os.replace(p, aside / p.name)
    try:
        yield
    except BaseException:
        for p in (*checkpoints_in(run_dir / "checkpoints"), run_dir / "config.yaml"):
            if p.exists() and p in written:
                p.unlink()
        for p in old:
            os.replace(aside / p.name, p)
        aside.rmdir()
        raise
    for p in old:
        (aside / p.name).unlink()
    aside.rmdir()

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
- Hydra's ``.hydra/`` of an earlier run stays as it is until the new run succeeded: Hydra writes
  the new one into ``.hydra.pending/`` (:data:`PENDING_HYDRA`), moved over it at the end
  (:meth:`RunFolder.running`), so a failed run never describes itself as the folder's run;
- the output guard (:func:`guard_run_folder`): no file the run writes is one of its inputs
  (data, ``init_from``, the teacher, ``ckpt_path``), and ``overwrite=true`` replaces no
  ``checkpoints/`` that holds one;
- an old best checkpoint is deleted only if this folder's journal recorded it (a resume
  from another folder never deletes that folder's files).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import UserError, user_error
from ..files import WrittenFiles, is_model_folder, write_bytes
from ..output_guard import OutputGuard

JOURNAL = ".protein-performer.json"
HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")
PENDING_HYDRA = ".hydra.pending"  # where Hydra writes while an earlier run's .hydra/ stays in place
REPLACED = ".replaced"  # <run>/.replaced/: the old run's checkpoints and config while overwrite=true trains


def journal(run_dir: str | Path) -> WrittenFiles:
    return WrittenFiles(Path(run_dir) / JOURNAL)


def checkpoints_in(ckpt_dir: str | Path) -> list[Path]:
    ckpt_dir = Path(ckpt_dir)
    return sorted(ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []


def _checkpoint_states(run_dir: Path) -> dict[str, tuple[int, int, int]]:
    """``checkpoints/*.ckpt`` -> (inode, size, mtime): what tells whether a run wrote one."""
    states = {}
    for p in checkpoints_in(Path(run_dir) / "checkpoints"):
        with contextlib.suppress(OSError):
            st = p.stat()
            states[p.name] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return states


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


def check_not_a_model(run_dir: Path) -> None:
    """A model's folder (an export or a finetune output) is not a run folder, as export refuses a run
    folder for its output: a run would mix its files into what others open as a model."""
    if is_model_folder(run_dir):
        raise UserError(f"hydra.run.dir={run_dir}: is a model's folder (export or finetune wrote it), not a "
                        f"training run's; train into a new folder (hydra.run.dir=...)")


def run_inputs(cfg) -> dict:
    """The files a training run reads (for the output guard): ``{key: path or None}``."""
    data, distill = cfg.get("data") or {}, cfg.get("distill") or {}
    return {"data.path": data.get("path"), "ckpt_path": cfg.get("ckpt_path"), "init_from": cfg.get("init_from"),
            "distill.teacher": distill.get("teacher")}


def guard_run_folder(run_dir: str | Path, inputs: dict, overwrite: bool, job_name: str = "train") -> None:
    """The output guard for a run folder: it may hold inputs (a resume's own ``last.ckpt``), but
    no file the run writes is, or lies inside, an input, and with ``overwrite`` the
    ``checkpoints/`` it replaces holds none."""
    run_dir = Path(run_dir)
    guard = OutputGuard("train", inputs, overwrite=overwrite)
    guard.folder_path("hydra.run.dir", run_dir)
    for name in (*HYDRA_FILES, PENDING_HYDRA, f"{job_name}.log", "config.yaml", JOURNAL, REPLACED):
        guard.overlap(f"hydra.run.dir/{name}", run_dir / name)
    guard.overlap("hydra.run.dir/checkpoints", run_dir / "checkpoints", holds=not overwrite)


class RunFolder:
    """What this invocation is about to create in a run folder (see :func:`open_run_folder`);
    ``hydra_dir``: where Hydra writes its files (``.hydra``, or :data:`PENDING_HYDRA` while an
    earlier run's ``.hydra/`` stays until this run succeeds)."""

    def __init__(self, run_dir: Path, created: list[Path], hydra_dir: str = ".hydra", job_name: str = "train"):
        self.dir, self.created, self.hydra_dir = run_dir, created, hydra_dir
        # what was there before: a failed run that wrote no checkpoint leaves the folder as it was
        # (the journal's bytes, the old run's log at its old length)
        self.checkpoints = _checkpoint_states(run_dir)
        j, self.log = run_dir / JOURNAL, run_dir / f"{job_name}.log"
        self.journal_bytes = j.read_bytes() if j.is_file() and j not in created else None
        self.log_size = self.log.stat().st_size if self.log.is_file() and self.log not in created else None

    @contextlib.contextmanager
    def running(self):
        """The run: on a user error, :meth:`discard_on_user_error`; on any failure, Hydra's new
        files (written beside the old run's) go; on success they replace the old run's."""
        try:
            with self.discard_on_user_error():
                yield
        except BaseException:
            if self.hydra_dir != ".hydra":
                self._drop_pending()
            raise
        if self.hydra_dir != ".hydra":
            self._promote_pending()

    def _pending_files(self) -> list[tuple[Path, Path]]:
        return [(self.dir / PENDING_HYDRA / Path(n).name, self.dir / n) for n in HYDRA_FILES]

    def _drop_pending(self) -> None:
        written = journal(self.dir)
        for new, _ in self._pending_files():
            if new in written:
                new.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (self.dir / PENDING_HYDRA).rmdir()

    def _promote_pending(self) -> None:
        for new, old in self._pending_files():
            if new.is_file():
                old.parent.mkdir(exist_ok=True)
                os.replace(new, old)  # each file whole: the old run's, or this run's
        with contextlib.suppress(OSError):
            (self.dir / PENDING_HYDRA).rmdir()

    @contextlib.contextmanager
    def discard_on_user_error(self):
        """On a user error, remove the paths this invocation created (Hydra's files, the
        config, the journal, the folders) and put back the journal and the old run's log as they
        were, unless it wrote (or changed) checkpoints; a bug keeps all."""
        try:
            yield
        except Exception as e:
            if user_error(e) is not None and _checkpoint_states(self.dir) == self.checkpoints:
                self.discard()
                self._restore()
            raise

    def _restore(self) -> None:
        """The journal's old bytes and the old run's log cut back to its old length (Hydra appends)."""
        with contextlib.suppress(OSError):
            if self.journal_bytes is not None:
                write_bytes(self.dir / JOURNAL, self.journal_bytes)
            if self.log_size is not None and self.log.is_file() and self.log.stat().st_size > self.log_size:
                os.truncate(self.log, self.log_size)

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


def open_run_folder(run_dir: str | Path, job_name: str, ckpt_path: str | None, overwrite: bool,
                    inputs: dict | None = None) -> RunFolder:
    """Check a training run folder before Hydra writes into it (``inputs``: what the run reads,
    for the output guard); record (in its journal) the files Hydra and the run will write, and
    return what this invocation creates. Where an earlier run's ``.hydra/`` is, Hydra writes to
    :data:`PENDING_HYDRA` (``hydra.output_subdir``: the caller passes it on)."""
    run_dir = Path(run_dir).absolute()
    check_folder_path(run_dir, "hydra.run.dir")
    check_not_a_model(run_dir)
    names = (*HYDRA_FILES, f"{job_name}.log", "config.yaml")
    check_run_folder(run_dir / "checkpoints", ckpt_path, overwrite)
    check_own_files(run_dir, names)
    if inputs is not None:
        guard_run_folder(run_dir, inputs, overwrite, job_name)
    hydra_dir = PENDING_HYDRA if any((run_dir / n).is_file() for n in HYDRA_FILES) else ".hydra"
    pending = tuple(f"{PENDING_HYDRA}/{Path(n).name}" for n in HYDRA_FILES) if hydra_dir != ".hydra" else ()
    missing_dirs = [d for d in (run_dir, *run_dir.parents) if not d.exists()][::-1]
    created = missing_dirs + [p for p in (run_dir / ".hydra", run_dir / PENDING_HYDRA, run_dir / "checkpoints",
                                          run_dir / JOURNAL, *(run_dir / n for n in (*names, *pending)))
                              if not p.exists() and (p.name != PENDING_HYDRA or pending)]
    folder = RunFolder(run_dir, created, hydra_dir, job_name)  # (the journal as it was: before this record)
    written = journal(run_dir)
    written.record(*(run_dir / n for n in (*names, *pending)))  # recorded before they are written
    return folder


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

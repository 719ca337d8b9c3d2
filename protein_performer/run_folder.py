"""Where a training run writes, and what a failed one leaves there.

Hydra creates the run folder (``.hydra/``, ``<job>.log``) before the command runs. A run
that stops on a user error before it wrote anything of its own removes those files again,
so a typo leaves no folder to mistake for a run. And a run never writes into a folder that
holds another run's checkpoints, unless it resumes that run (``ckpt_path`` inside it) or
is told to replace them (``overwrite=true``): one folder, one run, one ``last.ckpt``.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .errors import USER_ERRORS, UserError

HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


def checkpoints_in(ckpt_dir: str | Path) -> list[Path]:
    ckpt_dir = Path(ckpt_dir)
    return sorted(ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []


def check_run_folder(ckpt_dir: str | Path, ckpt_path: str | None, overwrite: bool) -> None:
    """Refuse a folder that already holds checkpoints, unless resuming from it or overwriting."""
    found = checkpoints_in(ckpt_dir)
    if not found or overwrite:
        return
    if ckpt_path and Path(ckpt_path).resolve().parent == Path(ckpt_dir).resolve():
        return  # resuming this very run: it goes on writing its own last.ckpt
    names = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
    raise UserError(f"{ckpt_dir}: already holds checkpoints ({names}) of another run: resume it with "
                    f"ckpt_path={Path(ckpt_dir) / 'last.ckpt'}, train into a new folder (hydra.run.dir=...), "
                    f"or set overwrite=true to replace them")


def remove_checkpoints(ckpt_dir: str | Path) -> None:
    """``overwrite=true``: the old run's checkpoints go, so no stale best-<step>.ckpt stays beside the new ones."""
    for p in checkpoints_in(ckpt_dir):
        p.unlink()


@contextlib.contextmanager
def discard_on_user_error(run_dir: str | Path, job_name: str, *, stop_at: str | Path | None = None):
    """On a user error, remove Hydra's files and what the run wrote before training
    (``config.yaml``), then the folder and its empty parents up to ``stop_at`` (the working
    directory), unless the folder holds checkpoints. Only known files are removed."""
    try:
        yield
    except USER_ERRORS:
        run_dir = Path(run_dir)
        if not checkpoints_in(run_dir / "checkpoints"):
            for name in (*HYDRA_FILES, f"{job_name}.log", "config.yaml"):
                (run_dir / name).unlink(missing_ok=True)
            _remove_empty(run_dir / ".hydra", run_dir / "checkpoints")
            stop = Path(stop_at or os.getcwd()).resolve()
            d = run_dir.resolve()
            while d != stop and _remove_empty(d) and stop in d.parents:
                d = d.parent
        raise


def _remove_empty(*dirs: Path) -> bool:
    ok = True
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            ok = False
    return ok

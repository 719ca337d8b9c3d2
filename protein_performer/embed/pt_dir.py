"""The ESM-compatible output: a directory of ``<id>.pt`` files, of which embed replaces or
removes only the ones it recorded writing."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from ..errors import UserError
from ..files import WrittenFiles, remove_path
from .identity import differences, refuse, safe_name

#: ESM's key for each pooling in ``<id>.pt`` files
PT_KEYS = {"mean": "mean_representations", "cls": "bos_representations", "max": "max_representations"}


class PtOutput:
    """ESM-compatible directory: one ``<id>.pt`` per protein holding ``label``,
    ``mean_representations`` / ``bos_representations`` / ``max_representations`` and,
    with per-residue output, ``representations``, each keyed by absolute layer number.

    Every file embed puts there is recorded first in ``.protein-performer-written.json``
    (:class:`~protein_performer.files.WrittenFiles`; all of a run's names at its start, one
    journal write however many proteins): ``overwrite`` removes those and nothing else, and a
    ``.pt`` a user put there is never replaced (refused before work starts). Files
    are written in ``.protein-performer-tmp/`` (recorded) and renamed into place, so a file that
    exists is whole and a kill leaves nothing unrecorded. ``embed_settings.json`` records the
    identity; files of another identity are refused (``overwrite``: removed first). The
    constructor only checks; :meth:`open` is the first change on disk."""

    WRITTEN, SETTINGS, STAGING, LOCK = (".protein-performer-written.json", "embed_settings.json",
                                        ".protein-performer-tmp", ".protein-performer.lock")

    def __init__(self, directory: str | Path, identity: dict, overwrite: bool, names: list[str]):
        self.dir, self.identity, self.overwrite = Path(directory), identity, overwrite
        self.written = WrittenFiles(self.dir / self.WRITTEN)
        self.settings, self.staging = self.dir / self.SETTINGS, self.dir / self.STAGING
        self.files = [self.dir / f"{n}.pt" for n in names]
        for p in [self.settings, self.staging] + self.files:
            if os.path.lexists(p) and p not in self.written:
                raise UserError(f"pt_dir {p}: exists and was not written by embed (not recorded in "
                                f"{self.WRITTEN}); refusing to replace it: move it or choose another pt_dir")
        self.old = {}
        if self.settings.is_file():
            with contextlib.suppress(ValueError):
                self.old = json.loads(self.settings.read_text())
        mine = [k for k in self.written.paths if k.endswith(".pt") and (self.dir / k).is_file()]
        self.diff = differences(self.old, identity) if mine else ""  # settings matter once files exist
        if self.diff and not overwrite:
            refuse(f"pt_dir {self.dir}", self.diff, self.dir)
        self.done = set() if overwrite else {k[: -len(".pt")] for k in mine}  # escaped names

    def open(self):
        self.written.remove_dead_temporaries()  # under the pt_dir's lock
        if self.overwrite:
            self.written.remove_all()  # only what earlier embed runs recorded writing
        self.written.record(self.settings, self.staging, *(p for p in self.files if p.stem not in self.done))
        remove_path(self.staging)  # what a killed run left half-written
        self.staging.mkdir()
        if self.overwrite or differences(self.old, self.identity):
            self._put(self.settings, lambda p: p.write_text(json.dumps(self.identity)))

    def _put(self, path: Path, write):
        tmp = self.staging / path.name  # the staging folder is ours: a kill leaves nothing beside
        write(tmp)
        os.replace(tmp, path)

    def close(self):
        remove_path(self.staging)

    def has(self, rid: str) -> bool:
        return safe_name(rid) in self.done

    def write(self, items: list[tuple[str, dict]]):
        """Write ``(id, result)`` pairs (their names were recorded by :meth:`open`)."""
        for rid, result in items:
            path = self.dir / f"{safe_name(rid)}.pt"
            obj: dict = {"label": rid}
            for p, by_layer in result["pooled"].items():
                obj[PT_KEYS[p]] = {layer: torch.from_numpy(v) for layer, v in by_layer.items()}
            if result["per_residue"]:
                obj["representations"] = {layer: torch.from_numpy(v) for layer, v in result["per_residue"].items()}
            self._put(path, lambda tmp: torch.save(obj, tmp))
            self.done.add(safe_name(rid))

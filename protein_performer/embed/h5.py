"""The HDF5 output and its journal: each finished batch saved at once, keyed by protein, and
the file assembled in input order at the end (the same whether or not a run was interrupted,
and however many processes embedded it)."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..files import atomic_path, remove_path
from .identity import differences, journal_path, refuse, safe_name


def read_identity(path: Path) -> dict:
    import h5py
    try:
        with h5py.File(path, "r") as f:
            return dict(f.attrs)
    except OSError:
        raise UserError(f"output {path}: exists and is not an HDF5 file; refusing to replace it "
                        f"(choose another output path)") from None


def check_path(path: Path):
    """Refuse an output that is a directory or an existing file that embed did not write."""
    if path.is_dir():
        raise UserError(f"output {path}: is a directory; give a file name such as {path / 'embeddings.h5'}")
    if path.exists() and "checkpoint_sha256" not in read_identity(path):  # a user's own HDF5 file
        raise UserError(f"output {path}: an HDF5 file that embed did not write (no embed attributes); "
                        f"refusing to replace it, overwrite or not: choose another output path")


class H5Output:
    """Writes the HDF5 layout external checks rely on, resumably.

    ``ids`` (strings, input order), ``<pooling>`` (N x D float32) — or
    ``<pooling>/<layer>`` when several layers — and ``per_residue/<id>`` (L x D) —
    ``per_residue/<layer>/<id>`` with several layers; ids are escaped by
    :func:`~protein_performer.embed.identity.safe_name` in member names. Attributes: the
    identity (:data:`~protein_performer.embed.identity.IDENTITY`) plus ``checkpoint``,
    ``input``, ``kernel`` and ``complete``.

    The journal ``OUT.partial/`` holds ``identity.json`` and one ``batch-NNNNNNNNN.npz`` per
    finished batch, named by the first of its proteins (so processes embedding other batches
    never pick the same name; written beside and renamed, so a batch file that exists is
    whole; plain arrays, read with ``allow_pickle=False``): ``index``, the positions of its
    proteins among the input's valid records, and their arrays. Each protein is saved once,
    whatever the batches of the run that resumes; :meth:`finish` assembles ``OUT`` in input
    order and removes the journal. The constructor only checks; :meth:`open` (once every
    output has been checked) is the first change on disk.
    """

    def __init__(self, path: str | Path, identity: dict, attrs: dict, overwrite: bool, n: int):
        self.path = Path(path)
        self.journal = journal_path(self.path)
        self.identity, self.attrs, self.n = identity, attrs, n
        self.layers, self.pooling = identity["layers"], identity["pooling"]
        self.done: set[int] = set()
        self.complete = self.path.exists() and not overwrite
        if self.complete:
            diff = differences(read_identity(self.path), identity)
            if diff:
                refuse(str(self.path), diff, self.path)
        self.drop_journal = False
        if os.path.lexists(self.journal):
            diff = differences(self._journal_identity(), identity)
            if diff and not overwrite and not self.complete:
                refuse(f"{self.journal} (left by an interrupted run)", diff, self.journal)
            # overwrite, or the leftover of the run that completed OUT: ours to remove
            self.drop_journal = overwrite or (self.complete and not diff)
            if not self.drop_journal and not self.complete:
                for f in self._batch_files():  # resume: what the interrupted run finished
                    with self._load(f) as z:
                        self.done.update(self._index(z, f).tolist())

    # --- reading the journal: plain numbers only ------------------------------------------
    def _journal_identity(self) -> dict:
        info = self.journal / "identity.json"
        old = None
        if self.journal.is_dir() and not self.journal.is_symlink() and info.is_file():
            with contextlib.suppress(ValueError):
                old = json.loads(info.read_text(encoding="utf-8", errors="replace"))
        if not isinstance(old, dict):
            raise UserError(f"{self.journal}: exists and is not a journal left by embed (no readable "
                            f"identity.json); refusing to touch it: move it or choose another output")
        return old

    def _batch_files(self) -> list[Path]:
        return sorted(self.journal.glob("batch-*.npz")) if self.journal.is_dir() else []

    def _bad(self, path: Path, why: str):
        return UserError(f"{path}: not a readable journal batch of this input ({why}); pass overwrite=true "
                         f"to embed {self.path} again from the start")

    def _load(self, path: Path):
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise self._bad(path, type(e).__name__) from None

    def _array(self, z, key: str, path: Path) -> np.ndarray:
        """One array of a batch file: plain numbers only (an object array is refused, never unpickled)."""
        try:
            a = z[key]
        except (KeyError, OSError, ValueError) as e:
            raise self._bad(path, f"{key}: {type(e).__name__}") from None
        if a.dtype.kind not in "iuf":
            raise self._bad(path, f"{key}: dtype {a.dtype}")
        return a

    def _index(self, z, path: Path) -> np.ndarray:
        index = self._array(z, "index", path)
        if index.ndim != 1 or index.dtype.kind not in "iu" or \
                (index.size and not (0 <= index.min() and index.max() < self.n)):
            raise self._bad(path, "bad index")
        return index.astype(np.int64)

    # --- writing ---------------------------------------------------------------------------
    def open(self):
        """The journal, fresh (``overwrite``) or as the interrupted run left it; made here, before
        any batch, so that the processes of a multi-device run share one."""
        if self.drop_journal:
            remove_path(self.journal)
        if not self.complete and not self.journal.exists():
            with atomic_path(self.journal) as tmp:
                tmp.mkdir()
                (tmp / "identity.json").write_text(json.dumps(self.identity))

    def _key(self, pooling: str, layer: int) -> str:
        return pooling if len(self.layers) == 1 else f"{pooling}/{layer}"

    def _res_key(self, layer: int, rid: str) -> str:
        return f"per_residue/{safe_name(rid)}" if len(self.layers) == 1 else f"per_residue/{layer}/{safe_name(rid)}"

    def write_batch(self, index: list[int], results: list[dict]):
        """Save the proteins of one batch not saved before (``index``: positions among the valid records)."""
        if not index:
            return
        arrays = {"index": np.asarray(index, dtype=np.int64)}
        for p in self.pooling:
            for layer in self.layers:
                arrays[f"pooled|{p}|{layer}"] = np.stack([r["pooled"][p][layer] for r in results])
        if self.identity["per_residue"]:
            for j, r in enumerate(results):
                for layer in self.layers:
                    arrays[f"res|{layer}|{j}"] = r["per_residue"][layer].astype(np.float32)
        with atomic_path(self.journal / f"batch-{min(index):09d}.npz") as tmp, open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        self.done.update(index)

    def finish(self, ids: list[str]):
        """Assemble ``OUT`` in input order from the saved batches, then drop ``OUT.partial``."""
        import h5py
        if self.complete:
            return
        n, dim = len(ids), self.identity["dim"]
        # assembled inside the journal (ours), so a kill at any point leaves nothing beside OUT
        tmp = self.journal / "assembled.h5"
        written = np.zeros(n, dtype=bool)
        with h5py.File(tmp, "w") as f:
            f.create_dataset("ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
            sets = {(p, layer): f.create_dataset(self._key(p, layer), shape=(n, dim), dtype="float32")
                    for p in self.pooling for layer in self.layers}
            for path in self._batch_files():
                with self._load(path) as z:
                    index = self._index(z, path)
                    new = np.flatnonzero(~written[index])
                    new = new[np.argsort(index[new])]  # h5py writes rows in increasing order
                    if not len(new):
                        continue
                    for (p, layer), ds in sets.items():
                        ds[index[new]] = self._array(z, f"pooled|{p}|{layer}", path)[new]
                    if self.identity["per_residue"]:
                        for j in new:
                            for layer in self.layers:
                                f.create_dataset(self._res_key(layer, ids[index[j]]),
                                                 data=self._array(z, f"res|{layer}|{j}", path))
                    written[index[new]] = True
            if not written.all():
                raise RuntimeError(f"{self.journal}: {int((~written).sum())} records were never embedded")
            for k, v in {**self.identity, **self.attrs, "complete": True}.items():
                f.attrs[k] = v
        os.replace(tmp, self.path)
        remove_path(self.journal)

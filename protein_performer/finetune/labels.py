"""Labels: a CSV (read by :func:`protein_performer.probe.label_rows`, probe's reader) or FLIP's
per-residue FASTA -> :class:`Examples`, checked row by row; and the train / valid / test split of
every example (:func:`assign_splits`)."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..formats.fasta import read_fasta
from ..formats.text import numbered_lines
from ..probe import MISSING, label_rows, repeated
from ..tokenizer import Tokenizer

log = logging.getLogger(__name__)

TASKS = ("classification", "regression", "residue")
SPLITS = ("train", "valid", "test")


@dataclass
class Examples:
    ids: list[str]
    seqs: list[str]           # residues, cleaned by the tokenizer
    labels: list              # class name (str), value (float) or one class letter per residue (str)
    split: list[str | None]   # train | valid | test; None: drawn by assign_splits


def read_examples(path: str | Path, task: str, sequences: str | Path | None = None,
                  tokenizer: Tokenizer = Tokenizer()) -> Examples:
    """A label CSV (``id``, ``sequence`` or ``seq``, ``label``, optional ``split``) or, for
    ``task=residue``, FLIP's FASTA of per-residue labels (``>id SET=train VALIDATION=False``).
    ``sequences``: a FASTA giving each id its residues (FLIP's labels need it; a CSV may use
    it instead of a sequence column). Any bad row is a one-line error naming file and line."""
    if task not in TASKS:
        raise UserError(f"task={task!r}: choose one of {', '.join(TASKS)}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"labels {path}: no such file")
    by_id = None
    if sequences is not None:
        if not Path(sequences).is_file():
            raise FileNotFoundError(f"sequences {sequences}: no such file")
        by_id = {r.id: r.sequence for r in read_fasta(sequences)}
    first = next((line for _, line in numbered_lines(path) if line.strip()), "")
    ex = Examples([], [], [], [])
    rows = _Rows(ex, path, task, tokenizer, by_id, sequences)
    if first.startswith(">"):
        _read_fasta_labels(path, task, rows.add, by_id is not None)
    else:
        _read_csv(path, rows.add, by_id is not None)
    if not ex.ids:
        raise UserError(f"labels {path}: no labeled rows")
    if any(rows.repeats.values()):
        log.warning("%s: %d rows repeat a protein listed before (%d with another value: replicates); every row is "
                    "kept", path, rows.repeats["same"] + rows.repeats["other"], rows.repeats["other"])
    if any(s is None for s in ex.split) and not all(s is None for s in ex.split):
        n = next(i for i, s in enumerate(ex.split) if s is None)
        raise UserError(f"labels {path}: protein {ex.ids[n]!r} has no split while others have one")
    return ex


class _Rows:
    """Adds one labeled row to ``ex``, checked: its residues (from the row, or ``by_id``), label and split;
    a protein listed twice follows probe's rule (:func:`~protein_performer.probe.repeated`)."""

    def __init__(self, ex: Examples, path: Path, task: str, tokenizer: Tokenizer, by_id: dict | None, sequences):
        self.ex, self.path, self.task, self.tokenizer = ex, path, task, tokenizer
        self.by_id, self.sequences = by_id, sequences
        self.seen: dict = {}  # id -> (line, label)
        self.repeats = {"same": 0, "other": 0}

    def add(self, n: int, rid: str, seq: str | None, label: str, split: str | None) -> None:
        where = f"{self.path}:{n}"
        if seq is None:
            if rid not in self.by_id:
                raise UserError(f"{where}: protein {rid!r} is not in sequences={self.sequences}")
            seq = self.by_id[rid]
        seq = self.tokenizer.clean(seq, source=where, record=rid)
        if not seq:
            raise UserError(f"{where}: protein {rid!r} has an empty sequence")
        label = self.label(where, rid, seq, label.strip())
        if split is not None and split not in SPLITS:
            raise UserError(f"{where}: protein {rid!r}: split {split!r}: expected train, valid or test")
        # listed again with another class: refused (probe's rule); another value: a replicate measurement
        if repeated(self.seen, rid, label, where, conflicts="count" if self.task == "regression" else "refuse"):
            self.repeats["same" if self.seen[rid][1] == label else "other"] += 1
        ex = self.ex
        ex.ids.append(rid), ex.seqs.append(seq), ex.labels.append(label), ex.split.append(split)

    def label(self, where: str, rid: str, seq: str, label: str):
        """The task's label of a row: a class name, a finite value, or one class letter per residue."""
        if label.lower() in MISSING:
            raise UserError(f"{where}: protein {rid!r} has no label ({label!r})")
        if self.task == "regression":
            try:
                value = float(label)
            except ValueError:
                raise UserError(f"{where}: protein {rid!r}: label {label!r} is not a number") from None
            if not math.isfinite(value):
                raise UserError(f"{where}: protein {rid!r}: label {label!r} is not a finite number")
            return value
        if self.task == "residue":
            label = "".join(label.split())
            if len(label) != len(seq):
                raise UserError(f"{where}: protein {rid!r}: {len(label)} residue labels for {len(seq)} residues")
        return label


def _read_fasta_labels(path: Path, task: str, add, have_sequences: bool) -> None:
    """FLIP's per-residue labels: ``>id SET=train|test VALIDATION=True|False`` and a class letter per residue."""
    if task != "residue":
        raise UserError(f"labels={path}: a FASTA of labels is read as per-residue labels (task=residue), "
                        f"not task={task}; give a CSV with a label column")
    if not have_sequences:
        raise UserError(f"labels={path}: per-residue labels in FASTA need sequences=FASTA (the residues by id)")
    for r in read_fasta(path):
        tags = dict(t.split("=", 1) for t in r.description.split()[1:] if "=" in t)
        split = tags.get("SET", "").strip().lower() or None
        if split == "train" and tags.get("VALIDATION", "").strip().lower() == "true":
            split = "valid"
        add(r.line, r.id, None, r.sequence, split)


def _read_csv(path: Path, add, have_sequences: bool) -> None:
    """A label CSV through probe's reader: a ``label`` column, and a sequence column unless an ``id``
    column finds each protein's residues in sequences=FASTA."""
    def check_header(header: list[str], col: dict[str, int]) -> None:
        if "label" not in col:
            raise UserError(f"{path}:1: no 'label' column (header: {', '.join(header)})")
        if "sequence" not in col and "seq" not in col and not (have_sequences and "id" in col):
            raise UserError(f"{path}:1: no 'sequence' column (header: {', '.join(header)}); "
                            f"or give an 'id' column and sequences=FASTA")

    for row in label_rows(path, check_header):
        add(row.line, row.id, row.seq, row.label, row.split)


def assign_splits(ex: Examples, valid_fraction: float, test_fraction: float, seed: int, source: str,
                  strata: list | None = None) -> np.ndarray:
    """The split of every example: as the file says; valid rows, when the file has none, a
    seeded ``valid_fraction`` of train (per class of ``strata``, when given: each class keeps its
    share in both), said in one line; without a split column, a seeded three-way draw."""
    n = len(ex.ids)
    rng = np.random.default_rng(seed)
    split = np.array([s or "train" for s in ex.split], dtype=object)
    if ex.split[0] is None:
        order = rng.permutation(n)
        n_test = int(round(test_fraction * n))
        split[order[:n_test]] = "test"
    if not (split == "valid").any():
        train = np.flatnonzero(split == "train")
        if strata is None:
            split[rng.permutation(train)[: max(1, int(round(valid_fraction * len(train))))]] = "valid"
        else:
            for c in sorted({strata[i] for i in train}):
                members = rng.permutation([i for i in train if strata[i] == c])
                split[members[: int(round(valid_fraction * len(members)))]] = "valid"
            if not (split == "valid").any():
                split[rng.permutation(train)[:1]] = "valid"
        log.info("%s: no valid split given: %d of the %d training proteins held out for validation (a seeded %s%g "
                 "share), which chooses the kept weights; the test split chooses nothing", source,
                 int((split == "valid").sum()), len(train), "per-class " if strata is not None else "",
                 valid_fraction)
    for s in SPLITS:
        if not (split == s).any():
            raise UserError(f"labels {source}: no {s} proteins ({n} in all; the split column, "
                            f"test_labels or valid_fraction / test_fraction decide them)")
    return split

"""How sure the validation split is that fine-tuning beat the linear probe: a paired bootstrap over the
validation proteins (:func:`bootstrap_confidence`).  A few hundred validation proteins rank two
candidates a point apart by chance about as often as not, and the test split then often disagrees
(docs/downstream.md: the gate study), so ``finetune`` keeps the fine-tuned weights over its probe only
when they win in at least ``min_confidence`` of the draws."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .schedule import selection_metric

#: bootstrap draws of the validation proteins (the confidence's Monte-Carlo error: at most 0.016)
DRAWS = 1000


@dataclass
class Validated:
    """One candidate's validation outputs: ``outputs`` (rows, C) logits or (rows, 1) values, ``targets``
    (rows,), ``protein`` (rows,) the validation protein each row belongs to (a row per labeled residue
    for residue tasks; one per protein otherwise).  Every candidate sees the validation proteins in the
    same order, so rows pair up."""
    outputs: torch.Tensor
    targets: torch.Tensor
    protein: np.ndarray


def bootstrap_confidence(task: str, by: str, probe: Validated, tuned: Validated, seed: int = 0,
                         draws: int = DRAWS) -> float:
    """The share of ``draws`` resamples of the validation proteins (with replacement; the same draw for
    both, whole proteins for residue tasks) in which ``tuned`` scores higher than ``probe`` by ``by``
    (the :func:`~.schedule.selection_metric`); ties count half, a NaN score loses.  0.5: no evidence
    either way; near 1: tuned wins on nearly any validation set like this one."""
    n = int(probe.protein.max()) + 1 if len(probe.protein) else 0
    if n == 0:
        return 0.5
    picks = np.random.default_rng(seed).integers(0, n, size=(draws, n))
    if by in ("accuracy", "residue_accuracy"):  # a share of rows: per-protein counts suffice
        def shares(v: Validated) -> np.ndarray:
            right = (v.outputs.argmax(-1) == v.targets).numpy()
            hits = np.bincount(v.protein, weights=right, minlength=n)[picks].sum(1)
            return hits / np.bincount(v.protein, minlength=n)[picks].sum(1)
        a, b = shares(tuned), shares(probe)
    else:  # one row per protein (classification, regression): the metric on each resample
        a, b = (np.array([selection_metric(task, by, v.outputs[idx], v.targets[idx])
                          for idx in map(torch.from_numpy, picks)]) for v in (tuned, probe))
    a, b = np.nan_to_num(a, nan=-np.inf), np.nan_to_num(b, nan=-np.inf)
    return float(np.mean(a > b) + 0.5 * np.mean(a == b))

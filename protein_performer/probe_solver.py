"""The probe's logistic regression, its solver picked by the shape of the data it is fitted on.

Why a module of its own: the estimator subclasses scikit-learn's, so importing it imports
scikit-learn (1 s); :func:`protein_performer.probe.make_probe` imports it when a probe is built,
not at every command's start, and a module-level class pickles by name."""
from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegressionCV

#: Newton-Cholesky only where the rows outnumber the coefficients this many to one (:func:`solver_for`)
ROWS_PER_COEF = 20


def solver_for(rows: int, features: int, classes: int) -> str:
    """Newton's steps either way (lbfgs needed thousands of iterations on 7 classes).  Newton-Cholesky
    forms the Hessian, (classes x features)^2 entries from every row, which pays where rows are many
    and the probe narrow (ss3 per residue: 20,000 residues, 3 classes, 256 features: 22 s against
    Newton-CG's 46 s); Newton-CG takes Hessian-vector products, so a wide multiclass probe never
    forms it (family: 2,000 proteins, 12 classes, 640 features: 22 s against 758 s;
    docs/probe_solver.md).  Intercepts are left out of the count: one per class."""
    coefs = features * (classes if classes > 2 else 1)   # binary: one column
    return "newton-cholesky" if rows >= ROWS_PER_COEF * coefs else "newton-cg"


class ShapeSolvedLogisticRegressionCV(LogisticRegressionCV):
    """LogisticRegressionCV that resolves ``solver="auto"`` by :func:`solver_for` on each fit's data
    (every fold's clone decides on its own rows); the solver used is ``solver_`` once fitted."""

    def fit(self, X, y, sample_weight=None, **params):
        asked = self.solver
        solver = solver_for(*np.shape(X), len(np.unique(y))) if asked == "auto" else asked
        self.solver = solver
        try:
            super().fit(X, y, sample_weight=sample_weight, **params)
        finally:
            self.solver = asked
        self.solver_ = solver
        return self

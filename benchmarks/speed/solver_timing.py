#!/usr/bin/env python
"""The logistic-regression probe's two solvers, timed side by side on the same features in one run:
Newton-Cholesky and Newton-CG, between which ``probe.SOLVER`` ("auto", ``probe.solver_for``) picks by the
rows per coefficient.

    python benchmarks/speed/solver_timing.py --ckpt CKPT [--tasks signalp scop family ss3] [--seeds 0] [--features last layers]

Why: finetune fits this probe before every run (its baseline, LP-FT start and ensemble member), and an
every-layer probe (640 features) on a 12-class task took Newton-Cholesky 13 min, most of a 20-minute
budget: its Hessian is (classes x features)^2.  Newton-CG takes Newton's steps through Hessian-vector
products, and lost on the per-residue probe (many rows, 3 classes).  Per task, seed and feature set (probe_features.py's: the last layer's mean, or every
layer's; ss3, per residue: finetune's per-residue probe, on a seeded sample of training residues, of the
last layer's state alone and beside the mean of those within the head's window): each solver's fit time
(C by 3-fold CV, then the refit), the C it chose, its test accuracy, and the largest gap between the two
solvers' test probabilities, and the solver "auto" picks there.  Table: docs/probe_solver.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402
from benchmarks.quality import downstream, probe_features  # noqa: E402

DOC = common.DOCS / "probe_solver.md"
TASKS = ("signalp", "scop", "family", "ss3")               # the classification tasks; ridge has no solver
#: ss3's feature sets (per residue) in place of --features: the last layer's state, and beside its window's mean
RESIDUE_FEATURES = ("residue", "window")
SOLVERS = ("newton-cholesky", "newton-cg")


def fit(solver: str, X_train, y_train, X_test, seed: int):
    """probe's pipeline with ``solver`` fitted as finetune and downstream.py fit it (3 inner folds);
    returns (seconds, C, test probabilities, test predictions)."""
    import numpy as np

    from protein_performer.probe import make_probe
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The least populated class in y has only")
        pipe = make_probe("classification", 3, seed, solver=solver).fit(X_train, y_train)  # probe.TOL for both
    seconds = time.perf_counter() - start
    return seconds, float(np.ravel(pipe[-1].C_)[0]), pipe.predict_proba(X_test), pipe.predict(X_test)


def residue_task(loaded, seed: int):
    """ss3 as downstream.py's per-residue probes see it, on finetune's count of sampled training residues
    (:data:`head_init.PROBE_RESIDUES`) and every residue of the test proteins: ({part: labels},
    {part: {feature set: (residues, D)}})."""
    from protein_performer.finetune.head_init import PROBE_RESIDUES
    _, ex, chosen, _ = downstream.load_task("ss3", downstream.STUDY_SIZES["ss3"], seed)
    keep, y_tr, y_te = downstream.residue_sample(ex, chosen["train"], chosen["test"], PROBE_RESIDUES, seed)
    depth, sets = loaded.net.depth, {}
    for part, k in (("train", keep), ("test", None)):
        f = downstream.residue_features(loaded, [ex.seqs[i] for i in chosen[part]], depth, k)
        sets[part] = {"residue": f["per_residue", depth], "window": f["window", depth]}
    return {"train": y_tr, "test": y_te}, sets


def run(name: str, loaded, seed: int, features: list[str]) -> list[list]:
    import numpy as np

    from protein_performer.probe_solver import solver_for
    if name == "ss3":
        (y, sets), features = residue_task(loaded, seed), RESIDUE_FEATURES
    else:
        _, _, y, sets, _, _ = probe_features.task_features(name, loaded, seed)
    rows = []
    for fs in features:
        X_tr, X_te = sets["train"][fs], sets["test"][fs]
        got = {s: fit(s, X_tr, y["train"], X_te, seed) for s in SOLVERS}
        (t_old, c_old, p_old, y_old), (t_new, c_new, p_new, y_new) = got[SOLVERS[0]], got[SOLVERS[1]]
        auto = solver_for(*X_tr.shape, len(np.unique(y["train"])))
        row = [name, seed, f"{fs} ({X_tr.shape[1]})", len(X_tr), f"{t_old:.1f}", f"{t_new:.1f}", f"{t_old / t_new:.1f}x",
               auto, f"{c_old:g} / {c_new:g}",
               f"{np.mean(y_old == y['test']):.4f} / {np.mean(y_new == y['test']):.4f}", f"{np.abs(p_old - p_new).max():.4f}"]
        print(common.md_row(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--features", nargs="+", default=["last", "layers"], choices=list(probe_features.FEATURES))
    ap.add_argument("--doc", type=Path, default=DOC)
    args = ap.parse_args()
    import torch

    from protein_performer.hub.load import load_model
    from protein_performer.probe import TOL
    from protein_performer.probe_solver import ROWS_PER_COEF
    start, loaded = time.perf_counter(), load_model(args.ckpt)
    rows = [r for n in args.tasks for s in args.seeds for r in run(n, loaded, s, args.features)]
    head = ["task", "seed", "features (dim)", "rows", f"{SOLVERS[0]} s", f"{SOLVERS[1]} s", f"{SOLVERS[1]} speed-up", "auto picks", "C chosen",
            "test accuracy", "max |Δ probability|"]
    lines = ["# The probe's solver", "",
             f"Generated by `{common.command_line(__file__)}` at commit {common.git_commit()} on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({common.cpu()}, {torch.get_num_threads()} "
             f"threads); whole run {(time.perf_counter() - start) / 60:.1f} min. Model: `{args.ckpt}`.", "",
             "`probe`'s pipeline (standardize, logistic regression with C by 3-fold cross-validation over 7 values, "
             "then the refit) on each task's seeded training subsample (probe_features.py's; ss3: the state of each of "
             "a seeded sample of training residues, alone (`residue`) and beside the mean of those within 7 "
             "residues (`window`, downstream.py's)), fitted by each solver "
             f"in turn on the same features, both at the stopping tolerance {TOL:g}. Pairs read Newton-Cholesky / "
             "Newton-CG. Seconds: one fit each, on a shared machine. auto picks: `probe.SOLVER`'s choice on these "
             f"rows (Newton-Cholesky from {ROWS_PER_COEF} rows per coefficient, classes x features, one column when binary).", "", *common.md_table(head, rows)]
    common.write_doc(args.doc, "\n".join(lines), keep_below=True)
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

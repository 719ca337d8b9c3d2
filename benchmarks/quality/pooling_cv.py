#!/usr/bin/env python
"""Which pooling ``finetune ... pooling=auto pooling_by=cv`` would choose on the recipe study's runs, beside what
the default (pooling_by=valid: the validation split, through the bootstrap gate) chose there.

    python benchmarks/quality/pooling_cv.py --ckpt CKPT [--tasks signalp scop stability family] [--seeds 0 1]

For each task and seed: recipes.py's seeded subsample, the training split's every-layer means (one pass; the
last layer's mean is its last block), both of finetune's linear probes fitted on them (head_init.fit_probe) and
compared by their own inner cross-validation (pooling_choice.choose_by_cv: log-loss, or ridge's leave-one-out
squared error). The default's choice is read from the ``pooling_auto`` rows of docs/results/finetune_recipes.jsonl.
A run whose choice is the same is the same run (the rest of finetune does not read pooling_by); only the others
need ``recipes.py run --recipe pooling_cv``. Prints a table; raw figures to docs/results/pooling_cv.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402
from benchmarks.quality import downstream, recipes  # noqa: E402

RAW = common.DOCS / "results" / "pooling_cv.json"
TASKS = ("signalp", "scop", "stability", "family")


def by_valid(task: str, seed: int) -> str | None:
    """The default's choice on this run: the latest pooling_auto row's (None: not run)."""
    row = recipes.read_rows().get(("finetune", "pooling_auto", task, seed)) or {}
    return (row.get("pooling") or {}).get("chosen")


def choice(name: str, loaded, seed: int) -> dict:
    import numpy as np

    from protein_performer.finetune.pooling_choice import choose_by_cv
    task, ex, chosen, _ = downstream.load_task(name, downstream.STUDY_SIZES[name], seed)
    depth, dim = loaded.net.depth, loaded.net.config.dim
    f = downstream.protein_features(loaded, [ex.seqs[i] for i in chosen["train"]], depth)
    X = np.concatenate([f["mean", i] for i in range(depth + 1)], 1)
    labels = [ex.labels[i] for i in chosen["train"]]
    if task == "regression":
        y = np.asarray(labels, dtype=float)
        scale = (float(y.mean()), float(y.std()))
    else:
        y, scale = np.unique(labels, return_inverse=True)[1], (0.0, 1.0)
    start = time.perf_counter()
    picked, summary, _ = choose_by_cv(task, X, y, dim, scale, seed)
    return {"cv": picked, "valid": by_valid(name, seed), "cv_loss": summary.get("cv_loss"),
            "train": len(y), "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--raw", type=Path, default=RAW)
    args = ap.parse_args()
    from protein_performer.hub.load import load_model
    loaded = load_model(args.ckpt)
    meta = {"ckpt": args.ckpt, "commit": common.git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = []
    for name in args.tasks:
        for seed in args.seeds:
            r = {"task": name, "seed": seed, **choice(name, loaded, seed)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    args.raw.parent.mkdir(parents=True, exist_ok=True)
    args.raw.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    head = ["task", "seed", "training proteins", "cv loss: mean", "cv loss: layers", "by cv", "by valid (the default)"]
    table = [[r["task"], r["seed"], r["train"], *(f"{r['cv_loss'][k]:.4f}" if r["cv_loss"] else "–"
                                                  for k in ("mean", "layers")), r["cv"], r["valid"] or "–"]
             for r in rows]
    print("\n".join([f"{common.command_line(__file__, sys.argv[1:])} at {meta['commit']}, {meta['date']}", "",
                     *common.md_table(head, table)]))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

#!/usr/bin/env python
"""The ten-minute protein LM (issue 64): time-budgeted training runs of recipes against the old default,
recorded row by row, and the record tables of docs/speedrun.md rendered from them.

A recipe is a set of ``scripts/train.py`` overrides: ``old-default`` (the README recipe before issue 64),
levers on top of it (RECIPES, joined with '+': ``dropout0+muon``), or ``default`` (the configuration as it
stands).  Screening runs train on the bundled sample with the same validation split for ``--minutes`` of
wall-clock (``trainer.max_time``, no step limit: the learning rate decays along the clock,
training/task.py), so recipes compare at equal time; full runs (``--steps``) train as the README command
does, for a number of steps, with their wall-clock measured.  Each run appends one JSON line to
docs/results/speedrun.jsonl (recipe, overrides, seed, budget, commit, validation perplexity and accuracy,
steps, wall seconds); ``render`` writes docs/speedrun.md from those lines: per recipe and budget the mean
and spread over seeds, and the difference from the old default's mean.

    flock /tmp/heavy.lock python benchmarks/quality/speedrun.py run --recipe dropout0 --seeds 0,1,2 --minutes 3
    flock /tmp/heavy.lock python benchmarks/quality/speedrun.py run --recipe old-default --seeds 0 --steps 600
    flock /tmp/heavy.lock python benchmarks/quality/speedrun.py run --recipe default --seeds 0 --steps 650
    python benchmarks/quality/speedrun.py render
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

RAW = common.DOCS / "results" / "speedrun.jsonl"
DOC = common.DOCS / "speedrun.md"
#: the README recipe before issue 64 (with 600 steps in full mode): the baseline every lever was screened against
OLD_DEFAULT = ["model.dropout=0.1", "optim.optimizer=adamw"]
BASELINE = "old-default"
#: lever -> train.py overrides on top of the old default (the levers of issue 64 that the config reaches)
RECIPES = {
    "old-default": [],
    "dropout0": ["model.dropout=0"],
    "lr3e-3": ["optim.lr=3e-3"],
    "lr1e-3": ["optim.lr=1e-3"],
    "warmup50": ["optim.warmup_steps=50"],
    "betas95": ["optim.betas=[0.9,0.95]"],
    "wd0.1": ["optim.weight_decay=0.1"],
    "mask0.25": ["objective.train_mask_prob=0.25"],   # training batches only: validation stays at 15 %
    "mask0.4": ["objective.train_mask_prob=0.4"],
    "wide192x3": ["model.dim=192", "model.depth=3", "model.heads=6"],
    "narrow96x6": ["model.dim=96", "model.depth=6", "model.heads=4"],
    "depth3": ["model.depth=3"],
    "small96x4": ["model.dim=96", "model.heads=3"],
    "ff2": ["model.ff_mult=2"],
    "tokens16k": ["data.max_tokens=16384"],
    "tokens4k": ["data.max_tokens=4096"],
    "lr4e-3": ["optim.lr=4e-3"],
    "muon": ["optim.optimizer=muon"],
    "wsd": ["optim.schedule=wsd"],
    "bf16": ["trainer.precision=bf16-mixed"],
}


def overrides_of(recipe: str) -> list[str]:
    """A recipe's train.py overrides: ``default`` is the current configuration as it stands (none); any other
    name is the old default plus levers joined by '+' (``dropout0+muon``), a later value winning on a
    shared key."""
    if recipe == "default":
        return []
    parts = recipe.split("+")
    unknown = [p for p in parts if p not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipe {unknown[0]!r}: default, or one of {', '.join(sorted(RECIPES))} "
                         "(levers on the old default), several joined by '+'")
    merged = {}
    for o in OLD_DEFAULT + [o for p in parts for o in RECIPES[p]]:
        merged[o.split("=", 1)[0]] = o
    return list(merged.values())


VALIDATION = re.compile(r"validation: perplexity ([\d.]+) .*accuracy ([\d.]+)%")


def run_one(recipe: str, seed: int, minutes: float | None, extra: list[str], steps: int | None = None,
            keep: Path | None = None) -> dict:
    """One training run of ``recipe`` at ``seed`` for ``minutes`` of wall-clock, or (full mode) for ``steps``
    optimizer steps as the README command trains, its wall-clock measured: its record.  ``keep``: the run
    folder is copied there (its checkpoints: for evaluation and probes of the model)."""
    overrides = overrides_of(recipe) + list(extra)
    commit = common.git_commit() + ("+dirty" if dirty() else "")  # what runs: the tree at the start
    with tempfile.TemporaryDirectory(prefix="speedrun-") as tmp:
        if steps is None:
            seconds = int(round(minutes * 60))
            budget = ["trainer.max_steps=-1", f"trainer.max_time=00:00:{seconds // 60:02d}:{seconds % 60:02d}"]
        else:
            budget = [f"trainer.max_steps={steps}"]
        cmd = [sys.executable, str(common.ROOT / "scripts" / "train.py"), f"seed={seed}", "logger=csv", *budget,
               "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp}/run", *overrides]
        start = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT)
        wall = time.time() - start
        if proc.returncode:
            raise SystemExit(f"{recipe} seed {seed}: train.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        m = VALIDATION.search(proc.stdout)
        done = 0
        for path in Path(tmp, "run").rglob("metrics.csv"):
            with open(path) as f:
                done = max([done] + [int(row["step"]) + 1 for row in csv.DictReader(f) if row.get("step")])
        if keep is not None:
            shutil.copytree(Path(tmp, "run"), keep / f"{recipe}-seed{seed}")
    rec = {"recipe": recipe, "overrides": overrides, "seed": seed, "minutes": minutes,
           "commit": commit, "perplexity": float(m[1]),
           "accuracy": float(m[2]) / 100, "steps": done if steps is None else steps, "wall_s": round(wall, 1)}
    if steps is not None:
        rec["max_steps"] = steps
    return rec


def dirty() -> bool:
    """Whether the code or configs that train (protein_performer/, conf/, scripts/) differ from HEAD: the
    record's commit alone would not say what ran."""
    proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "protein_performer", "conf",
                           "scripts"], capture_output=True, text=True, cwd=common.ROOT)
    return bool(proc.stdout.strip())


def summary(rows: list[dict]) -> tuple[float, float, float, float]:
    """(mean perplexity, its spread (max - min), mean accuracy, mean steps)."""
    p = [r["perplexity"] for r in rows]
    return (statistics.mean(p), max(p) - min(p), statistics.mean(r["accuracy"] for r in rows),
            statistics.mean(r["steps"] for r in rows))


def render(raw: Path = RAW) -> str:
    rows = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()] if raw.exists() else []
    lines = ["# Speedrun: the README model's recipe at a fixed wall-clock (issue 64)", "",
             "Generated by `benchmarks/quality/speedrun.py render` from docs/results/speedrun.jsonl — do not edit by hand.",
             "", "Each row: a recipe (train.py overrides) trained on the bundled sample for the budget's minutes of "
             "wall-clock (`trainer.max_time`, no step limit), at each seed; validation perplexity mean and spread "
             "(max - min) over the seeds, accuracy and steps as means, Δ = the recipe's mean minus the old default's "
             "at the same budget (negative perplexity Δ is better). A change is kept only if it wins at 3 seeds.", ""]
    table = []
    timed = [r for r in rows if r.get("max_steps") is None]
    for minutes in sorted({r["minutes"] for r in timed}):
        at = [r for r in timed if r["minutes"] == minutes]
        base = [r for r in at if r["recipe"] == BASELINE]
        base_ppl = summary(base)[0] if base else None
        for recipe in dict.fromkeys(r["recipe"] for r in at):
            rr = [r for r in at if r["recipe"] == recipe]
            ppl, spread, acc, steps = summary(rr)
            delta = "" if base_ppl is None or recipe == BASELINE else f"{ppl - base_ppl:+.3f}"
            table.append([f"{minutes:g}", recipe, " ".join(rr[0]["overrides"]) or "(as configured)", len(rr),
                          f"{ppl:.3f}", f"{spread:.3f}", delta, f"{100 * acc:.2f}", f"{steps:.0f}",
                          ", ".join(sorted({r["commit"] for r in rr}))])
    lines += common.md_table(["minutes", "recipe", "overrides", "seeds", "val perplexity", "spread", "Δ vs old default",
                              "accuracy %", "steps", "commit"], table)
    full = [r for r in rows if r.get("max_steps") is not None]
    if full:
        lines += ["", "## Full runs: the README command's step budgets, wall-clock measured", "",
                  "`run --steps N`: trained for N steps as `python scripts/train.py` does (no clock), one run after "
                  "another on the same machine, interleaved by seed; wall = the whole command (start, training, "
                  "validation, checkpoints), its ratio to the old default's mean wall.", ""]
        base = [r for r in full if r["recipe"] == BASELINE]
        base_ppl = summary(base)[0] if base else None
        base_wall = statistics.mean(r["wall_s"] for r in base) if base else None
        body = []
        for key in dict.fromkeys((r["recipe"], r["max_steps"]) for r in full):
            rr = [r for r in full if (r["recipe"], r["max_steps"]) == key]
            ppl, spread, acc, _ = summary(rr)
            wall = statistics.mean(r["wall_s"] for r in rr)
            body.append([key[0], " ".join(rr[0]["overrides"]) or "(as configured)", key[1], len(rr), f"{ppl:.3f}",
                         f"{spread:.3f}", "" if base_ppl is None or key[0] == BASELINE else f"{ppl - base_ppl:+.3f}",
                         f"{100 * acc:.2f}", f"{wall:.0f} ({min(r['wall_s'] for r in rr):.0f}-{max(r['wall_s'] for r in rr):.0f})",
                         "" if base_wall is None else f"{wall / base_wall:.2f}",
                         ", ".join(sorted({r["commit"] for r in rr}))])
        lines += common.md_table(["recipe", "overrides", "steps", "seeds", "val perplexity", "spread", "Δ vs old default",
                                  "accuracy %", "wall s (range)", "× old default's wall", "commit"], body)
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train a recipe at some seeds and append the records")
    r.add_argument("--recipe", required=True, help=f"one of {', '.join(sorted(RECIPES))}, or several joined by '+'")
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--minutes", type=float, default=3.0, help="wall-clock budget per run (3: screening, 10: the README's)")
    r.add_argument("--steps", type=int, default=None, help="full mode: train this many steps as the README command "
                   "does (no clock; wall-clock measured) instead of --minutes")
    r.add_argument("--raw", type=Path, default=RAW)
    r.add_argument("--keep", type=Path, default=None, help="copy each run folder to KEEP/RECIPE-seedN (checkpoints)")
    r.add_argument("extra", nargs="*", help="more train.py overrides")
    sub.add_parser("render", help="write docs/speedrun.md from the records")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        overrides_of(a.recipe)  # an unknown name stops here, before any run
        if a.keep is not None:  # never into a run folder that is there already (it would be merged over)
            taken = [a.keep / f"{a.recipe}-seed{s}" for s in a.seeds.split(",") if (a.keep / f"{a.recipe}-seed{s}").exists()]
            if taken:
                print(f"speedrun: --keep: {taken[0]} exists; give another --keep folder", file=sys.stderr)
                raise SystemExit(2)
        a.raw.parent.mkdir(parents=True, exist_ok=True)
        for seed in (int(s) for s in a.seeds.split(",")):
            rec = run_one(a.recipe, seed, None if a.steps else a.minutes, a.extra, a.steps, a.keep)
            print(json.dumps(rec), flush=True)
            with open(a.raw, "a") as f:
                f.write(json.dumps(rec) + "\n")
    text = render()
    common.write_doc(DOC, text, keep_below=True)
    print(text)


if __name__ == "__main__":
    main()

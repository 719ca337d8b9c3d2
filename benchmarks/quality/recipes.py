#!/usr/bin/env python
"""Which fine-tuning recipe transfers (issue 45, item 2): each recipe on the bundled tasks at two seeds,
beside the frozen encoder's linear probe and amino-acid composition; the table goes into
docs/downstream.md (between its ``recipes`` markers) with the gate study's (finetune's min_confidence read
off the kept recipe's rows, between its ``gate`` markers), the raw rows into docs/results/finetune_recipes.jsonl.

    python benchmarks/quality/recipes.py run --ckpt CKPT --recipe base --task scop --seed 0   # one run, one row
    python benchmarks/quality/recipes.py baseline --ckpt CKPT --task scop --seed 0           # probe + composition
    python benchmarks/quality/recipes.py render                                               # the tables
    python benchmarks/quality/recipes.py study --ckpt CKPT [--lock /tmp/heavy.lock]           # every missing row, then the table
    python benchmarks/quality/recipes.py study --ckpt CKPT --final RECIPE                     # then the out-of-sample task

Every run appends one JSON row (a later row replaces an earlier one with the same key), so a study is
a loop of short processes: serialize them with ``flock`` and resume by skipping rows already there.
Each recipe changes one thing against ``base`` (the downstream benchmark's recipe); the tasks are
downstream.py's, with scop cut to 2,000 training proteins and every task to 3 epochs so that one
recipe at one seed takes about 8 minutes on 2 cores.  A recipe is kept only if it pays on average over
the tasks, and a task named in downstream.OUT_OF_SAMPLE is run only with the recipe finally kept.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402
from benchmarks.quality import downstream  # noqa: E402

RAW = common.DOCS / "results" / "finetune_recipes.jsonl"
DOC = common.DOCS / "downstream.md"
MARKERS = ("<!-- recipes: start -->", "<!-- recipes: end -->")
GATE_MARKERS = ("<!-- gate: start -->", "<!-- gate: end -->")
#: the gate study: finetune's min_confidence values read off these recipes' rows (which record the
#: confidence of their best fine-tuned candidate over the probe): the epoch alone, and the ensemble
GATE_RECIPES = ("stop_on_metric", "ensemble", "ensemble_epoch", "pooling_auto")
THRESHOLDS = (0.0, 0.5, 0.8, 0.9, 0.95)
EPOCHS = 3
STUDY_TASKS = ("signalp", "scop", "stability", "ss3")
#: finetune's settings for every recipe (downstream.py's recipe)
BASE = {"lr": 3e-4, "head_lr": 3e-3, "dropout": 0.0, "schedule": "linear", "max_tokens": 2048, "patience": 2,
        "head_init": "random", "freeze": "none", "pooling": "mean", "layer_decay": 1.0, "stop_on": "loss",
        "interpolate": False, "min_confidence": 0.0, "ensemble": 1.0}  # 0: the best validated candidate; the gate study reads the confidence
#: recipes run only where their pooling choice differs from pooling_auto's (each other run is pooling_auto's): left
#: out of the table, whose means would mix tasks and seeds; tabled by hand in docs/downstream.md
PARTIAL = ("pooling_cv", "pooling_termini")
#: recipe -> (what it changes against base, finetune settings; "epochs": the epochs' cap)
RECIPES = {
    "base": ("downstream.py's recipe: one encoder rate 10x below the head's, mean pooling, 3 epochs", {}),
    "layer_decay": ("layer-wise rate decay 0.7 (blocks 1.0, 0.7, 0.49, 0.34; embeddings 0.24 x lr)",
                    {"layer_decay": 0.7}),
    "freeze_2": ("the embedding and the first 2 of 4 blocks frozen", {"freeze": 2}),
    "attention_pooling": ("attention pooling instead of the mean (not for per-residue ss3)", {"pooling": "attention"}),
    "stop_on_metric": ("up to 6 epochs, early stopping on the validation metric (patience 1)",
                       {"stop_on": "metric", "patience": 1, "epochs": 6}),
    "interpolate": ("stop_on_metric, and the weights 1/4, 1/2 and 3/4 of the way from the probe's to the best "
                    "epoch's validated too (WiSE-FT)", {"stop_on": "metric", "patience": 1, "epochs": 6,
                                                        "interpolate": True}),
    "lp_ft_interpolate": ("interpolate, with the head starting as the probe (LP-FT)",
                          {"stop_on": "metric", "patience": 1, "epochs": 6, "interpolate": True,
                           "head_init": "probe"}),
    "ensemble": ("stop_on_metric, the fine-tuned candidate the mean of the best epoch's and the probe's class "
                 "probabilities (regression: values), an output-space ensemble", {"stop_on": "metric", "patience": 1,
                                                                                 "epochs": 6, "ensemble": 0.5}),
    "ensemble_epoch": ("ensemble, and the best epoch alone in the mix's place where it beats the mix in 0.9 of the "
                       "validation bootstrap's draws (epoch_confidence 0.9)",
                       {"stop_on": "metric", "patience": 1, "epochs": 6, "ensemble": 0.5, "epoch_confidence": 0.9}),
    "pooling_auto": ("ensemble_epoch, and the head reading the last layer's mean or every layer's, whichever a linear "
                     "probe scores higher on the validation split in 0.9 of its bootstrap draws (pooling=auto; ss3: "
                     "a head per residue, as ensemble_epoch)",
                    {"stop_on": "metric", "patience": 1, "epochs": 6, "ensemble": 0.5, "epoch_confidence": 0.9,
                     "pooling": "auto", "pooling_confidence": 0.9, "pooling_choices": ["mean", "layers"]}),
    "pooling_cv": ("pooling_auto, the pooling chosen instead by the two probes' own cross-validated loss on the "
                   "training split (pooling_by=cv; ss3: as ensemble_epoch)",
                   {"stop_on": "metric", "patience": 1, "epochs": 6, "ensemble": 0.5, "epoch_confidence": 0.9,
                    "pooling": "auto", "pooling_by": "cv", "pooling_choices": ["mean", "layers"]}),
    "pooling_termini": ("pooling_auto with a third candidate, every layer's mean and the last layer's over the first "
                        "and the last 50 residues (pooling_choices=[mean, layers, termini]), run at finetune's default "
                        "gate (min_confidence 0.9: its row is what the gate keeps, its own probe included)",
                        {"stop_on": "metric", "patience": 1, "epochs": 6, "ensemble": 0.5, "epoch_confidence": 0.9,
                         "pooling": "auto", "pooling_confidence": 0.9, "pooling_choices": ["mean", "layers", "termini"],
                         "min_confidence": 0.9}),
}
#: the recipes every other is compared with in the table (Δ columns): the study's start and the first recipe it kept
#: (later ones against each other: docs/downstream.md's hand-written sections)
AGAINST = ("base", "stop_on_metric")


def key(row: dict) -> tuple:
    return row["kind"], row.get("recipe"), row["task"], row["seed"]


def kind_of(what: str) -> str:
    """The raw rows' kind of what the command line runs: "run" writes "finetune" rows, the others their own."""
    return "finetune" if what == "run" else what


def read_rows(path: Path = RAW) -> dict[tuple, dict]:
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[key(row)] = row
    return rows


def append_row(row: dict, path: Path = RAW) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(row, default=float) + "\n")


def headline(task: str, metrics: dict) -> float:
    return float(metrics[downstream.HEADLINE[task]])


def baseline(args) -> dict:
    """The frozen encoder's linear probe and composition, on the task's test split: per protein, the
    mean of the last layer's states (embed's defaults); per residue, the residue's state beside the mean
    of those within downstream.WINDOW of it, the context the composition baseline and finetune's head
    and probe see."""
    from protein_performer import finetune as FT
    from protein_performer.hub.load import load_model
    loaded = load_model(args.ckpt)
    task, ex, chosen, _ = downstream.load_task(args.task, downstream.STUDY_SIZES[args.task], args.seed)
    depth, tr, te = loaded.net.depth, chosen["train"], chosen["test"]
    used = {s: len(i) for s, i in chosen.items()}
    if task != "residue":
        return {**downstream.protein_baselines(loaded, task, ex, tr, te, args.seed), "used": used}
    seqs = lambda idx: [ex.seqs[i] for i in idx]  # noqa: E731
    classes = sorted({c for y in ex.labels for c in y})
    keep, y_tr, y_te = downstream.residue_sample(ex, tr, te, FT.PROBE_RESIDUES, args.seed)
    f_tr = downstream.residue_features(loaded, seqs(tr), depth, keep)[("window", depth)]
    f_te = downstream.residue_features(loaded, seqs(te), depth)[("window", depth)]
    c_tr, c_te = downstream.residue_composition(seqs(tr), keep), downstream.residue_composition(seqs(te))
    return {"probe": downstream.probe(task, classes, f_tr, y_tr, f_te, y_te, args.seed),
            "composition": downstream.probe(task, classes, c_tr, y_tr, c_te, y_te, args.seed), "used": used}


def layers_baseline(args) -> dict:
    """The frozen encoder's linear probe on every layer's mean side by side (pooling=auto's other probe), on
    the task's test split: the probe a pooling=auto run that chose layers falls back on under the gate."""
    from benchmarks.quality import probe_features
    from protein_performer.hub.load import load_model
    loaded = load_model(args.ckpt)
    task, classes, y, sets, _, used = probe_features.task_features(args.task, loaded, args.seed)
    return {"probe_layers": downstream.probe(task, classes, sets["train"]["layers"], y["train"], sets["test"]["layers"],
                                             y["test"], args.seed), "used": used}


def finetune_run(args) -> dict:
    """One recipe on one task at one seed: the test metrics of the weights finetune keeps, and which it kept."""
    from protein_performer import finetune as FT
    settings = {**BASE, **RECIPES[args.recipe][1], "seed": args.seed}
    epochs = settings.pop("epochs", EPOCHS)
    task, ex, chosen, _ = downstream.load_task(args.task, downstream.STUDY_SIZES[args.task], args.seed)
    if task == "residue":
        settings.pop("pooling")  # a class per residue: no pooling
        settings["window"] = FT.RESIDUE_WINDOW
    with tempfile.TemporaryDirectory(prefix="recipes-") as tmp:
        labels = downstream.write_labels(Path(tmp) / f"{args.task}.csv", ex, chosen)
        r = FT.finetune(args.ckpt, labels, task, Path(tmp) / "out", overwrite=True,
                        trainer={"max_epochs": epochs, "enable_progress_bar": False, "gradient_clip_val": 1.0,
                                 "log_every_n_steps": 10}, **settings)
    return {"test": {k: r[k] for k in r if isinstance(r[k], (int, float)) and not isinstance(r[k], bool)},
            "selection": r["selection"], "epochs": r["epochs"], "train_seconds": r["train_seconds"],
            **({"pooling": r["pooling"]} if "pooling" in r else {}),  # pooling=auto's choice
            "settings": settings, "epochs_max": epochs, "used": r["proteins"]}


# ----------------------------------------------------------------------------- the table
def mean_spread(values: list[float]) -> str:
    if not values:
        return "–"
    m = sum(values) / len(values)
    return f"{m:.3f}" + (f" ± {(max(values) - min(values)) / 2:.3f}" if len(values) > 1 else "")


def render(rows: dict[tuple, dict]) -> list[str]:
    """The study's table: per task, each recipe's mean ± half-range over the seeds run, and its average
    change against each of :data:`AGAINST` over the tasks both ran at the same seeds."""
    tasks = [t for t in (*STUDY_TASKS, *downstream.OUT_OF_SAMPLE) if any(k[2] == t for k in rows)]
    seeds = sorted({k[3] for k in rows})
    recipes = [r for r in RECIPES if r not in PARTIAL and any(k[0] == "finetune" and k[1] == r for k in rows)]
    lines = [f"Test split, {', '.join(f'{t}: {downstream.HEADLINE[downstream.TASKS[t][0]]}' for t in tasks)}; the mean over "
             f"seeds {', '.join(map(str, seeds))} ± half their range. Δ: the recipe's mean change against "
             f"{' and '.join(AGAINST)} over the study's tasks (seed by seed, the tasks both ran). kept: how often "
             "the validation split chose the probe, or a mix of the probe's and an epoch's (weights or outputs). probe / "
             "composition: the frozen encoder's linear probe (per protein: the mean of the last layer; per residue: "
             f"the residue's state beside its neighbours' mean within {downstream.WINDOW}) and amino-acid composition "
             "(per residue: the residue and its neighbours' frequencies), on the same subsample; probe_layers: the probe on "
             "every layer's mean side by side, run where pooling=auto chose it.", "",
             "| recipe | " + " | ".join(t + (" (out of sample)" if t in downstream.OUT_OF_SAMPLE else "") for t in tasks)
             + "".join(f" | Δ vs {r}" for r in AGAINST) + " | kept: probe, mix |",
             "|---|" + "---:|" * (len(tasks) + len(AGAINST) + 1)]
    probes = [("baseline", "probe"), ("baseline", "composition")] + (
        [("probe_layers", "probe_layers")] if any(k[0] == "probe_layers" for k in rows) else [])
    for kind, recipe in [("finetune", r) for r in recipes] + probes:
        cells, deltas, kept = [], {r: [] for r in AGAINST}, []
        for t in tasks:
            values = {s: v for s in seeds if (v := test_value(rows, kind, recipe, t, s)) is not None}
            cells.append(mean_spread(list(values.values())))
            if kind != "finetune":
                continue
            for r in AGAINST:
                other = {s: v for s in seeds if (v := test_value(rows, kind, r, t, s)) is not None}
                deltas[r] += [values[s] - other[s] for s in values if s in other and t in STUDY_TASKS]
            kept += [rows["finetune", recipe, t, s]["selection"]["kept"] for s in values]
        delta = [f"{sum(d) / len(d):+.3f}" if d and recipe != r else "–" for r, d in deltas.items()]
        mixes = sum(" + " in k for k in kept)
        lines.append(f"| {recipe} | " + " | ".join(cells + delta) + " | "
                     + (f"{kept.count('probe')}, {mixes} of {len(kept)}" if kept else "–") + " |")
    lines += ["", "Recipes: " + "; ".join(f"`{r}`: {RECIPES[r][0]}" for r in recipes) + "."]
    return lines


def gate_outcome(rows, task: str, seed: int, threshold: float,
                 recipe: str = GATE_RECIPES[0]) -> tuple[float, float, bool] | None:
    """What ``recipe``'s run on ``task`` at ``seed`` would have ended with under min_confidence
    ``threshold``: (its test value, the baseline probe's, the run's own probe kept).  The gate acts after
    training, so one run at min_confidence 0 gives every threshold: the fine-tuned candidate kept when its
    confidence is at least the threshold, else the run's own probe, whose test value is the baseline row's
    (the same fit for per-protein tasks; where pooling=auto chose every layer, the probe_layers row's).  The
    baseline probe is the last layer's mean (embed's default), whichever the run fitted.  None: a row missing."""
    row, probe = rows.get(("finetune", recipe, task, seed)), test_value(rows, "baseline", "probe", task, seed)
    layers = row is not None and (row.get("pooling") or {}).get("chosen") == "layers"  # pooling=auto's probe
    own = test_value(rows, "probe_layers", "probe_layers", task, seed) if layers else probe
    if row is None or probe is None or own is None:
        return None
    confidence = row["selection"].get("confidence")
    if confidence is None or confidence >= threshold:  # None: the probe was kept on its own
        return test_value(rows, "finetune", recipe, task, seed), probe, row["selection"]["kept"] == "probe"
    return own, probe, True


def render_gate(rows: dict[tuple, dict]) -> list[str]:
    """The gate study's table: per recipe of :data:`GATE_RECIPES` run and per min_confidence in
    :data:`THRESHOLDS`, the mean test change against the probe, the runs that ended below it and the runs
    that kept it, over the study's tasks and, apart, the out-of-sample ones."""
    seeds = sorted({k[3] for k in rows})
    groups = {"bundled": STUDY_TASKS, "out of sample": downstream.OUT_OF_SAMPLE}
    recipes = [r for r in GATE_RECIPES if any(k[:2] == ("finetune", r) for k in rows)]
    runs = {(r, g): [(t, s) for t in tasks for s in seeds if gate_outcome(rows, t, s, 0.0, r) is not None]
            for r in recipes for g, tasks in groups.items()}
    confidence = ["; ".join(f"`{r}`: " + ", ".join(
        f"{t} {s}: {rows['finetune', r, t, s]['selection'].get('confidence', float('nan')):.3f}"
        for g in groups for t, s in runs[r, g]) for r in recipes)]
    lines = [" and ".join(f"`{r}`" for r in recipes) + " run once per task and seed at min_confidence 0; each "
             "row keeps the fine-tuned candidate (the best epoch; for `ensemble`, its mix with the probe; for `ensemble_epoch`, "
             "the mix, or the epoch alone where it beat the mix in 0.9 of the draws; `pooling_auto` likewise, its head "
             "on the pooling its probes chose) only where "
             "its confidence over the probe (the share of 1,000 bootstrap draws of the validation proteins it wins) "
             "reaches the threshold, else the probe. Δ: the test change against the probe, averaged over the runs; "
             "below: runs whose test value ends under the probe's; probe: runs that keep it. Confidence by run: "
             + confidence[0] + " (nan: the probe won validation outright).", "",
             "| recipe | min_confidence | " + " | ".join(f"{g}: Δ vs probe | below | probe" for g in groups) + " |",
             "|---|---:|" + "---:|" * (3 * len(groups))]
    for recipe in recipes:
        for threshold in THRESHOLDS:
            cells = []
            for g in groups:
                got = [gate_outcome(rows, t, s, threshold, recipe) for t, s in runs[recipe, g]]
                cells += ([f"{sum(v - p for v, p, _ in got) / len(got):+.3f}",
                           f"{sum(v < p for v, p, _ in got)} of {len(got)}", f"{sum(k for _, _, k in got)}"]
                          if got else ["–"] * 3)
            lines.append(f"| {recipe} | {threshold:g} | " + " | ".join(cells) + " |")
    return lines


def test_value(rows, kind: str, recipe: str, task: str, seed: int) -> float | None:
    """The headline test metric of a fine-tuning run (kind "finetune"), of a baseline row's probe or
    composition (kind "baseline", recipe "probe" | "composition") or of the every-layer probe (kind and recipe
    "probe_layers": :func:`layers_baseline`); None: not run."""
    row = rows.get((kind, recipe, task, seed) if kind == "finetune" else (kind, None, task, seed))
    return None if row is None else headline(downstream.TASKS[task][0], row["test" if kind == "finetune" else recipe])


def study(a) -> None:
    """Every baseline and recipe row of the study's tasks at seeds 0 and 1 not yet in the raw file, each
    in its own process (under ``flock`` when --lock is given), seed 0 first; with --final, then the
    out-of-sample tasks under that recipe; then the table."""
    import subprocess
    parts = [(seed, recipe, task) for seed in (0, 1) for recipe in (None, *RECIPES) for task in STUDY_TASKS
             if not (recipe == "attention_pooling" and downstream.TASKS[task][0] == "residue")]
    if a.final:  # the recipe kept, on the tasks nobody chose a setting on
        parts += [(seed, recipe, task) for seed in (0, 1) for recipe in (None, a.final)
                  for task in downstream.OUT_OF_SAMPLE]
    for _ in range(2):  # then pooling=auto's other probe, where a pooling_auto run (this one's too) chose it
        for seed, recipe, task in parts:
            what = "baseline" if recipe is None else "probe_layers" if recipe == "probe_layers" else "run"
            if (kind_of(what), recipe if what == "run" else None, task, seed) in read_rows(a.raw):
                continue
            cmd = [sys.executable, __file__, what, "--ckpt", a.ckpt, "--task", task, "--seed", str(seed),
                   "--raw", str(a.raw)] + (["--recipe", recipe] if what == "run" else [])
            subprocess.run((["flock", a.lock] if a.lock else []) + cmd, check=True)
        rows = read_rows(a.raw)
        parts = [(seed, "probe_layers", task) for seed in (0, 1) for task in (*STUDY_TASKS, *downstream.OUT_OF_SAMPLE)
                 if (rows.get(("finetune", "pooling_auto", task, seed), {}).get("pooling") or {}).get("chosen") == "layers"]
    publish(read_rows(a.raw), a.doc)


def publish(rows: dict[tuple, dict], doc) -> None:
    """The recipe table and the gate table, each between its markers of ``doc``."""
    common.publish(render(rows), doc, *MARKERS)
    common.publish(render_gate(rows), doc, *GATE_MARKERS)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["run", "baseline", "probe_layers", "render", "study"])
    ap.add_argument("--ckpt")
    ap.add_argument("--recipe", choices=list(RECIPES), default="base")
    ap.add_argument("--task", choices=list(downstream.TASKS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--raw", type=Path, default=RAW)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--lock", help="study: run each part under flock on this file (one heavy job at a time)")
    ap.add_argument("--final", choices=list(RECIPES), help="study: the recipe kept, run last on the out-of-sample tasks")
    a = ap.parse_args(argv)
    if a.what == "render":
        return publish(read_rows(a.raw), a.doc)
    if a.what == "study" and a.ckpt:
        return study(a)
    if not a.ckpt or not a.task:
        ap.error(f"{a.what} needs --ckpt" + (" and --task" if a.what != "study" else ""))
    start = time.perf_counter()
    result = {"run": finetune_run, "baseline": baseline, "probe_layers": layers_baseline}[a.what](a)
    row = {"kind": kind_of(a.what), "recipe": a.recipe if a.what == "run" else None,
           "task": a.task, "seed": a.seed, "commit": common.git_commit(), "ckpt": a.ckpt,
           "seconds": round(time.perf_counter() - start, 1), **result}
    append_row(row, a.raw)
    print(json.dumps({k: row[k] for k in ("kind", "recipe", "task", "seed", "seconds")}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

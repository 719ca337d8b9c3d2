"""Downstream tasks and the variant scorer's speed, written to docs/downstream.md.

    nice python benchmarks/quality/downstream.py --ckpt RUN/checkpoints/last.ckpt [--lora] [--tasks signalp scop ...]

On the labeled sets bundled in data/labeled (signal peptide, SCOP class, TAPE stability, FLIP
secondary structure; and, out of sample, the functional family of data/labeled/scripts/family_task.py), one model is compared three ways, on each set's own test split:

* fine-tuned: ``protein_performer.finetune.finetune`` (the ``finetune`` command's code), the
  whole encoder trained with a head (and, with ``--lora``, LoRA adapters instead of the
  encoder's weights);
* frozen linear probe: ``embed``'s default settings (last layer, mean over residues) under
  ``probe``'s standardize + logistic-regression / ridge pipeline (per residue: the last layer's
  hidden state of each residue);
* amino-acid composition under the same probe (per residue: the residue's one-hot and the
  composition of the 15 residues around it).

Item 4 of issue 21: the same probe on every layer and pooling ``embed`` offers, beside composition.
Training sets are subsampled (seeded) and fine-tuning runs a few epochs so that the whole run
stays near 15 minutes on 2 CPU cores; the doc says how many proteins each part used. Last, the
scorer's throughput (mutants/s, ``score``'s masked-marginal and wild-type-marginal strategies)
on real proteins cropped to 256 ... 8,192 residues. Results go to docs/downstream.md and, raw,
docs/results/downstream.json.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

LABELED = common.ROOT / "data" / "labeled"
DOC = common.DOCS / "downstream.md"
RAW = common.DOCS / "results" / "downstream.json"

#: name -> (task, train file, valid file or None, test file or None, FLIP sequences or None, what)
TASKS = {
    "signalp": ("classification", "labeled_signalP_binary_proteinbert.train.csv.gz", None,
                "labeled_signalP_binary_proteinbert.test.csv.gz", None, "signal peptide (yes/no), ProteinBERT"),
    "scop": ("classification", "labeled_scop_class_proteinbert.train.csv.gz", None,
             "labeled_scop_class_proteinbert.test.csv.gz", None, "SCOP class (7), ProteinBERT"),
    "stability": ("regression", "labeled_stability_tape_proteinbert.train.csv.gz",
                  "labeled_stability_tape_proteinbert.valid.csv.gz",
                  "labeled_stability_tape_proteinbert.test.csv.gz", None, "stability score, TAPE"),
    "ss3": ("residue", "labeled_ss3_flip_labels_sampled.fasta.gz", None, None,
            "labeled_ss3_flip_sequences.fasta.gz", "secondary structure per residue (H/E/C), FLIP"),
    "family": ("classification", "uniprot_family_names.csv.gz", None, None, None,
               "functional family (12) named in UniProt descriptions, names split apart (data/labeled/scripts/family_task.py)"),
}
#: tasks no fine-tuning setting was chosen on (issue 45, item 3): reported as out-of-sample rows
OUT_OF_SAMPLE = ("family",)
#: proteins used per task: train, valid, test (None: the whole split)
SIZES = {"signalp": (2000, 300, None), "scop": (8000, 300, None), "stability": (4000, 500, None),
         "ss3": (800, 150, None), "family": (2000, None, None)}
#: the studies' proteins per task (recipes.py, probe_features.py, pooling_cv.py, speed/solver_timing.py): SIZES with scop cut
STUDY_SIZES = {**SIZES, "scop": (2000, 300, None)}
#: tasks fine-tuned for other than --epochs epochs (none since the recipe study of issue 45: every task runs at
#: most 6 epochs and stops on its validation metric, docs/downstream.md; scop ran 5 before)
TASK_EPOCHS: dict[str, int] = {}
#: early stopping (finetune's stop_on, patience): the recipe the study kept (benchmarks/quality/recipes.py, "stop_on_metric")
STOP_ON, PATIENCE = "metric", 1
#: the figure each table reports first, per task
HEADLINE = {"classification": "accuracy", "regression": "spearman", "residue": "q3"}
POOLINGS = ("mean", "max", "cls")
RESIDUE_POOLINGS = ("per_residue", "window")  # per residue: its own state; beside its neighbours' mean
WINDOW = 7  # per-residue composition baseline: the residues within 7 on either side


# ----------------------------------------------------------------------------- data
def load_task(name: str, sizes, seed: int):
    """The task's examples (finetune's reader) with a seeded train / valid / test subsample."""
    from protein_performer import finetune as FT
    task, train, valid, test, seqs, _ = TASKS[name]
    path = lambda f: None if f is None else LABELED / f  # noqa: E731
    ex = FT.read_examples(path(train), task, path(seqs))
    split = list(ex.split) if ex.split[0] is not None else ["train"] * len(ex.ids)
    for f, s in ((valid, "valid"), (test, "test")):
        if f is not None:
            more = FT.read_examples(path(f), task)
            ex = FT.Examples(ex.ids + more.ids, ex.seqs + more.seqs, ex.labels + more.labels, ex.split + more.split)
            split += [s] * len(more.ids)
    rng = random.Random(seed)
    pools = {s: [i for i, t in enumerate(split) if t == s] for s in ("train", "valid", "test")}
    if not pools["valid"]:  # a seeded part of the training proteins, kept out of the train sample
        rng.shuffle(pools["train"])
        pools["valid"], pools["train"] = pools["train"][: sizes[1]], pools["train"][sizes[1]:]
    chosen = {}
    for s, n in zip(("train", "valid", "test"), sizes):
        idx = sorted(pools[s]) if n is None or len(pools[s]) <= n else sorted(rng.sample(pools[s], n))
        chosen[s] = idx
    return task, ex, chosen, {s: len(p) for s, p in pools.items()}


def write_labels(path: Path, ex, chosen) -> Path:
    """The subsample as the CSV ``finetune`` reads: id, sequence, label, split."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "sequence", "label", "split"])
        for s, idx in chosen.items():
            w.writerows([ex.ids[i], ex.seqs[i], ex.labels[i], s] for i in idx)
    return path


# ----------------------------------------------------------------------------- features
def protein_features(loaded, seqs: list[str], depth: int) -> dict:
    """(pooling, layer) -> (N, D): every layer and pooling ``embed`` offers, from one forward per batch."""
    from protein_performer.embed import Embedder
    emb = Embedder(loaded.net, list(range(depth + 1)), list(POOLINGS), kernel=loaded.kernel)
    tokens = [loaded.tokenizer.encode(s) for s in seqs]
    rows = [None] * len(seqs)
    for batch in emb.batches([len(t) for t in tokens], 16384):
        for k, r in zip(batch, emb.forward([tokens[k] for k in batch], loaded.tokenizer.pad_id)):
            rows[k] = r["pooled"]
    import numpy as np
    return {(p, layer): np.stack([r[p][layer] for r in rows]) for p in POOLINGS for layer in range(depth + 1)}


def residue_features(loaded, seqs: list[str], depth: int, keep: list | None = None) -> dict:
    """(pooling, layer) -> (residues, D): each residue's hidden state (``per_residue``) and, as the
    composition baseline gets, that state beside the mean of the states within WINDOW of it
    (``window``: 2 D features); ``keep[i]``: which residues of protein i."""
    import numpy as np
    import torch

    from protein_performer.data.collate import pad_batch
    from protein_performer.data.sampler import token_budget_batches
    tokens = [loaded.tokenizer.encode(s) for s in seqs]
    parts = {(p, layer): [None] * len(seqs) for p in RESIDUE_POOLINGS for layer in range(depth + 1)}
    with torch.inference_mode():
        for batch in token_budget_batches([len(t) for t in tokens], 16384):
            x, pad = pad_batch([tokens[k] for k in batch], loaded.tokenizer.pad_id)
            _, hidden = loaded.net(x, pad, return_layers=True)
            for layer in range(depth + 1):
                h = hidden[layer].float().numpy()
                for row, k in enumerate(batch):
                    r = h[row, 1:1 + len(seqs[k])]
                    w = np.concatenate([r, window_mean(r, WINDOW)], 1)
                    for p, f in (("per_residue", r), ("window", w)):
                        parts[p, layer][k] = f if keep is None else f[keep[k]]
    return {key: np.concatenate(p) for key, p in parts.items()}


def residue_sample(ex, tr: list, te: list, residues: int, seed: int):
    """The per-residue probe's training residues, a seeded sample of about ``residues`` over the training
    proteins: (which residues of each, their labels, every test residue's label)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    per = max(1, residues // len(tr))
    keep = [np.sort(rng.choice(len(ex.seqs[i]), min(len(ex.seqs[i]), per), replace=False)) for i in tr]
    y_tr = np.array([ex.labels[i][j] for i, k in zip(tr, keep) for j in k])
    return keep, y_tr, np.array([c for i in te for c in ex.labels[i]])


def window_mean(x, window: int):
    """(n, D) -> (n, D): the mean of the rows within ``window`` of each row (fewer at the ends)."""
    import numpy as np
    n = len(x)
    c = np.concatenate([np.zeros((1, x.shape[1]), x.dtype), x.cumsum(0)])
    lo, hi = np.clip(np.arange(n) - window, 0, n), np.clip(np.arange(n) + window + 1, 0, n)
    return (c[hi] - c[lo]) / (hi - lo)[:, None].astype(x.dtype)


def residue_composition(seqs: list[str], keep: list | None = None):
    """(residues, 40): the residue's one-hot and the amino-acid frequencies within WINDOW of it."""
    import numpy as np

    from protein_performer.tokenizer import STANDARD_AA
    index = {a: i for i, a in enumerate(STANDARD_AA)}
    out = []
    for k, s in enumerate(seqs):
        onehot = np.zeros((len(s), 20), dtype=np.float32)
        for i, a in enumerate(s):
            if a in index:
                onehot[i, index[a]] = 1
        f = np.concatenate([onehot, window_mean(onehot, WINDOW)], 1)
        out.append(f if keep is None else f[keep[k]])
    return np.concatenate(out)


def probe(task: str, classes, X_train, y_train, X_test, y_test, seed: int, folds: int = 3) -> dict:
    """``probe``'s pipeline fitted on train (``folds`` inner folds choose C), scored with
    ``finetune``'s metrics on test."""
    import numpy as np

    from protein_performer import finetune as FT
    from protein_performer.probe import make_probe
    kind = "regression" if task == "regression" else "classification"
    pipe = make_probe(kind, folds, seed).fit(X_train, y_train)
    pred = pipe.predict(X_test)
    if task == "regression":
        return FT.metrics(task, classes, list(y_test), [float(v) for v in pred])
    if task == "residue":  # metrics over residues: one "protein" holding them all
        return FT.metrics(task, classes, ["".join(y_test)], ["".join(pred)])
    scores = pipe.predict_proba(X_test)[:, list(pipe.classes_).index(classes[1])] if len(classes) == 2 else None
    return FT.metrics(task, classes, list(y_test), list(pred), None if scores is None else list(np.asarray(scores)))


def protein_baselines(loaded, task: str, ex, tr: list, te: list, seed: int) -> dict:
    """Per protein: the linear probe on the last layer's mean (embed's defaults) and amino-acid
    composition, fitted on the proteins ``tr`` and scored on ``te``."""
    import numpy as np

    from protein_performer.probe import composition_features
    depth, seqs = loaded.net.depth, (lambda idx: [ex.seqs[i] for i in idx])
    classes = sorted(set(ex.labels)) if task == "classification" else []
    y_tr, y_te = np.array([ex.labels[i] for i in tr]), np.array([ex.labels[i] for i in te])
    f_tr = protein_features(loaded, seqs(tr), depth)[("mean", depth)]
    f_te = protein_features(loaded, seqs(te), depth)[("mean", depth)]
    return {"probe": probe(task, classes, f_tr, y_tr, f_te, y_te, seed),
            "composition": probe(task, classes, composition_features(seqs(tr)), y_tr, composition_features(seqs(te)),
                                 y_te, seed)}


# ----------------------------------------------------------------------------- parts
def run_task(name: str, loaded, ckpt: str, work: Path, args) -> dict:
    import numpy as np
    import torch

    from protein_performer import finetune as FT
    from protein_performer.probe import composition_features
    wanted = (args.train.get(name, SIZES[name][0]), *SIZES[name][1:])
    sizes = tuple(n if cap is None or (n is not None and n <= cap) else cap
                  for n, cap in zip(wanted, (args.max_train, None, args.max_test)))
    task, ex, chosen, available = load_task(name, sizes, args.seed)
    depth = loaded.net.depth
    res = {"task": task, "what": TASKS[name][5], "available": available,
           "used": {s: len(i) for s, i in chosen.items()}, "files": [TASKS[name][k] for k in (1, 2, 3, 4) if TASKS[name][k]]}
    tr, te = chosen["train"], chosen["test"]
    seqs = lambda idx: [ex.seqs[i] for i in idx]  # noqa: E731
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    if task == "residue":
        classes = sorted({c for y in ex.labels for c in y})
        keep, y_tr, y_te = residue_sample(ex, tr, te, args.probe_residues, args.seed)
        f_tr, f_te = residue_features(loaded, seqs(tr), depth, keep), residue_features(loaded, seqs(te), depth)
        res["embed_seconds"] = round(time.perf_counter() - start, 1)
        grid = {f"{p}/{layer}": probe(task, classes, f_tr[p, layer], y_tr, f_te[p, layer], y_te, args.seed)
                for (p, layer) in f_tr}
        res["composition"] = probe(task, classes, residue_composition(seqs(tr), keep), y_tr,
                                   residue_composition(seqs(te)), y_te, args.seed)
        res["probe_default"] = grid[f"window/{depth}"]  # the context finetune's head and probe, and composition, see
        res["probe_residues"] = int(len(y_tr))
    else:
        classes = sorted(set(ex.labels)) if task == "classification" else []
        y_tr, y_te = np.array([ex.labels[i] for i in tr]), np.array([ex.labels[i] for i in te])
        f_tr, f_te = protein_features(loaded, seqs(tr), depth), protein_features(loaded, seqs(te), depth)
        res["embed_seconds"] = round(time.perf_counter() - start, 1)
        grid = {f"{p}/{layer}": probe(task, classes, f_tr[p, layer], y_tr, f_te[p, layer], y_te, args.seed)
                for (p, layer) in f_tr}
        res["composition"] = probe(task, classes, composition_features(seqs(tr)), y_tr, composition_features(seqs(te)), y_te, args.seed)
        res["probe_default"] = grid[f"mean/{depth}"]
    res["probe_grid"] = grid
    res["probe_seconds"] = round(time.perf_counter() - start - res["embed_seconds"], 1)
    print(f"{name}: probes done in {res['probe_seconds']} s", flush=True)

    labels = write_labels(work / f"{name}.csv", ex, chosen)
    runs, epochs = ({} if args.lora_only else {"finetune": {}}), args.task_epochs.get(name, args.epochs)
    if args.lora or args.lora_only:
        runs["finetune_lora"] = {"lora": True, "lora_rank": args.lora_rank, "lora_alpha": 2 * args.lora_rank,
                                 "lr": args.lora_lr}
    for key, extra in runs.items():
        if args.skip_finetune:
            break
        settings = {"lr": args.lr, "head_lr": args.head_lr, "dropout": args.dropout, "schedule": args.schedule,
                    "max_tokens": args.max_tokens,
                    "patience": PATIENCE, "stop_on": STOP_ON, "seed": args.seed, "head_init": args.head_init, "freeze": args.freeze,
                    **({"pooling": args.pooling} if task != "residue" else {}),
                    "ensemble": FT.ENSEMBLE if args.ensemble is None else args.ensemble,
                    **({"window": FT.RESIDUE_WINDOW if args.window is None else args.window}
                       if task == "residue" else {}), **extra}
        r = FT.finetune(ckpt, labels, task, work / f"{name}-{key}", overwrite=True,
                        trainer={"max_epochs": epochs, "enable_progress_bar": False, "gradient_clip_val": 1.0,
                                 "log_every_n_steps": 10}, **settings)
        res[key] = {**r, "settings": settings, "epochs_max": epochs}
        print(f"{name} {key}: {FT.format_metrics(r)}", flush=True)
    return res


def scorer_speed(loaded, lengths, positions: int, repeats: int, seed: int, work: Path) -> list[dict]:
    """Mutants/s of ``score``'s masked-marginal and wild-type-marginal strategies: ``positions``
    positions x 19 substitutions on a real protein of the bundled sample cropped to each length."""
    from protein_performer import score as S
    from protein_performer.formats.fasta import read_fasta
    from protein_performer.tokenizer import STANDARD_AA
    proteins = sorted((r.sequence for r in read_fasta(common.SAMPLE) if set(r.sequence) <= set(STANDARD_AA)
                       if len(r.sequence) >= min(lengths)), key=len)
    scorer = S.Scorer(loaded)
    rng = random.Random(seed)
    rows = []
    for L in lengths:
        wt = next((p for p in proteins if len(p) >= L), proteins[-1])[:L]
        mutants = [f"{wt[p]}{p + 1}{a}" for p in sorted(rng.sample(range(L), min(positions, L)))
                   for a in STANDARD_AA if a != wt[p]]
        path = work / f"assay_{L}.csv"
        path.write_text("mutant\n" + "\n".join(mutants) + "\n")
        assay = S.read_assay(path, wt)
        row = {"length": L, "mutants": len(mutants), "positions": positions}
        for strategy in ("masked_marginal", "wt_marginal"):
            t = common.measure(lambda: S.score_assay(scorer, assay, [strategy]), repeats, warmup=1)
            row[strategy] = {"seconds": t.median, "mutants_per_s": len(mutants) / t.median}
        rows.append(row)
        print(f"scorer L={L}: {row}", flush=True)
    return rows


# ----------------------------------------------------------------------------- the doc
def fmt(v, digits=3):
    return "–" if v is None else f"{v:.{digits}f}"


def headline(task: str, m: dict | None) -> str:
    if m is None:
        return "–"
    key = HEADLINE[task]
    extra = {"classification": "mcc" if m.get("auroc") is not None else "macro_f1"}.get(task)
    return fmt(m.get(key)) + (f" / {fmt(m.get(extra))}" if extra else "")


def kept(ft: dict | None) -> str:
    """Which weights finetune kept, the best epoch's confidence over the probe, and pooling=auto's choice:
    'epoch 3 (0.990); layers'."""
    if not ft or "selection" not in ft:
        return "–"
    sel, pooled = ft["selection"], (ft.get("pooling") or {}).get("chosen")
    return (sel["kept"] + (f" ({sel['confidence']:.3f})" if sel.get("confidence") is not None else "")
            + (f"; {pooled}" if pooled else ""))


def epochs_note(meta: dict, tasks) -> str:
    """' (scop: 5)' for each shown task fine-tuned for other than --epochs epochs."""
    return "".join(f" ({t}: {n})" for t, n in meta.get("task_epochs", {}).items() if t in tasks)


def render(results: dict, command: str, raw: Path = RAW) -> str:
    from protein_performer import finetune as FT
    meta, tasks, speed = results["meta"], results["tasks"], results.get("scorer")
    lines = ["# Downstream tasks: fine-tuning, linear probes, composition; the scorer's speed", "",
             f"Generated by `{command}` at commit {meta['commit']} on {meta['date']} "
             f"({meta['cpu']}, {meta['threads']} threads; load {meta['load']}); whole run {meta['seconds'] / 60:.1f} min."
             + (f" The rows of {', '.join(meta['resumed']['tasks'])} were reused (`--resume`) from the run at commit "
                f"{meta['resumed']['commit']}." if meta.get("resumed") else ""),
             "", f"Model: `{meta['ckpt']}`, the README default (`python scripts/train.py`: FAVOR+, dim 128, "
             f"depth 4, {meta['params'] / 1e6:.2f} M parameters, {meta['step']} steps on the bundled Swiss-Prot "
             f"sample). Every figure is on the set's own test split; training sets are **subsampled** (seeded, "
             f"seed {meta['seed']}) and fine-tuning runs at most {meta['epochs']} epochs"
             + epochs_note(meta, tasks) + ", to keep the run short on "
             "2 CPU cores: the figures are what this budget buys, not the model's ceiling.", "",
             "| task | metric | fine-tuned | " + ("LoRA | " if meta["lora"] else "") +
             "linear probe (last layer; ss3: with its window) | composition | constant | fine-tune time | kept (confidence); pooling=auto's choice |",
             "|---|---|---:|" + ("---:|" if meta["lora"] else "") + "---:|---:|---:|---:|---|"]
    for name, r in tasks.items():
        task = r["task"]
        metric = {"classification": "accuracy / MCC" if len(r["composition"]) and r["composition"].get("auroc")
                  is not None else "accuracy / macro-F1", "regression": "Spearman", "residue": "Q3"}[task]
        ft, lo = r.get("finetune"), r.get("finetune_lora")
        const = (ft or {}).get("baseline", {})
        const_v = const.get("accuracy", const.get("residue_accuracy")) if task != "regression" else None
        time_s = f"{ft['train_seconds']:.0f} s ({ft['epochs']} ep)" if ft else "–"
        if lo:
            time_s += f"; LoRA {lo['train_seconds']:.0f} s"
        lines.append(f"| {name}{' (out of sample)' if name in OUT_OF_SAMPLE else ''} | {metric} | {headline(task, ft)} | " + (f"{headline(task, lo)} | " if meta["lora"] else "")
                     + f"{headline(task, r['probe_default'])} | {headline(task, r['composition'])} | "
                     f"{fmt(const_v) if const_v is not None else ('0 (Spearman of a constant)' if task == 'regression' else '–')} | {time_s} | "
                     f"{kept(ft)} |")
    lines += ["", "Proteins used (train / valid / test) and what each set is:", "",
              "| task | what | train | valid | test | of (train / valid / test) | files |", "|---|---|---:|---:|---:|---|---|"]
    for name, r in tasks.items():
        u, a = r["used"], r["available"]
        lines.append(f"| {name} | {r['what']} | {u['train']:,} | {u['valid']:,} | {u['test']:,} | "
                     f"{a['train']:,} / {a['valid'] or 'drawn from train'} / {a['test']:,} | "
                     + ", ".join(f"`data/labeled/{f}`" for f in r["files"]) + " |")
    ft_any = next((r["finetune"] for r in tasks.values() if r.get("finetune")), None)
    if ft_any:
        s = ft_any["settings"]
        start = ("the head starts as a linear probe of the frozen encoder (LP-FT), a start that competes with every "
                 "epoch" if s.get("head_init", "random") == "probe" else "a random head")
        window = next((r["finetune"]["settings"].get("window", 0) for r in tasks.values()
                       if r.get("finetune") and r["task"] == "residue"), None)
        chosen = ", ".join(f"{n} {r['finetune']['pooling']['chosen']}" for n, r in tasks.items()
                           if (r.get("finetune") or {}).get("pooling"))
        asked = next((r["finetune"]["settings"].get("pooling", "mean") for r in tasks.values()
                      if r.get("finetune") and r["task"] != "residue"), "mean")
        pooling = f"pooling={asked}" + (f" (chosen on the validation split: {chosen})" if chosen else "")
        lines += ["", f"Fine-tuning: `protein_performer.finetune.finetune` (the `finetune` command) on the subsample "
                  f"written as a CSV with a split column, {pooling}, freeze={s.get('freeze', 'none')}, head_init={s.get('head_init', 'random')} "
                  f"({start}), lr {s['lr']} (encoder) / {s['head_lr']} (head)"
                  + (f", rates warmed up over {100 * FT.WARMUP:g} % of the steps, then falling linearly to 0 at the last "
                     "epoch (`schedule=linear`)"
                     if s.get("schedule", "constant") == "linear" else ", constant rates")
                  + f", dropout {s['dropout']}, max_tokens "
                  f"{s['max_tokens']}, at most {meta['epochs']} epochs{epochs_note(meta, tasks)}, early stopping on the validation "
                  f"{'loss' if s.get('stop_on', 'loss') == 'loss' else 'metric'} (patience {s['patience']}; the weights "
                  "kept: the best epoch by the validation metric"
                  + (f", its class probabilities (values) mixed {s['ensemble']:g} : {1 - s['ensemble']:g} with the "
                     "linear probe's (`ensemble`, an output-space ensemble; the saved model holds both encoders)"
                     if s.get("ensemble", 1) < 1 else "")
                  + f", in place of the linear probe only when it beats the probe in "
                  f"{s.get('min_confidence', FT.MIN_CONFIDENCE):g} of 1,000 bootstrap draws of the validation "
                  "proteins, its confidence; else the probe: finetune's default gate)"
                  + (f"; the per-residue head also sees {window} residues on either side (`window={window}`)"
                     if window else "") + ". The same for one task by hand:", "", "```bash",
                  "protein-performer finetune ckpt=CKPT labels=signalp.csv task=classification output_dir=ft/signalp "
                  f"lr={s['lr']} head_lr={s['head_lr']} max_tokens={s['max_tokens']} patience={s['patience']} "
                  + (f"stop_on={s['stop_on']} " if s.get("stop_on", "loss") != "loss" else "")
                  + (f"freeze={s['freeze']} " if str(s.get('freeze', 'none')) != "none" else "")
                  + f"dropout={s['dropout']} "
                  + (f"schedule={s['schedule']} " if s.get("schedule", "constant") != "constant" else "")
                  + f"trainer.max_epochs={meta['epochs']}", "```"]
        if meta["lora"]:
            lo = next(r["finetune_lora"]["settings"] for r in tasks.values() if r.get("finetune_lora"))
            lines += ["", f"LoRA: `lora=true lora_rank={lo['lora_rank']} lora_alpha={lo['lora_alpha']} lr={lo['lr']}` "
                      "(adapters on every attention and feed-forward projection; the encoder's own weights frozen; "
                      "merged into the weights at the end)."]
    lines += ["", "Linear probe: `probe`'s pipeline (standardize, then logistic regression with C chosen by 3-fold "
              "cross-validation, or ridge with alpha by leave-one-out) fitted on the training subsample's embeddings "
              "and scored on the test split with the `finetune` metrics: per protein the mean of the last layer's states "
              f"(embed's defaults), per residue the residue's state beside the mean of those within {WINDOW} of it "
              "(`window` below: what finetune's windowed head and its probe see). Composition: the 20 amino-acid frequencies "
              f"of each protein; per residue (ss3): the residue's one-hot and the frequencies within {WINDOW} residues "
              "of it (40 features)." + "".join(f" {name}'s probes are fitted on a seeded sample of {r['probe_residues']:,} "
                                               "training residues." for name, r in tasks.items() if "probe_residues" in r), ""]

    # item 4
    lines += ["## Which layers and pooling to probe (issue 21, item 4)", "",
              "The same probe on every layer (0 = the token embedding, "
              f"{meta['depth']} = the last block after the final norm) and pooling `embed` offers (per residue also "
              f"`window`: the residue's state beside the mean of the states within {WINDOW} residues of it, the "
              "context the composition baseline gets); **bold**: above composition. `embed`'s defaults are `layers=[-1] pooling=[mean]`.", ""]
    for name, r in tasks.items():
        task, comp = r["task"], r["composition"][HEADLINE[r["task"]]]
        grid = r["probe_grid"]
        poolings = sorted({k.split("/")[0] for k in grid}, key=lambda p: (list(POOLINGS + RESIDUE_POOLINGS).index(p)))
        lines += [f"**{name}** ({HEADLINE[task]}; composition {comp:.3f}):", "",
                  "| pooling | " + " | ".join(f"layer {i}" for i in range(meta["depth"] + 1)) + " |",
                  "|---|" + "---:|" * (meta["depth"] + 1)]
        for p in poolings:
            cells = []
            for i in range(meta["depth"] + 1):
                v = grid[f"{p}/{i}"][HEADLINE[task]]
                cells.append("constant" if v != v else f"**{v:.3f}**" if v > comp else f"{v:.3f}")  # NaN: one vector for all
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines.append("")
    verdict = []
    for name, r in tasks.items():
        key = HEADLINE[r["task"]]
        d, comp = r["probe_default"][key], r["composition"][key]
        best_k, best = max(r["probe_grid"].items(), key=lambda kv: kv[1][key] if kv[1][key] == kv[1][key] else -1.0)
        verdict.append(f"- {name}: the probe above {d:.3f} vs composition {comp:.3f} "
                       f"({'beats it' if d > comp else 'does not beat it'}); best `{best_k}` {best[key]:.3f}")
    lines += ["Summary:", ""] + verdict + [""]

    if speed:
        lines += ["## Variant scorer throughput", "",
                  f"`protein_performer.score.score_assay` (the `score` command's core) on a real protein of the bundled "
                  f"sample cropped to L residues, {speed[0]['positions']} random positions x 19 substitutions each; "
                  "median of the timed runs after a warm-up, model in float32 on the CPU. Masked marginal: one forward "
                  "per mutated position (masked copies batched under 16,384 tokens); wild-type marginal: one forward. "
                  "The whole protein is the context at every length (ESM's scorer stops at 1,022).", "",
                  "| L (residues) | mutants | masked marginal: s | mutants/s | wild-type marginal: s | mutants/s |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for row in speed:
            mm, wt = row["masked_marginal"], row["wt_marginal"]
            lines.append(f"| {row['length']:,} | {row['mutants']:,} | {mm['seconds']:.2f} | {mm['mutants_per_s']:,.0f} | "
                         f"{wt['seconds']:.3f} | {wt['mutants_per_s']:,.0f} |")
        lines.append("")
    lines += [f"Raw figures: `{raw.relative_to(common.ROOT) if raw.is_relative_to(common.ROOT) else raw}`."]
    return "\n".join(lines)


def parse_per_task(ap, flag: str, items) -> dict:
    """FLAG TASK=N ... -> {task: N}; anything else is one line and exit 2 (argparse's error)."""
    values = {}
    for item in items:
        name, _, n = item.partition("=")
        if name not in TASKS or not n.isdigit() or int(n) < 1:
            ap.error(f"{flag} {item!r}: expected TASK=N with TASK one of {', '.join(TASKS)} and N >= 1")
        values[name] = int(n)
    return values


def main() -> None:
    from protein_performer import finetune as FT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="the README default model's checkpoint (python scripts/train.py)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--task-epochs", nargs="*", default=[f"{t}={n}" for t, n in TASK_EPOCHS.items()], metavar="TASK=N",
                    help="epochs for a task instead of --epochs (default: TASK_EPOCHS)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--head-lr", type=float, default=3e-3)
    ap.add_argument("--max-tokens", type=int, default=2048, help="fine-tuning batches (padded tokens)")
    ap.add_argument("--dropout", type=float, default=0.0, help="finetune's dropout (before the head's linear layer)")
    ap.add_argument("--schedule", default="linear", choices=["constant", "linear"], help="finetune's schedule")
    ap.add_argument("--head-init", default="random", choices=["probe", "random"], help="finetune's head_init")
    ap.add_argument("--pooling", default="auto", choices=["auto", "mean", "attention", "layers"],
                    help="finetune's pooling (per-protein tasks)")
    ap.add_argument("--freeze", default="none", help="finetune's freeze: none | all | N (the embedding and the first N blocks)")
    ap.add_argument("--ensemble", type=float, default=None,
                    help="finetune's ensemble: the best epoch's share of the output mix with the probe (default: finetune's)")
    ap.add_argument("--window", type=int, default=None, help="finetune's window (residues either side) for ss3 "
                                                             "(default: finetune's, RESIDUE_WINDOW)")
    ap.add_argument("--lora", action="store_true", help="also fine-tune with LoRA adapters")
    ap.add_argument("--lora-only", action="store_true", help="fine-tune with LoRA adapters only (no full fine-tuning)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-lr", type=float, default=2e-3)
    ap.add_argument("--probe-residues", type=int, default=FT.PROBE_RESIDUES)
    ap.add_argument("--skip-finetune", action="store_true")
    ap.add_argument("--max-train", type=int, help="fewer training proteins than SIZES (a quick check)")
    ap.add_argument("--train", nargs="*", default=[], metavar="TASK=N",
                    help="training proteins for a task instead of SIZES' (e.g. scop=8000)")
    ap.add_argument("--max-test", type=int, help="at most this many test proteins (a quick check)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[256, 1024, 2048, 4096, 8192])
    ap.add_argument("--positions", type=int, default=8, help="mutated positions per protein (x 19 substitutions)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="reuse the tasks a failed run finished (RAW.partial)")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--raw", type=Path, default=RAW)
    args = ap.parse_args()
    args.train = parse_per_task(ap, "--train", args.train)
    args.task_epochs = parse_per_task(ap, "--task-epochs", args.task_epochs)

    import torch

    # every module the run needs, imported now: a long run does not see later edits of the tree
    import protein_performer.data.sampler  # noqa: F401
    import protein_performer.embed  # noqa: F401
    import protein_performer.finetune  # noqa: F401
    import protein_performer.probe  # noqa: F401
    import protein_performer.score  # noqa: F401
    from protein_performer.hub.load import checkpoint_step, load_model
    start = time.perf_counter()
    loaded = load_model(args.ckpt)
    commit = common.git_commit()
    meta = {"ckpt": args.ckpt, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": common.cpu(), "threads": torch.get_num_threads(), "load": common.load_average(),
            "params": sum(p.numel() for p in loaded.net.parameters()), "step": checkpoint_step(args.ckpt),
            "depth": loaded.net.depth, "seed": args.seed, "epochs": args.epochs, "task_epochs": args.task_epochs,
            "lora": args.lora or args.lora_only}
    results = {"meta": meta, "tasks": {}}
    partial = args.raw.with_name(args.raw.name + ".partial")  # each finished part, kept should a later one fail
    if args.resume and partial.is_file():
        done = json.loads(partial.read_text())
        results["tasks"] = {k: v for k, v in done["tasks"].items() if k in args.tasks}
        meta["resumed"] = {"tasks": list(results["tasks"]), "commit": done["meta"]["commit"]}
        print(f"resumed from {partial}: {', '.join(results['tasks'])}", flush=True)
    args.raw.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="downstream-") as tmp:
        work = Path(tmp)
        for name in args.tasks:
            if name not in results["tasks"]:
                results["tasks"][name] = run_task(name, loaded, args.ckpt, work, args)
                partial.write_text(json.dumps(results, indent=1, default=float) + "\n")
        results["tasks"] = {n: results["tasks"][n] for n in args.tasks}
        if args.lengths:
            results["scorer"] = scorer_speed(loaded, args.lengths, args.positions, args.repeats, args.seed, work)
    meta["seconds"] = time.perf_counter() - start
    args.raw.write_text(json.dumps(results, indent=1, default=float) + "\n")
    partial.unlink(missing_ok=True)
    text = render(results, common.command_line(__file__), args.raw.resolve())
    common.write_doc(args.doc, text, keep_below=True)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

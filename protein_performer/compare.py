"""The comparison experiment: train several attention kernels with the same budget and
seed, evaluate them the same way (:mod:`protein_performer.evaluate`), write one table."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

from .errors import UserError
from .evaluate import evaluate, format_table
from .files import write_bytes, write_json, write_text
from .output_guard import OutputGuard
from .formats import check_source
from .sequences import check_max_records
from .resources import conf_dir

log = logging.getLogger(__name__)

GENERATED_END = "<!-- end of generated part: text below this line is kept when scripts/compare.py rewrites the file -->"


def flatten_overrides(tree: dict | list, prefix: str = "", where: str = "overrides") -> list[str]:
    """{"trainer": {"max_steps": 5}} -> ["trainer.max_steps=5"] (Hydra command-line overrides); a list
    of such strings (``model_overrides.NAME=["trainer.max_steps=5"]``) is taken as it is.  ``where``
    names the setting in the error for anything else."""
    if isinstance(tree, (list, tuple)) and all(isinstance(o, str) and "=" in o for o in tree):
        return list(tree)
    if not isinstance(tree, dict):
        raise UserError(f"{where}: a tree of keys or a list of key=value strings, got {tree!r}")
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += flatten_overrides(v, key + ".")
        else:
            out.append(f"{key}={'null' if v is None else v}")
    return out


def compose_train_config(overrides: Sequence[str]):
    """The training config that ``scripts/train.py OVERRIDES`` would run, composed from conf/
    (inside a running Hydra app its config search path is used)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    if GlobalHydra.instance().is_initialized():
        return compose("train", overrides=list(overrides))
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def compare(models: Sequence[str], train_overrides: Sequence[str], heldout: str | Path, output_dir: str | Path,
            *, doc: str | Path | None = None, reuse: bool = True, command: str | None = None,
            exact_name: str = "transformer", model_overrides: dict[str, Sequence[str]] | None = None,
            title: str = "Performer kernels against exact softmax", time_budget: float | None = None,
            calibration_reps: int | None = None, long_heldout: str | Path | None = None, overwrite: bool = False,
            **eval_kwargs) -> dict[str, dict]:
    """Train each ``model`` config (conf/model/<name>.yaml) with the same overrides (budget,
    seed, data) through :func:`protein_performer.training.run.train`, evaluate the last
    checkpoints the same way on ``heldout`` and write one table + plot (``doc``, markdown,
    with the PNG beside it). ``model_overrides[name]``: extra overrides for one model (e.g. a
    shorter crop for exact softmax), applied after the common ones and listed in the doc.
    ``reuse``: a finished run (``checkpoints/last.ckpt`` and ``train_summary.json``) made with
    the same training settings (:func:`run_settings`) is not trained again; one made with
    other settings (another step budget, other overrides) is trained again, with a warning.
    ``time_budget`` (seconds): equal wall-clock time measured side by side; each model trains for
    the steps its paired step costs fit in the budget (training/step_cost.py), ``trainer.max_time``
    off; ``calibration_reps`` batches timed per model and crop (None: step_cost.CALIBRATION_REPS).
    ``long_heldout``: a second held-out file scored the same way (its figures under each model's
    "long_heldout" and a second table in the doc): long proteins are few in ``heldout``, too few for
    a bucket to separate kernels. Every output goes through the output guard: a report or JSON
    compare did not write (``output_dir``'s journal; a doc without :data:`GENERATED_END`) is
    replaced only with ``overwrite`` (after a warning line)."""
    out = Path(output_dir)
    held = {"heldout.path": heldout, **({"heldout.long_path": long_heldout} if long_heldout else {})}
    data = [o.split("=", 1)[1] for o in train_overrides if o.startswith("data.path=")]
    guard = OutputGuard("compare", {**held, "train.data.path": data[-1] if data else None}, overwrite=overwrite,
                        folder=out, journal=True)
    guard.folder_path("output_dir", out)
    if doc is not None:
        guard.file("doc", doc, ours=lambda p: GENERATED_END in p.read_text(errors="replace"))
        guard.file("doc (its plot)", Path(doc).with_suffix(".png"),
                   ours=lambda p: Path(doc).is_file() and GENERATED_END in Path(doc).read_text(errors="replace"))
    for name in ("comparison.json", *(("calibration.json",) if time_budget is not None else ())):
        guard.file(f"output_dir/{name}", out / name)
    for i, name in enumerate(models):
        guard.child(out / "runs", name, f"models[{i}]", "output_dir/runs")
    if exact_name not in models and not (conf_dir() / "model" / f"{exact_name}.yaml").is_file():
        raise UserError(f"exact={exact_name}: no such model (conf/model/{exact_name}.yaml); exact names the "
                        f"exact-softmax reference the gaps are measured against, one of models={list(models)}")
    for key, path in held.items():  # a wrong path is one line now, not after every model has trained
        check_source(path, key)
    check_max_records(eval_kwargs.get("max_records"), "heldout.max_records")
    check_time_budget(time_budget, calibration_reps)
    ckpts, train_info = [], {}
    extras = {name: list((model_overrides or {}).get(name, [])) for name in models}
    calibration = None
    if time_budget is not None:
        calibration = calibrate(models, train_overrides, extras, float(time_budget), calibration_reps)
        guard.record(out / "calibration.json")
        write_json(out / "calibration.json", calibration, indent=2)
        guard.seal(out / "calibration.json")
        for name in models:
            extras[name] += [f"trainer.max_steps={calibration['steps'][name]}", "trainer.max_time=null"]
    for name in models:
        train_info[name] = train_or_reuse(name, out / "runs" / name, train_overrides, extras[name], reuse)
        ckpts.append(str(out / "runs" / name / "checkpoints" / "last.ckpt"))
    results = evaluate(ckpts, heldout, out / "eval", names=list(models), overwrite=overwrite, **eval_kwargs)
    long_results = evaluate(ckpts, long_heldout, out / "eval_long", names=list(models), overwrite=overwrite,
                            **eval_kwargs) \
        if long_heldout else None
    for name in models:
        results[name]["training"] = train_info[name]
        if long_results:
            results[name]["long_heldout"] = long_results[name]
    reports = (out / "comparison.json", *((doc, Path(doc).with_suffix(".png")) if doc is not None else ()))
    guard.record(*reports)
    write_json(out / "comparison.json", results, indent=2)
    if doc is not None:
        write_comparison_doc(results, doc, out / "eval" / "metrics.png", train_overrides, heldout,
                             command=command, exact_name=exact_name, title=title, calibration=calibration,
                             long_heldout=long_heldout)
    guard.seal(*reports)
    return results


def train_or_reuse(name: str, run_dir: Path, train_overrides: Sequence[str], extra: list[str], reuse: bool) -> dict:
    """Model ``name`` trained into ``run_dir`` (or, with ``reuse``, a finished run there made with the same
    training settings, :func:`run_settings`): what the report says of its training."""
    import time

    from omegaconf import OmegaConf

    from .training.run import train
    last, summary_path = run_dir / "checkpoints" / "last.ckpt", run_dir / "train_summary.json"
    # overwrite: a run folder without train_summary.json is an unfinished run, trained afresh
    cfg = compose_train_config([f"model={name}", *train_overrides, *extra, "overwrite=true"])
    settings = run_settings(OmegaConf.to_container(cfg, resolve=True))
    old = json.loads(summary_path.read_text()) if reuse and last.is_file() and summary_path.is_file() else None
    if old is not None and old.get("settings") == settings:
        log.info("%s: reusing %s (same training settings)", name, last)
        return {k: v for k, v in old.items() if k != "settings"}
    if old is not None:
        log.warning("%s: %s was trained with other settings (%s); training it again", name, run_dir,
                    settings_diff(old.get("settings"), settings))
    t0 = time.time()
    summary, task = train(cfg, run_dir)
    info = {"train_seconds": round(time.time() - t0, 1), "parameters": sum(p.numel() for p in task.parameters()),
            "val_perplexity": summary.get("val/perplexity"), "val_accuracy": summary.get("val/accuracy"),
            "max_steps": int(cfg.trainer.max_steps), "kernel": cfg.model.attention.kernel, "extra_overrides": extra}
    write_json(summary_path, {**info, "settings": settings}, indent=2)
    return info


def check_time_budget(time_budget, calibration_reps) -> None:
    """One line for a time budget that is not a positive number of seconds, or reps below 1."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if time_budget is not None and not (number(time_budget) and time_budget > 0):
        raise UserError(f"time_budget must be a positive number of seconds (or null), got {time_budget!r}")
    if calibration_reps is not None and not (number(calibration_reps) and int(calibration_reps) == calibration_reps
                                             and calibration_reps >= 1):
        raise UserError(f"calibration_reps must be a whole number >= 1, got {calibration_reps!r}")


def calibrate(models: Sequence[str], train_overrides: Sequence[str], extras: dict[str, list[str]],
              seconds: float, reps: int | None) -> dict:
    """Each model's steps for ``seconds`` of training from its step costs measured side by side
    (:func:`protein_performer.training.step_cost.measure_step_costs`)."""
    from .training.step_cost import CALIBRATION_REPS, crop_schedule, measure_step_costs, steps_within
    reps = CALIBRATION_REPS if reps is None else int(reps)
    cfgs = {name: compose_train_config([f"model={name}", *train_overrides, *extras[name]]) for name in models}
    costs = measure_step_costs(cfgs, reps)
    schedules = {name: crop_schedule(cfgs[name].data) for name in models}
    steps = {name: steps_within(schedules[name], costs[name], seconds) for name in models}
    for name in models:
        if not steps[name]:
            raise UserError(f"time_budget={seconds:g} s buys no training step of {name} "
                            f"({costs[name][schedules[name][0][1]]:.3g} s for its first step): raise it")
        log.info("%s: %s s per step by crop -> %d steps in %.0f s", name,
                 {c: round(t, 3) for c, t in costs[name].items()}, steps[name], seconds)
    return {"seconds": seconds, "reps": reps, "steps": steps,
            # unrounded: the steps are recomputed from these (a rounded cost can buy one step more or less)
            "seconds_per_step": {n: {str(c): float(t) for c, t in per.items()} for n, per in costs.items()}}


#: training-config keys that do not change the trained model (a reused run may differ in them)
NOT_SETTINGS = ("overwrite", "logger", "run_name", "trainer.enable_progress_bar", "data.progress",
                "progress_every", "progress_seconds",
                "data.num_workers", "data.prepare_workers")


def run_settings(config: dict) -> dict:
    """The composed training config, less :data:`NOT_SETTINGS`: what decides whether a
    finished run can be reused for the comparison asked now."""
    flat = dict(o.split("=", 1) for o in flatten_overrides(config))
    return {k: v for k, v in flat.items() if not any(k == n or k.startswith(n + ".") for n in NOT_SETTINGS)}


def settings_diff(old: dict | None, new: dict) -> str:
    """The first few differing keys, ``key old -> new``."""
    if not old:
        return "no settings recorded"
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    text = ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in keys[:3])
    return text + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def perplexity_gaps(results: dict[str, dict], exact_name: str = "transformer") -> dict[str, float]:
    """Relative perplexity of each model against the exact model: ppl / ppl_exact - 1."""
    if exact_name not in results or results[exact_name]["perplexity"] is None:
        return {}
    ref = results[exact_name]["perplexity"]
    return {n: m["perplexity"] / ref - 1 for n, m in results.items() if n != exact_name and m["perplexity"]}


def calibration_lines(calibration: dict | None) -> list[str]:
    """The doc's account of a paired time budget: seconds per step by crop, and the step counts."""
    if not calibration:
        return []
    crops = sorted({int(c) for per in calibration["seconds_per_step"].values() for c in per})
    rows = [f"| {n} | " + " | ".join(f"{per[str(c)]:.3f}" if str(c) in per else "–" for c in crops)
            + f" | {calibration['steps'][n]} |" for n, per in calibration["seconds_per_step"].items()]
    return [f"* Equal time, measured side by side (`time_budget={calibration['seconds']:g}`): each model's "
            f"training step timed on the same real batches at every crop of its curriculum, the models in turn, "
            f"mean of {calibration['reps']} batches spread over the epoch; each trains for the steps those costs fit in "
            f"{calibration['seconds']:g} s (protein_performer/training/step_cost.py):",
            "", "| model | " + " | ".join(f"s/step at crop {c}" for c in crops) + " | steps |",
            "|---" * (len(crops) + 2) + "|", *rows, ""]


def write_comparison_doc(results: dict[str, dict], doc: str | Path, png: str | Path, train_overrides: Sequence[str],
                         heldout: str | Path, *, command: str | None = None, exact_name: str = "transformer",
                         title: str = "Performer kernels against exact softmax", calibration: dict | None = None,
                         long_heldout: str | Path | None = None) -> None:
    """Write the table, gaps and plot into ``doc``, keeping any text after GENERATED_END (and, with
    ``long_heldout``, the by-length table of each model's "long_heldout" figures)."""
    import datetime

    doc = Path(doc)
    png_dst = doc.with_suffix(".png")
    write_bytes(png_dst, Path(png).read_bytes())
    kept = ""
    if doc.is_file() and GENERATED_END in (old := doc.read_text()):
        kept = old.split(GENERATED_END, 1)[1]
    any_m = next(iter(results.values()))
    ev = any_m["evaluation"]
    lines = [
        f"# {title}",
        "",
        f"Generated by `{command or 'scripts/compare.py'}` on {datetime.date.today().isoformat()}.",
        "",
        f"* Held-out set: `{heldout}` ({any_m['num_sequences']} proteins; "
        f"{ev['objective']}, scored: {ev['scored']}, seed {ev['seed']}).",
        "* Same budget and seed for every model (overrides of `conf/train.yaml`): `"
        + " ".join(train_overrides) + "`.",
        *[f"* Only for {n}: `{' '.join(m['training']['extra_overrides'])}`." for n, m in results.items()
          if m.get("training", {}).get("extra_overrides")],
        *calibration_lines(calibration),
        "* Baseline: amino-acid frequencies of the training data (stored in each checkpoint).",
        "",
        "| model | kernel | steps | train s | params | held-out ppl | acc | gap vs exact | baseline ppl | "
        "baseline acc | tokens | seen whole? |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gaps = perplexity_gaps(results, exact_name)
    for name, m in results.items():
        t = m.get("training", {})
        e = m["evaluation"]
        whole = "yes" if e["full_length"] else f"window {e['window']}/stride {e['stride']} for {e['windowed_sequences']}"
        gap = f"{100 * gaps[name]:+.2f} %" if name in gaps else ("(reference)" if name == exact_name else "–")
        lines.append(f"| {name} | {e['attention_kernel']} | {m.get('step')} | {t.get('train_seconds', '–')} | "
                     f"{t.get('parameters', '–')} | {m['perplexity']:.3f} | {100 * m['accuracy']:.2f} % | {gap} | "
                     f"{m['baseline_perplexity']:.3f} | {100 * m['baseline_accuracy']:.2f} % | {m['num_tokens']} | "
                     f"{whole} |")
    lines += ["", "Perplexity by protein length (residues):", "", format_table(results), ""]
    if long_heldout:
        long = {name: m["long_heldout"] for name, m in results.items()}
        lines += [f"The same checkpoints on the long held-out set `{long_heldout}` ({any_m['long_heldout']['num_sequences']} "
                  "proteins, scored the same way):", "", format_table(long), ""]
    lines += [f"![perplexity and accuracy by length]({png_dst.name})", "", GENERATED_END]
    write_text(doc, "\n".join(lines) + (kept if kept else "\n"))

"""The jobs behind ``protein-performer <command>`` and ``python scripts/<job>.py``: each takes
the composed Hydra config, calls the library and prints what a user needs. Heavy imports
(torch, Lightning, scikit-learn) happen inside, so ``--help`` and config errors are fast.

One convention hands a config to the library: :func:`settings` turns it into plain, resolved
Python values (no casts, no ``DictConfig`` past this module) and the command passes them as
keyword arguments named like the keys (its required inputs first, positionally; a group such
as ``data`` spread into the call). ``train`` alone takes the config itself: it instantiates
its parts. Library errors name the library's argument (``unknown``); :func:`settings_under`
renames it to the key a command's config holds it under (``data.unknown``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .errors import UserError, user_error


def settings(cfg: DictConfig, *required: str, example: str = "") -> dict:
    """The config as plain Python values, after checking ``required`` keys (in this order,
    whatever order Hydra would report them)."""
    for key in required:
        if OmegaConf.is_missing(cfg, key):
            raise UserError(f"{key} is required: {sys.argv[0]} {example} (--help lists every key)")
    return OmegaConf.to_container(cfg, resolve=True)


def call(function, *args, **kw):
    """``function(*args, **kw)``, each key checked first: one added on the command line that the
    function does not take (``+model.attention.backend=fla``) is one line naming it, not a TypeError."""
    import inspect
    params = inspect.signature(function).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key, value in kw.items():
            if key not in params:
                while isinstance(value, dict) and len(value) == 1:  # the key as typed: model.attention.backend
                    (sub, value), = value.items()
                    key = f"{key}.{sub}"
                raise UserError(f"{key}: {sys.argv[0]} takes no such key (--help lists every key)")
    return function(*args, **kw)


@contextlib.contextmanager
def settings_under(group: str):
    """A library error naming a setting (``tokenizer.SettingError``: ``unknown``) names it as
    this command's config spells it (``data.unknown``), also when Hydra wrapped it."""
    try:
        yield
    except BaseException as e:
        err = user_error(e)
        if getattr(err, "setting", None) and not err.setting.startswith(f"{group}."):
            err.setting = f"{group}.{err.setting}"
        raise


def train(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from .hub.load import load_model
    from .training.run import train as train_run
    with settings_under("data"):  # cli.run checked the folder and cleans up after a user error
        train_run(cfg, HydraConfig.get().runtime.output_dir, open_model=lambda p: load_model(p).net,
                  overrides=list(HydraConfig.get().overrides.task))


def prepare(cfg: DictConfig) -> None:
    from .data.prepare import prepare_data_config
    from .data.shards import PreparedData
    if not str(cfg.data.get("_target_", "")).endswith("ShardDataModule"):
        raise UserError(f"data: {cfg.data.get('_target_')} reads its file in memory, there is nothing to prepare "
                        f"(use data=fasta or data=uniprot with data.path=FILE)")
    with settings_under("data"):
        out = prepare_data_config(settings(cfg)["data"])
    m = PreparedData(out).manifest
    print(f"{m['records_read']:,} read = {m['kept']:,} kept + {m['duplicates']:,} duplicates + "
          f"{m['invalid']:,} invalid; {m['tokens']:,} tokens\nprepared data: {out}")


def evaluate(cfg: DictConfig) -> None:
    from .evaluate import evaluate as evaluate_files, format_table
    s = settings(cfg, "ckpt", example="ckpt=CHECKPOINT [data.path=FILE] [output_dir=DIR]")
    data, out = s.pop("data"), s.pop("output_dir")
    with settings_under("data"):
        results = evaluate_files(s.pop("ckpt"), data.pop("path"), out, **data, **s)
    print(format_table(results))
    print(f"\nwrote {out}/metrics.json, metrics.csv, metrics.png")


def embed(cfg: DictConfig) -> None:
    kw = settings(cfg, "ckpt", "input", example="ckpt=CHECKPOINT input=FILE output=OUT.h5")
    from .embed import embed_file
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    from .cli import RERUN
    from .embed.settings import TRAINER_KEYS, several
    if RERUN and isinstance(kw.get("trainer"), dict) and several({**TRAINER_KEYS, **kw["trainer"]}):
        sys.argv = [*RERUN, *sys.argv[1:]]  # Lightning's DDP starts the other processes with sys.argv
    summary = call(embed_file, kw.pop("ckpt"), kw.pop("input"), **kw)
    if summary is not None:  # None: a process Lightning started beside process 0
        print(json.dumps(summary))


def probe(cfg: DictConfig) -> None:
    kw = settings(cfg, "embeddings", "labels", example="embeddings=OUT.h5 labels=labels.csv")
    from .probe import format_result, run_probe
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    from .files import write_json
    from .output_guard import OutputGuard
    output = kw.pop("output")
    embeddings = kw["embeddings"] if isinstance(kw["embeddings"], list) else [kw["embeddings"]]
    guard = OutputGuard("probe", {"labels": kw["labels"], "test_labels": kw["test_labels"],
                                  **{f"embeddings[{i}]": e for i, e in enumerate(embeddings)}},
                        overwrite=bool(kw.pop("overwrite", False)))
    guard.file("output", output or None)
    guard.sweep()
    result = call(run_probe, kw.pop("embeddings"), kw.pop("labels"), **kw)
    print(format_result(result))
    if output:
        write_json(output, result, indent=2)  # a results file that exists is whole
        print(f"results: {output}")
    else:
        print(json.dumps(result, indent=2))


def generate(cfg: DictConfig) -> None:
    from .generate import run
    call(run, **settings(cfg))


def compare(cfg: DictConfig) -> None:
    from .compare import compare as compare_kernels, flatten_overrides, perplexity_gaps
    from .evaluate import format_table
    from .sequences import check_max_records
    s = settings(cfg)
    check_max_records((s["train"].get("data") or {}).get("max_records"), "train.data.max_records")
    command = " ".join(a for a in sys.argv if not a.startswith("hydra.job.name="))
    doc = s["doc"] or Path(s["output_dir"]) / "comparison.md"  # tracked docs only when asked
    results = compare_kernels(s["models"], flatten_overrides(s["train"]), s["heldout"]["path"], s["output_dir"],
                              doc=doc, reuse=s["reuse"], command=command.strip(), exact_name=s["exact"],
                              model_overrides={name: flatten_overrides(tree, where=f"model_overrides.{name}")
                                               for name, tree in s["model_overrides"].items()},
                              title=s["title"], time_budget=s.get("time_budget"),
                              calibration_reps=s.get("calibration_reps"), max_records=s["heldout"]["max_records"],
                              long_heldout=s["heldout"].get("long_path"), overwrite=bool(s.get("overwrite")),
                              **s["eval"])
    print(format_table(results))
    if s["heldout"].get("long_path"):
        print(f"on {s['heldout']['long_path']}:")
        print(format_table({name: m["long_heldout"] for name, m in results.items()}))
    for name, gap in perplexity_gaps(results, s["exact"]).items():
        print(f"{name}: perplexity {100 * gap:+.2f} % against {s['exact']}")
    print(f"wrote {doc}")


def export(cfg: DictConfig) -> None:
    from .hub.export import export as export_dir
    s = settings(cfg)
    out = call(export_dir, s.pop("ckpt"), s.pop("output"), **s)
    print(f"wrote {out}: config.json, model.safetensors, vocab.txt, transformers code, README.md (model card)")


def score(cfg: DictConfig) -> None:
    kw = settings(cfg, "ckpt", "input", "output",
                  example="ckpt=CHECKPOINT input=assay.csv sequence=WILD_TYPE output=scored.csv")
    from .score import format_summary, score_files
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    print(format_summary(call(score_files, kw.pop("ckpt"), kw.pop("input"), kw.pop("output"), **kw)))


def convert_esm(cfg: DictConfig) -> None:
    s = settings(cfg, "input", "output", example="input=ESM_DIR_OR_PT output=DIR [model.attention.kernel=exact]")
    from .convert_esm import convert
    attention = s.pop("model")["attention"]
    out = call(convert, s.pop("input"), s.pop("output"), **s, attention=attention)
    print(f"wrote {out}: config.json, model.safetensors, vocab.txt, transformers code, README.md "
          f"({attention['kernel']} attention)")


def finetune(cfg: DictConfig) -> None:
    kw = settings(cfg, "ckpt", "labels", "task", "output_dir",
                  example="ckpt=CHECKPOINT labels=labels.csv task=classification output_dir=DIR")
    from .finetune import finetune as finetune_run, format_metrics
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    result = call(finetune_run, kw.pop("ckpt"), kw.pop("labels"), kw.pop("task"), kw.pop("output_dir"), **kw)
    print(format_metrics(result))
    print(f"wrote {cfg.output_dir}: metrics.json, predictions.csv, model.safetensors, finetune.json")

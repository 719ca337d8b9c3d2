"""The jobs behind ``protein-performer <command>`` and ``python scripts/<job>.py``: each takes
the composed Hydra config, calls the library and prints what a user needs. Heavy imports
(torch, Lightning, scikit-learn) happen inside, so ``--help`` and config errors are fast."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .errors import UserError


def _require(cfg: DictConfig, *keys: str, example: str) -> None:
    for key in keys:  # in this order, whatever order Hydra would report them
        if OmegaConf.is_missing(cfg, key):
            raise UserError(f"{key} is required: {sys.argv[0]} {example} (--help lists every key)")


def train(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from .hub.load import load_model
    from .training.run import train as train_run
    train_run(cfg, HydraConfig.get().runtime.output_dir, open_model=lambda p: load_model(p).net)  # cli.run checked the folder and cleans up after a user error


def prepare(cfg: DictConfig) -> None:
    from .data.prepare import prepare_data_config
    from .data.shards import PreparedData
    if not str(cfg.data.get("_target_", "")).endswith("ShardDataModule"):
        raise UserError(f"data: {cfg.data.get('_target_')} reads its file in memory, there is nothing to prepare "
                        f"(use data=fasta or data=uniprot with data.path=FILE)")
    out = prepare_data_config(OmegaConf.to_container(cfg.data, resolve=True))
    m = PreparedData(out).manifest
    print(f"{m['records_read']:,} read = {m['kept']:,} kept + {m['duplicates']:,} duplicates + "
          f"{m['invalid']:,} invalid; {m['tokens']:,} tokens\nprepared data: {out}")


def evaluate(cfg: DictConfig) -> None:
    from .evaluate import evaluate as evaluate_files, format_table
    _require(cfg, "ckpt", example="ckpt=CHECKPOINT [data.path=FILE] [output_dir=DIR]")
    ckpt = OmegaConf.to_container(cfg.ckpt) if OmegaConf.is_list(cfg.ckpt) else cfg.ckpt
    results = evaluate_files(ckpt, cfg.data.path, cfg.output_dir, names=cfg.names, format=cfg.data.format,
                             max_records=cfg.data.max_records, unknown=cfg.data.unknown,
                             on_invalid=cfg.data.on_invalid, seed=cfg.seed, mask_prob=cfg.mask_prob,
                             max_tokens=cfg.max_tokens, batch_size=cfg.batch_size, window=cfg.window,
                             stride=cfg.stride, device=cfg.device, progress=cfg.progress)
    print(format_table(results))
    print(f"\nwrote {cfg.output_dir}/metrics.json, metrics.csv, metrics.png")


def embed(cfg: DictConfig) -> None:
    _require(cfg, "ckpt", "input", example="ckpt=CHECKPOINT input=FILE output=OUT.h5")
    from .embed import embed_file
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    from .cli import RERUN
    from .embed.settings import TRAINER_KEYS, several
    kw = OmegaConf.to_container(cfg, resolve=True)
    if RERUN and isinstance(kw.get("trainer"), dict) and several({**TRAINER_KEYS, **kw["trainer"]}):
        sys.argv = [*RERUN, *sys.argv[1:]]  # Lightning's DDP starts the other processes with sys.argv
    summary = embed_file(kw.pop("ckpt"), kw.pop("input"), **kw)
    if summary is not None:  # None: a process Lightning started beside process 0
        print(json.dumps(summary))


def probe(cfg: DictConfig) -> None:
    _require(cfg, "embeddings", "labels", example="embeddings=OUT.h5 labels=labels.csv")
    from .probe import format_result, run_probe
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    from .files import refuse_overlap, write_json
    kw = OmegaConf.to_container(cfg, resolve=True)
    output = kw.pop("output")
    embeddings = kw["embeddings"] if isinstance(kw["embeddings"], list) else [kw["embeddings"]]
    refuse_overlap({"output": output}, {"labels": kw["labels"], "test_labels": kw["test_labels"],
                                        **{f"embeddings[{i}]": e for i, e in enumerate(embeddings)}})
    result = run_probe(kw.pop("embeddings"), kw.pop("labels"), **kw)
    print(format_result(result))
    if output:
        write_json(output, result, indent=2)  # a results file that exists is whole
        print(f"results: {output}")
    else:
        print(json.dumps(result, indent=2))


def generate(cfg: DictConfig) -> None:
    from .generate import run
    run(ckpt=cfg.ckpt, output=cfg.output, num_samples=int(cfg.num_samples), max_length=int(cfg.max_length),
        min_length=int(cfg.min_length), temperature=float(cfg.temperature), top_k=int(cfg.top_k),
        top_p=float(cfg.top_p), prompt=None if cfg.prompt is None else str(cfg.prompt),
        seed=None if cfg.seed is None else int(cfg.seed),
        batch_size=None if cfg.batch_size is None else int(cfg.batch_size), device=cfg.device)


def compare(cfg: DictConfig) -> None:
    from .compare import compare as compare_kernels, flatten_overrides, perplexity_gaps
    from .evaluate import format_table
    overrides = flatten_overrides(OmegaConf.to_container(cfg.train, resolve=True))
    command = " ".join(a for a in sys.argv if not a.startswith("hydra.job.name="))
    doc = cfg.doc or Path(cfg.output_dir) / "comparison.md"  # tracked docs only when asked
    results = compare_kernels(list(cfg.models), overrides, cfg.heldout.path, cfg.output_dir, doc=doc,
                              reuse=cfg.reuse, command=command.strip(), exact_name=cfg.exact,
                              model_overrides={name: flatten_overrides(tree) for name, tree in
                                               OmegaConf.to_container(cfg.model_overrides, resolve=True).items()},
                              title=cfg.title, max_records=cfg.heldout.max_records,
                              **OmegaConf.to_container(cfg.eval, resolve=True))
    print(format_table(results))
    for name, gap in perplexity_gaps(results, cfg.exact).items():
        print(f"{name}: perplexity {100 * gap:+.2f} % against {cfg.exact}")
    print(f"wrote {doc}")


def export(cfg: DictConfig) -> None:
    from .hub.export import export as export_dir
    out = export_dir(cfg.ckpt, cfg.output, metrics=cfg.metrics, overwrite=bool(cfg.overwrite))
    print(f"wrote {out}: config.json, model.safetensors, vocab.txt, transformers code, README.md (model card)")


def score(cfg: DictConfig) -> None:
    _require(cfg, "ckpt", "input", "output", example="ckpt=CHECKPOINT input=assay.csv sequence=WILD_TYPE output=scored.csv")
    from .score import format_summary, score_files
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    kw = OmegaConf.to_container(cfg, resolve=True)
    print(format_summary(score_files(kw.pop("ckpt"), kw.pop("input"), kw.pop("output"), **kw)))


def convert_esm(cfg: DictConfig) -> None:
    _require(cfg, "input", "output", example="input=ESM_DIR_OR_PT output=DIR [model.attention.kernel=exact]")
    from .convert_esm import convert
    out = convert(cfg.input, cfg.output, overwrite=bool(cfg.overwrite),
                  attention=OmegaConf.to_container(cfg.model.attention, resolve=True))
    print(f"wrote {out}: config.json, model.safetensors, vocab.txt, transformers code, README.md "
          f"({cfg.model.attention.kernel} attention)")


def finetune(cfg: DictConfig) -> None:
    _require(cfg, "ckpt", "labels", "task", "output_dir",
             example="ckpt=CHECKPOINT labels=labels.csv task=classification output_dir=DIR")
    from .finetune import finetune as finetune_run, format_metrics
    logging.getLogger("protein_performer").setLevel(logging.INFO)
    kw = OmegaConf.to_container(cfg, resolve=True)
    result = finetune_run(kw.pop("ckpt"), kw.pop("labels"), kw.pop("task"), kw.pop("output_dir"), **kw)
    print(format_metrics(result))
    print(f"wrote {cfg.output_dir}: metrics.json, predictions.csv, model.safetensors, finetune.json")

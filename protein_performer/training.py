"""Build everything a training run needs from a composed Hydra config and run it.

The input is opened and checked before anything is written; the run folder then holds
``config.yaml`` and ``checkpoints/``: ``last.ckpt`` (the final step; a resume goes on
writing it) and ``best-<step>.ckpt`` (lowest validation loss, the final state's included,
so it exists even when training ends before the first validation).
"""
from __future__ import annotations

import logging
import math
import shutil
import zipfile
from pathlib import Path

import hydra
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.utilities import rank_zero_only

from .errors import UserError, first_line
from .quiet import quiet_libraries
from .run_folder import check_run_folder, remove_checkpoints
from .run_logging import Throughput, build_logger, is_wandb, log_checkpoints, run_config
from .tasks import ProteinLM

log = logging.getLogger(__name__)


def build_task(cfg: DictConfig, aa_frequencies: torch.Tensor | None) -> ProteinLM:
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model_cfg.pop("name", None)
    return ProteinLM(model=model_cfg, objective=cfg.objective.name,
                     aa_frequencies=None if aa_frequencies is None else aa_frequencies.tolist(),
                     **OmegaConf.to_container(cfg.optim, resolve=True))


def check_checkpoint(path: str) -> None:
    """Open a resume checkpoint before anything is written, so a wrong file is one line."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"ckpt_path={path}: is a directory, not a checkpoint file")
    if not p.is_file():
        raise FileNotFoundError(f"ckpt_path={path}: no such checkpoint file")
    if not zipfile.is_zipfile(p):
        raise UserError(f"ckpt_path={path}: not a checkpoint (not a file written by torch.save)")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=False, mmap=True)  # mmap: no full read
    except Exception as e:  # torch.load raises many types for a file that is not a checkpoint
        raise UserError(f"ckpt_path={path}: not a checkpoint ({first_line(e)})") from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "loops" not in ckpt:
        raise UserError(f"ckpt_path={path}: not a Lightning training checkpoint (no training state to resume)")


def choose_best(trainer: pl.Trainer, callback: ModelCheckpoint, val_loss: float | None) -> tuple[Path | None, bool]:
    """(the best checkpoint, whether it is the final state, still to be written). The final
    state is validated too: it becomes ``best-<step>.ckpt`` when no checkpoint scored during
    training (max_steps below the validation interval) or when it scores lower. The callback
    is told, so the last checkpoint carries it and a resume keeps one best file."""
    old = Path(callback.best_model_path) if callback.best_model_path else None
    old = old if old is not None and old.is_file() else None
    if val_loss is None or not math.isfinite(val_loss):
        return old, False
    if old is not None and callback.best_model_score is not None and float(callback.best_model_score) <= val_loss:
        return old, False
    best = Path(callback.dirpath) / f"best-{trainer.global_step}.ckpt"
    score = torch.tensor(val_loss)
    callback.best_model_path, callback.best_model_score = str(best), score
    callback.best_k_models = {str(best): score}
    callback.kth_best_model_path, callback.kth_value = str(best), score
    return best, best != old


def train(cfg: DictConfig, run_dir: str | Path) -> tuple[dict, ProteinLM]:
    """Train per ``cfg``; checkpoints in ``run_dir/checkpoints``. Returns the final
    validation metrics and the trained module."""
    quiet_libraries()
    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path:
        check_checkpoint(ckpt_path)
    check_run_folder(ckpt_dir, ckpt_path, bool(cfg.get("overwrite")))
    print(OmegaConf.to_yaml(cfg, resolve=True))
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("fit")  # reads and checks the input (no random numbers): nothing is written before it passed
    pl.seed_everything(cfg.seed, workers=True)
    torch.set_float32_matmul_precision("high")
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.get("overwrite") and rank_zero_only.rank == 0:
        remove_checkpoints(ckpt_dir)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    task = build_task(cfg, getattr(datamodule, "aa_frequencies", None))
    if cfg.get("compile"):  # in place: state_dict keys and checkpoints are unchanged
        task.model.compile(dynamic=True)
    n_params = sum(p.numel() for p in task.parameters())
    log.info("model: %s, %.2f M parameters", cfg.model.get("name", "?"), n_params / 1e6)

    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="best-{step}", monitor="val/loss", mode="min",
                                 save_top_k=1, save_last=True, auto_insert_metric_name=False,
                                 enable_version_counter=False)  # a resume overwrites last.ckpt, no last-v1
    callbacks = [checkpoint]
    logger = build_logger(cfg)
    if logger:
        callbacks += [LearningRateMonitor(logging_interval="step"), Throughput()]
        task._log_hyperparams = False  # Lightning would log the module's hparams only; the run gets all of it
        logger.log_hyperparams(run_config(cfg, task))
    trainer: pl.Trainer = hydra.utils.instantiate(cfg.trainer, default_root_dir=str(run_dir), logger=logger,
                                                  callbacks=callbacks)
    trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=False)
    results = trainer.validate(task, datamodule=datamodule, verbose=False)[0]
    summary = {k: float(v) for k, v in results.items()}
    old_best = checkpoint.best_model_path
    best, final_is_best = choose_best(trainer, checkpoint, summary.get("val/loss"))
    # max_steps can end between validations, when the callback saves nothing: keep the final step
    last = ckpt_dir / "last.ckpt"
    trainer.save_checkpoint(last, weights_only=False)
    if final_is_best and trainer.is_global_zero:
        shutil.copyfile(last, best)  # the final state: same weights and step as last.ckpt
        if old_best and Path(old_best).is_file() and Path(old_best) != best:
            Path(old_best).unlink()
    if trainer.is_global_zero:
        ppl, base = summary.get("val/perplexity", math.nan), summary.get("val/baseline_perplexity", math.nan)
        acc, base_acc = summary.get("val/accuracy", math.nan), summary.get("val/baseline_accuracy", math.nan)
        print(f"\nvalidation: perplexity {ppl:.3f} (amino-acid frequency baseline {base:.3f}), "
              f"accuracy {acc:.2%} (baseline {base_acc:.2%})")
        print(f"checkpoints: {ckpt_dir}")
    if is_wandb(logger):
        if cfg.logger.get("log_model") and trainer.is_global_zero:
            log_checkpoints(logger, [last] + ([best] if best is not None else []),
                            {"step": trainer.global_step, **summary})
        import wandb
        wandb.finish()
    return summary, task

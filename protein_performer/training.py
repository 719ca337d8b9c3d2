"""Build everything a training run needs from a composed Hydra config and run it."""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import hydra
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint

from .tasks import ProteinLM

log = logging.getLogger(__name__)


def build_task(cfg: DictConfig, aa_frequencies: torch.Tensor | None) -> ProteinLM:
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model_cfg.pop("name", None)
    return ProteinLM(model=model_cfg, objective=cfg.objective.name,
                     aa_frequencies=None if aa_frequencies is None else aa_frequencies.tolist(),
                     **OmegaConf.to_container(cfg.optim, resolve=True))


def build_logger(cfg: DictConfig):
    if not cfg.get("logger") or "_target_" not in cfg.logger:
        return False
    if "WandbLogger" in cfg.logger._target_:
        os.environ.setdefault("WANDB_SILENT", "true")
        if cfg.logger.get("offline", True):
            os.environ["WANDB_MODE"] = "offline"  # never a login prompt
    return hydra.utils.instantiate(cfg.logger)


def train(cfg: DictConfig, run_dir: str | Path) -> tuple[dict, ProteinLM]:
    """Train per ``cfg``; checkpoints in ``run_dir/checkpoints``. Returns the final
    validation metrics and the trained module."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    print(OmegaConf.to_yaml(cfg, resolve=True))
    pl.seed_everything(cfg.seed, workers=True)
    torch.set_float32_matmul_precision("high")

    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("fit")
    task = build_task(cfg, getattr(datamodule, "aa_frequencies", None))
    if cfg.get("compile"):  # in place: state_dict keys and checkpoints are unchanged
        task.model.compile(dynamic=True)
    n_params = sum(p.numel() for p in task.parameters())
    log.info("model: %s, %.2f M parameters", cfg.model.get("name", "?"), n_params / 1e6)

    ckpt_dir = run_dir / "checkpoints"
    callbacks = [
        ModelCheckpoint(dirpath=ckpt_dir, filename="best-{step}", monitor="val/loss", mode="min",
                        save_top_k=1, save_last=True, auto_insert_metric_name=False),
    ]
    logger = build_logger(cfg)
    if logger:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    trainer: pl.Trainer = hydra.utils.instantiate(cfg.trainer, default_root_dir=str(run_dir), logger=logger,
                                                  callbacks=callbacks)
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path and not os.path.isfile(ckpt_path):
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such checkpoint file")
    trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path)
    # max_steps can end between validations, when the callback saves nothing: keep the final step
    trainer.save_checkpoint(ckpt_dir / "last.ckpt")
    results = trainer.validate(task, datamodule=datamodule, verbose=False)[0]
    summary = {k: float(v) for k, v in results.items()}
    if trainer.is_global_zero:
        ppl, base = summary.get("val/perplexity", math.nan), summary.get("val/baseline_perplexity", math.nan)
        acc, base_acc = summary.get("val/accuracy", math.nan), summary.get("val/baseline_accuracy", math.nan)
        print(f"\nvalidation: perplexity {ppl:.3f} (amino-acid frequency baseline {base:.3f}), "
              f"accuracy {acc:.2%} (baseline {base_acc:.2%})")
        print(f"checkpoints: {ckpt_dir}")
    if logger and hasattr(logger, "experiment") and "Wandb" in type(logger).__name__:
        import wandb
        wandb.finish()
    return summary, task

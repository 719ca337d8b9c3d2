"""What a training run tells its experiment logger, so that runs can be compared: the
whole resolved config (data, trainer, objective and optimizer settings, not only the
module's hyperparameters), throughput and peak memory, and on request
(``logger.log_model=true``) the final checkpoints as a wandb model artifact, which an
offline run keeps until ``wandb sync`` uploads it."""
from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

import hydra
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf


def is_wandb(logger) -> bool:
    return type(logger).__name__ == "WandbLogger"


def build_logger(cfg: DictConfig):
    """The configured Lightning logger, or False. ``log_model`` is not passed to it: Lightning
    refuses it offline and would upload the callback's checkpoints, not the final ones."""
    if not cfg.get("logger") or "_target_" not in cfg.logger:
        return False
    kwargs = OmegaConf.to_container(cfg.logger, resolve=True)
    kwargs.pop("log_model", None)
    if "WandbLogger" in kwargs["_target_"]:
        os.environ.setdefault("WANDB_SILENT", "true")
        if kwargs.get("offline", True):  # never a login prompt; the argument too, as wandb reads
            os.environ["WANDB_MODE"] = "offline"  # the environment once per process
            kwargs["mode"] = "offline"
    logger = hydra.utils.instantiate(kwargs)
    init = getattr(logger, "_wandb_init", {})
    if init.get("anonymous", 0) is None:  # Lightning passes anonymous=None, which wandb warns about
        del init["anonymous"]
    return logger


def run_config(cfg: DictConfig, task: pl.LightningModule) -> dict:
    """The resolved config plus what the module adds (parameter count, tokenizer version, the
    amino-acid frequencies of the baseline, rounded: logs need no 17 digits)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    freqs = task.hparams.get("aa_frequencies")
    config["module"] = {"parameters": sum(p.numel() for p in task.parameters()),
                        "tokenizer_version": task.hparams.get("tokenizer_version"),
                        "aa_frequencies": None if freqs is None else [round(f, 5) for f in freqs]}
    return config


def log_checkpoints(logger, paths: list[Path], metadata: dict) -> None:
    """The final checkpoints as one wandb artifact ``model-<run id>`` (type ``model``)."""
    import wandb
    run = logger.experiment
    artifact = wandb.Artifact(f"model-{run.id}", type="model", metadata=metadata)
    for p in paths:
        artifact.add_file(str(p), name=Path(p).name)
    run.log_artifact(artifact, aliases=["latest"])


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (getrusage: kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


class Throughput(pl.Callback):
    """Every ``log_every_n_steps`` optimizer steps: ``perf/tokens_per_s`` (non-padding input
    tokens per second of training, validation excluded; rank 0's count times the world size),
    ``perf/peak_rss_mb`` (process peak so far) and, on CUDA, ``perf/peak_cuda_mb`` (peak
    allocated in the interval)."""

    def on_train_start(self, trainer, pl_module):
        self._restart(None)
        if self._cuda(trainer):
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def _restart(self, step: int | None) -> None:
        self.tokens, self.seconds, self.since, self.step = 0, 0.0, time.perf_counter(), step

    @staticmethod
    def _cuda(trainer) -> bool:
        return trainer.strategy.root_device.type == "cuda"

    @staticmethod
    def _inside_fit(trainer) -> bool:
        return trainer.state.fn == "fit" and not trainer.sanity_checking

    def on_validation_start(self, trainer, pl_module):
        if self._inside_fit(trainer):  # validation between training steps: stop the clock
            self.seconds += time.perf_counter() - self.since

    def on_validation_end(self, trainer, pl_module):
        if self._inside_fit(trainer):
            self.since = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tokens = self.tokens + (~batch["padding_mask"]).sum()
        # the step, and the cadence, Lightning gives its own metrics at this point (rows line up)
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        if step == self.step or (step + 1) % trainer.log_every_n_steps:
            return
        now = time.perf_counter()
        seconds = self.seconds + now - self.since
        metrics = {"perf/tokens_per_s": float(self.tokens) * trainer.world_size / max(seconds, 1e-9),
                   "perf/peak_rss_mb": peak_rss_mb()}
        if self._cuda(trainer):
            metrics["perf/peak_cuda_mb"] = torch.cuda.max_memory_allocated(trainer.strategy.root_device) / 2**20
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        self._restart(step)

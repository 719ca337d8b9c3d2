"""Build everything a training run needs from a composed Hydra config and run it.

The settings, the resume checkpoint and the input are checked before anything is written;
the run folder then holds ``config.yaml`` and ``checkpoints/``: ``last.ckpt`` (the final
step; a resume goes on writing it) and ``best-<step>.ckpt`` (lowest validation loss, the
final state's included, so it exists even when training ends before the first validation).
Checkpoints are written beside and renamed (a kill leaves the previous one whole), recorded
in the run folder's journal, and only recorded ones are ever deleted (see run_folder).
A checkpoint is opened with ``weights_only=True``: tensors and plain data, never code.
"""
from __future__ import annotations

import logging
import math
import pickle
import shutil
import zipfile
from pathlib import Path

import hydra
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.utilities import rank_zero_only

from ..allocator import keep_freed_memory
from ..attention.feature_maps import REGISTRY
from ..attention.fla_backend import GATED_KERNELS, check_backend, training_device
from ..errors import UserError, first_line
from ..files import atomic_path
from ..model import ModelConfig
from ..model.config import migrate
from ..model import PerformerLM
from ..objectives import check_objective
from ..sequences import check_max_records
from ..tokenizer import Tokenizer
from .progress import EVERY, SECONDS, check_progress, lightning_progress
from .quiet import quiet_libraries
from .run_folder import check_own_files, check_run_folder, guard_run_folder, journal, replacing_run, run_inputs
from .run_logging import Throughput, build_logger, is_wandb, log_checkpoints, run_config
from .memory import check_memory
from .distill import (Distiller, check_architecture, data_to_model_ids, load_start, remap_frequencies,
                      student_config)
from .optimizers import OPTIMIZERS
from .compiled import check_compile_mode, compile_task, plan_compile, record_buckets, use_compile
from .task import ProteinLM, load_checkpoint

log = logging.getLogger(__name__)


def build_task(cfg: DictConfig, aa_frequencies: torch.Tensor | None, start: PerformerLM | None = None) -> ProteinLM:
    """The task of ``cfg``; with ``start`` (init_from's model), its architecture and weights under
    ``model.attention``'s kernel."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model_cfg.pop("name", None)
    model_cfg.setdefault("attention", {}).setdefault("run_seed", int(cfg.seed or 0))  # seed-dependent projections
    where = f"init_from={cfg.get('init_from')}"
    if start is not None:
        model_cfg = student_config(start, model_cfg["attention"], cfg.objective.name == "clm", where)
    freqs = None if aa_frequencies is None else aa_frequencies.tolist()
    if freqs is not None:  # data ids -> the model's vocabulary's
        vocab = Tokenizer(vocabulary=model_cfg.get("vocabulary", Tokenizer().vocabulary))
        freqs = remap_frequencies(freqs, data_to_model_ids(vocab.vocabulary), vocab.vocab_size)
    task = ProteinLM(model=model_cfg, objective=cfg.objective.name, aa_frequencies=freqs,
                     **OmegaConf.to_container(cfg.optim, resolve=True))
    if start is not None:
        load_start(task.model, start, where)
    return task


def record_start_architecture(cfg: DictConfig, start: PerformerLM) -> None:
    """init_from's architecture into ``cfg.model`` (the keys the config has), so that the printed config and
    the run folder's config.yaml describe the model that trains, not the composed defaults it replaced."""
    effective = student_config(start, {}, start.config.causal, f"init_from={cfg.get('init_from')}")
    for key, value in effective.items():
        if key != "attention" and key in cfg.model:
            OmegaConf.update(cfg, f"model.{key}", value)


def open_checkpoint_model(path: str) -> PerformerLM:
    """init_from / distill.teacher when train() is not given an opener: a training checkpoint only
    (the train command opens exported and convert-esm directories too, through the hub)."""
    if Path(path).is_dir():
        raise UserError(f"{path}: a directory; run through `protein-performer train` (or scripts/train.py) "
                        f"to start from an exported or converted directory")
    return load_checkpoint(path).model


def open_start(cfg: DictConfig, open_model) -> tuple[PerformerLM | None, Distiller | None]:
    """init_from's model and the distillation teacher, opened (and checked) before anything is written."""
    init_from, d = cfg.get("init_from"), cfg.get("distill") or {}
    start = open_model(str(init_from)) if init_from else None
    distiller = None
    if d.get("teacher"):
        where = str(d["teacher"])
        distiller = Distiller(open_model(where), d.get("weight", 1.0), d.get("attention_weight", 0.0), where)
    return start, distiller


def check_checkpoint(path: str) -> dict:
    """Open a resume checkpoint before anything is written, so a wrong file is one line; returns its
    hyperparameters (what :func:`check_resumed_model` compares)."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"ckpt_path={path}: is a directory, not a checkpoint file")
    if not p.is_file():
        raise FileNotFoundError(f"ckpt_path={path}: no such checkpoint file")
    if not zipfile.is_zipfile(p):
        raise UserError(f"ckpt_path={path}: not a checkpoint (not a file written by torch.save)")
    try:  # weights_only: a pickle that would run code is refused; mmap: no full read
        ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"ckpt_path={path}: refused: it holds Python objects other than tensors and plain data "
                        f"(loading it could run code); a training checkpoint holds none") from e
    except Exception as e:  # torch.load raises many types for a file that is not a checkpoint
        raise UserError(f"ckpt_path={path}: not a checkpoint ({first_line(e)})") from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "loops" not in ckpt:
        raise UserError(f"ckpt_path={path}: not a Lightning training checkpoint (no training state to resume)")
    return dict(ckpt.get("hyper_parameters") or {})


def check_resumed_model(path: str, hparams: dict, task: ProteinLM) -> None:
    """A resume continues the checkpoint's model: settings the weights do not show (the rotary base,
    a default that changed) must be the checkpoint's, else one line naming the first that differs."""
    if not isinstance(hparams.get("model"), dict):
        return  # written by hand without hyperparameters: nothing to compare
    old = ModelConfig.from_dict(migrate(hparams["model"], f"ckpt_path={path}"), vocab_size=task.model.config.vocab_size,
                                causal=task.model.config.causal).to_dict()
    new = task.model.config.to_dict()
    flat = lambda d: {**{k: v for k, v in d.items() if k != "attention"},  # noqa: E731
                      **{f"attention.{k}": v for k, v in d["attention"].items()}}
    old, new = flat(old), flat(new)
    for key in [k for k in new if k != "attention.chunk_size"]:  # how the causal path runs, not what it computes
        if old.get(key) != new[key]:
            raise UserError(f"ckpt_path={path}: its model has model.{key}={old.get(key)!r}, this run's config "
                            f"model.{key}={new[key]!r}; resume with the checkpoint's settings (model.{key}={old.get(key)!r})")


def check_resumed_objective(path: str, hparams: dict, objective: str) -> None:
    """A resume continues the checkpoint's objective: ``objective=clm ckpt_path=<an mlm checkpoint>``
    is one line naming both, before anything is written."""
    theirs = hparams.get("objective")
    if isinstance(theirs, str) and theirs != objective:
        raise UserError(f"ckpt_path={path}: a checkpoint of objective={theirs}, but this run's objective is "
                        f"{objective}; resume with objective={theirs} (a {objective} model is another run)")


MALLOC_CHOICES = ("keep", "system")  # the malloc key: protein_performer.allocator


def check_settings(cfg: DictConfig) -> None:
    """The model, objective and optimiser settings, before the input is read or a file written."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    ModelConfig.from_dict(model_cfg, causal=cfg.objective.name == "clm")
    attention = model_cfg.get("attention") or {}
    kernel = attention.get("kernel", "softmax")
    refusal = REGISTRY[kernel].training_refusal
    if refusal:
        raise UserError(refusal)
    backend = attention.get("backend", "auto")
    if kernel == "exact" and backend != "auto":  # would be recorded as what ran, though SDPA ran
        raise UserError(f"model.attention.backend={backend}: exact attention (model.attention.kernel=exact) runs no "
                        f"linear-attention backend; leave model.attention.backend=auto")
    if kernel != "exact":  # backend=fla where it cannot run: one line now, not a crash in the first backward
        check_backend(backend, training_device((cfg.get("trainer") or {}).get("accelerator")),
                      causal=cfg.objective.name == "clm", gated=kernel in GATED_KERNELS)
    check_objective(cfg.objective.name)
    check_max_records((cfg.get("data") or {}).get("max_records"))
    if cfg.get("init_from") and cfg.get("ckpt_path"):
        raise UserError(f"init_from={cfg.init_from} with ckpt_path={cfg.ckpt_path}: a resume continues its checkpoint "
                        f"(weights, optimiser, step); init_from starts a new run from other weights: give one of them")
    o = cfg.optim
    if not (isinstance(o.lr, (int, float)) and o.lr > 0):
        raise UserError(f"optim.lr must be a positive number, got {o.lr!r}")
    if not (isinstance(o.warmup_steps, int) and o.warmup_steps >= 0):
        raise UserError(f"optim.warmup_steps must be a non-negative integer, got {o.warmup_steps!r}")
    if not (isinstance(o.min_lr_ratio, (int, float)) and 0 <= o.min_lr_ratio <= 1):
        raise UserError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio!r}")
    if o.get("optimizer", "adamw") not in OPTIMIZERS or o.get("schedule", "cosine") not in ("cosine", "wsd"):
        raise UserError(f"optim.optimizer={o.get('optimizer')!r}, optim.schedule={o.get('schedule')!r}: choose "
                        f"{' | '.join(OPTIMIZERS)} and cosine | wsd")
    check_progress(cfg.get("progress_every", EVERY), cfg.get("progress_seconds", SECONDS))
    use_compile(cfg.get("compile", "auto"), "cpu")
    check_compile_mode(cfg.get("compile_mode", "default"))
    if cfg.get("malloc", "keep") not in MALLOC_CHOICES:
        raise UserError(f"malloc={cfg.get('malloc')!r}; choose from {' | '.join(MALLOC_CHOICES)}")


class RecordedCheckpoint(ModelCheckpoint):
    """Lightning's callback, writing each checkpoint beside and renaming it, recording it in
    the run folder's journal first, and deleting only the ones recorded there."""

    def __init__(self, written, **kw):
        super().__init__(**kw)
        self.written = written

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if not trainer.is_global_zero:
            return super()._save_checkpoint(trainer, filepath)
        save_whole(self.written, filepath, lambda tmp: super(RecordedCheckpoint, self)._save_checkpoint(trainer, tmp))
        self._last_checkpoint_saved = filepath

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if not trainer.is_global_zero or filepath in self.written:
            super()._remove_checkpoint(trainer, filepath)
            if trainer.is_global_zero:
                self.written.forget(filepath)


def save_whole(written, path: str | Path, save) -> None:
    """Record ``path``, then ``save(tmp)`` beside it and rename: a kill leaves the old file whole
    (and a recorded temporary file, which the next run in the folder removes)."""
    written.record(path)
    with atomic_path(path) as tmp:
        written.record(tmp)
        save(str(tmp))
    written.forget(tmp)


def remove_stale_temporaries(written) -> None:
    """Temporary files a killed run recorded (``save_whole``) and left behind, and the journal's
    own (rank zero only: a pid means nothing on another node)."""
    written.remove_dead_temporaries()
    for key in list(written.paths):
        p = written.path_of(key)
        if p.name.startswith(".") and p.name.endswith(".tmp"):
            written.remove(p)


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


def save_final(trainer: pl.Trainer, checkpoint, written, ckpt_dir: Path, summary: dict) -> tuple[Path, Path | None]:
    """last.ckpt (max_steps can end between validations, when the callback saves nothing: the final step
    is kept), and best-*.ckpt when the final state is the best: (last, best)."""
    old_best = checkpoint.best_model_path
    best, final_is_best = choose_best(trainer, checkpoint, summary.get("val/loss"))
    last = ckpt_dir / "last.ckpt"
    if trainer.is_global_zero:
        save_whole(written, last, lambda tmp: trainer.save_checkpoint(tmp, weights_only=False))
    else:
        trainer.save_checkpoint(last, weights_only=False)
    if final_is_best and trainer.is_global_zero:
        save_whole(written, best, lambda tmp: shutil.copyfile(last, tmp))  # the final state, as last.ckpt
        # only this folder's own old best: a resume from another run's folder never deletes its files
        if old_best and Path(old_best) != best and Path(old_best).parent.resolve() == ckpt_dir.resolve():
            written.remove(old_best)
    return last, best


def print_summary(summary: dict, ckpt_dir: Path) -> None:
    ppl, base = summary.get("val/perplexity", math.nan), summary.get("val/baseline_perplexity", math.nan)
    acc, base_acc = summary.get("val/accuracy", math.nan), summary.get("val/baseline_accuracy", math.nan)
    print(f"\nvalidation: perplexity {ppl:.3f} (amino-acid frequency baseline {base:.3f}), "
          f"accuracy {acc:.2%} (baseline {base_acc:.2%})")
    print(f"checkpoints: {ckpt_dir}")


def train(cfg: DictConfig, run_dir: str | Path, open_model=open_checkpoint_model,
          overrides: list[str] | None = None) -> tuple[dict, ProteinLM]:
    """Train per ``cfg``; checkpoints in ``run_dir/checkpoints``. Returns the final
    validation metrics and the trained module. ``open_model``: path -> PerformerLM, for
    ``init_from`` and ``distill.teacher``. ``overrides``: the command line's (Hydra's task
    overrides): architecture keys it sets must agree with ``init_from``'s model."""
    quiet_libraries()
    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    ckpt_path = cfg.get("ckpt_path")
    overwrite = bool(cfg.get("overwrite"))
    zero = rank_zero_only.rank == 0
    check_settings(cfg)
    resumed = check_checkpoint(ckpt_path) if ckpt_path else None
    if resumed is not None:
        check_resumed_objective(ckpt_path, resumed, cfg.objective.name)
    start, distiller = open_start(cfg, open_model)
    if start is not None:
        check_architecture(start, OmegaConf.to_container(cfg.model, resolve=True), list(overrides or []),
                           f"init_from={cfg.init_from}")
        record_start_architecture(cfg, start)
    check_memory(OmegaConf.to_container(cfg.model, resolve=True), OmegaConf.to_container(cfg.data, resolve=True),
                 cfg.objective.name == "clm", training_device((cfg.get("trainer") or {}).get("accelerator")))
    if zero:  # DDP re-launches this for the other ranks once rank zero trains (and set old checkpoints aside)
        check_run_folder(ckpt_dir, ckpt_path, overwrite)
        check_own_files(run_dir, ("config.yaml",))
        guard_run_folder(run_dir, run_inputs(cfg), overwrite)  # the output guard (compare calls train directly)
    compile_device = plan_compile(cfg, training_device(cfg.trainer.get("accelerator")))
    datamodule = hydra.utils.instantiate(cfg.data)  # checks the data settings
    print(OmegaConf.to_yaml(cfg, resolve=True))
    datamodule.setup("fit")  # reads and checks the input (no random numbers): nothing is written before it passed
    record_buckets(cfg, datamodule)
    if cfg.get("malloc", "keep") == "keep":
        keep_freed_memory()  # large activations reused from step to step instead of page-faulted in again
    pl.seed_everything(cfg.seed, workers=True)
    torch.set_float32_matmul_precision("high")
    task = build_task(cfg, getattr(datamodule, "aa_frequencies", None), start)
    if resumed is not None:
        check_resumed_model(ckpt_path, resumed, task)
    task.set_distiller(distiller)
    written = journal(run_dir)
    if zero:
        remove_stale_temporaries(written)
    if compile_device is not None:  # in place: state_dict keys and checkpoints are unchanged
        compile_task(task, compile_device, cfg.get("compile_mode", "default"), getattr(datamodule, "buckets", None))
    n_params = sum(p.numel() for p in task.parameters())
    log.info("model: %s, %.2f M parameters", cfg.model.get("name", "?"), n_params / 1e6)

    checkpoint = RecordedCheckpoint(written, dirpath=ckpt_dir, filename="best-{step}", monitor="val/loss", mode="min",
                                 save_top_k=1, save_last=True, auto_insert_metric_name=False,
                                 enable_version_counter=False)  # a resume overwrites last.ckpt, no last-v1
    callbacks = [checkpoint]
    logger = build_logger(cfg)
    if logger:
        callbacks += [LearningRateMonitor(logging_interval="step"), Throughput()]
        task._log_hyperparams = False  # Lightning would log the module's hparams only; the run gets all of it
        logger.log_hyperparams(run_config(cfg, task))
    # Lightning's bar on a terminal; in a log (stdout not a terminal) a plain line every
    # progress_every steps or progress_seconds seconds instead of its carriage returns
    bar, progress = lightning_progress(cfg.trainer.get("enable_progress_bar", True), "train",
                                       every=cfg.get("progress_every", EVERY), seconds=cfg.get("progress_seconds", SECONDS))
    trainer: pl.Trainer = hydra.utils.instantiate(cfg.trainer, default_root_dir=str(run_dir), logger=logger,
                                                  callbacks=callbacks + progress, enable_progress_bar=bar)
    with replacing_run(run_dir, written, overwrite and zero):
        if zero:
            written.record(run_dir / "config.yaml")
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        results = trainer.validate(task, datamodule=datamodule, verbose=False)[0]
        summary = {k: float(v) for k, v in results.items()}
        last, best = save_final(trainer, checkpoint, written, ckpt_dir, summary)
    if trainer.is_global_zero:
        print_summary(summary, ckpt_dir)
    if is_wandb(logger):
        if cfg.logger.get("log_model") and trainer.is_global_zero:
            log_checkpoints(logger, [last] + ([best] if best is not None else []),
                            {"step": trainer.global_step, **summary})
        import wandb
        wandb.finish()
    return summary, task

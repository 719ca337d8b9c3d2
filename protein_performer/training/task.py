"""LightningModule for masked-LM and autoregressive training of :class:`PerformerLM`.

A checkpoint of this module carries everything needed to use it later: the model
config (hyperparameters), the tokenizer version, the feature-map projections (buffers)
and the training set's amino-acid frequencies (the unigram baseline).
"""
from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Timer
from torchmetrics import SumMetric

from ..attention.layer import count_forwards
from ..model import ModelConfig, PerformerLM
from ..model.config import migrate
from ..objectives import IGNORE, SUMS, Scores, check_objective, score_rows
from ..tokenizer import VERSION, Tokenizer
from ..errors import UserError, first_line
from .distill import Distiller, data_to_model_ids
from .optimizers import build_optimizer


class ProteinLM(pl.LightningModule):
    def __init__(self, model: dict, objective: str = "mlm", lr: float = 1e-3, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.98), warmup_steps: int = 200, min_lr_ratio: float = 0.1,
                 aa_frequencies: list[float] | None = None, tokenizer_version: int = VERSION,
                 optimizer: str = "adamw", schedule: str = "cosine", decay_fraction: float = 0.2):
        super().__init__()
        check_objective(objective)
        if tokenizer_version != VERSION:
            raise UserError(f"checkpoint uses tokenizer version {tokenizer_version}, this code has {VERSION}")
        # the model's vocabulary (a model converted from ESM reads ESM's ids); the data pipeline writes
        # protein-performer's ids, mapped to the model's in every step (data_ids; None: the same)
        self.tokenizer = Tokenizer(vocabulary=(model or {}).get("vocabulary", Tokenizer().vocabulary))
        config = ModelConfig.from_dict(model, vocab_size=self.tokenizer.vocab_size, causal=objective == "clm")
        # saved whole, with its config_version: a later version whose defaults differ reads it as it was
        # (load_checkpoint migrates checkpoints written before the version key)
        model = config.to_dict()
        model["attention"]["backend"] = config.attention.backend  # how this run runs it (a loaded one: auto)
        self.save_hyperparameters()
        self.model = PerformerLM(config)
        self.register_buffer("data_ids", data_to_model_ids(self.tokenizer.vocabulary), persistent=False)
        self.distiller: Distiller | None = None  # a frozen teacher (not a submodule: not in checkpoints)
        # float64 sums: token counts pass 2^24 long before TrEMBL-sized validation sets end
        self.val_sums = torch.nn.ModuleDict({k: SumMetric().set_dtype(torch.float64) for k in SUMS})

    @property
    def aa_frequencies(self) -> torch.Tensor | None:
        f = self.hparams.aa_frequencies
        return None if f is None else torch.tensor(f, dtype=torch.float64)

    def setup(self, stage: str) -> None:
        """data.max_len is a crop and model.max_positions a position limit: with learned
        positions the first must fit in the second, checked before any step runs."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None or self.model.pos_embed is None:
            return
        concat = getattr(dm, "mode", "crop") == "concat"
        key, longest = ("data.concat_len", getattr(dm, "concat_len", None)) if concat else ("data.max_len", getattr(dm, "max_len", None))
        if longest is not None and longest - int(self.model.causal) > self.model.max_positions:
            raise UserError(f"{key}={longest} is longer than the model's learned positions "
                            f"(model.max_positions={self.model.max_positions}): raise model.max_positions, "
                            f"lower {key}, or use model.position=rotary")

    #: True once training/compiled.py compiled the model: the redraw schedule is then counted here,
    #: between steps, not inside the graph
    compiled = False

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.compiled:
            count_forwards(self.model)

    def forward(self, inputs: torch.Tensor, padding_mask: torch.Tensor | None = None, **kw):
        return self.model(inputs, padding_mask, **kw)

    def set_distiller(self, distiller: Distiller | None) -> None:
        """Train with ``distiller``'s terms added to the loss (None: the objective alone)."""
        if distiller is not None:
            distiller.check(self.model)
        self.distiller = distiller

    def model_ids(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's inputs and labels in the model's vocabulary."""
        inputs, labels = batch["inputs"], batch["labels"]
        if self.data_ids is None:
            return inputs, labels
        return self.data_ids[inputs], torch.where(labels == IGNORE, labels, self.data_ids[labels.clamp(min=0)])

    def training_step(self, batch, batch_idx):
        inputs, labels = self.model_ids(batch)
        if self.distiller is None:
            logits = self(inputs, batch["padding_mask"])
        else:
            logits, terms = self.distiller.loss(self.model, inputs, batch["padding_mask"], labels)
        objective = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
        loss = objective if self.distiller is None else objective + terms["loss"]
        if self.distiller is not None:
            self.log("train/objective_loss", objective.detach())
            self.log("train/distill_kl", terms["kl"].detach())
            self.log("train/distill_attention", terms["attention"].detach())
        scored = labels != IGNORE
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/perplexity", torch.exp(objective.detach()))
        self.log("train/accuracy", ((logits.argmax(-1) == labels) & scored).sum() / scored.sum().clamp(min=1))
        self.log("train/tokens", scored.sum().float(), reduce_fx="sum")
        return loss

    def validation_step(self, batch, batch_idx):
        # the batch holds each protein as evaluate.py scores it (Collator with fixed_seed)
        freqs = self.aa_frequencies
        inputs, labels = self.model_ids(batch)
        rows = score_rows(self(inputs, batch["padding_mask"]), labels, freqs)
        for k, v in rows.items():
            self.val_sums[k].update(v.sum())

    def on_validation_epoch_end(self):
        sums = {k: float(m.compute()) for k, m in self.val_sums.items()}
        for m in self.val_sums.values():
            m.reset()
        baseline = self.aa_frequencies is not None
        m = Scores(**sums).metrics(baseline)
        if m["loss"] is None:
            return
        for k in ("loss", "perplexity", "accuracy"):
            self.log(f"val/{k}", m[k], prog_bar=True)
        if baseline:
            self.log("val/baseline_perplexity", m["baseline_perplexity"])
            self.log("val/baseline_accuracy", m["baseline_accuracy"])

    def optimizer(self) -> torch.optim.Optimizer:
        """optim.optimizer over the hidden weight matrices (weight decay) and the rest (none), at the peak rate:
        what training steps with (the schedule aside), and what step timing (step_cost.py) should time."""
        hp = self.hparams
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (no_decay if p.ndim < 2 or "norm" in name or "embed" in name else decay).append(p)
        return build_optimizer(hp.get("optimizer", "adamw"), decay, no_decay, hp.lr, hp.betas, hp.weight_decay)

    def configure_optimizers(self):
        hp, opt = self.hparams, self.optimizer()
        total = self.trainer.estimated_stepping_batches if self.trainer else 10**9
        # a time-budgeted run (trainer.max_time, no step limit) decays along the clock instead
        timer = None if math.isfinite(total) else next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)

        def progress(step: int) -> float:
            if timer is None:  # (no limit at all: no decay)
                return (step - hp.warmup_steps) / max(int(total) - hp.warmup_steps, 1) if math.isfinite(total) else 0.0
            elapsed = timer.time_elapsed("train")
            return elapsed / max(elapsed + timer.time_remaining("train"), 1e-9)

        wsd, tail = hp.get("schedule", "cosine") == "wsd", hp.get("decay_fraction", 0.2)

        def schedule(step: int) -> float:  # linear warm-up, then cosine decay to min_lr_ratio, or (wsd)
            if step < hp.warmup_steps:     # stable until the last decay_fraction, linear to min_lr_ratio there
                return (step + 1) / hp.warmup_steps
            t = min(progress(step), 1.0)
            if wsd:
                return 1.0 - (1 - hp.min_lr_ratio) * max(0.0, t - (1 - tail)) / max(tail, 1e-9)
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def load_checkpoint(path: str, map_location="cpu") -> ProteinLM:
    """Load a trained ProteinLM in eval mode, with a one-line error for a missing or bad file."""
    import os
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path}: no such file")
    try:
        # weights_only: tensors and plain types only, never a pickled object's code (even if the
        # environment sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD)
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("hyper_parameters") or {}
        model = saved.get("model")  # its keys as the version that wrote it meant them (model.config.migrate)
        module = ProteinLM.load_from_checkpoint(path, map_location=map_location, weights_only=True,
                                                **({"model": migrate(model, f"checkpoint {path}")}
                                                   if isinstance(model, dict) else {}))
    except Exception as e:  # torch.load raises many types for a file that is not a checkpoint
        raise UserError(f"checkpoint {path}: cannot load ({first_line(e)})") from e
    for m in module.modules():  # the backend a run used (fla, on its GPU) is how it ran, not what the
        if hasattr(m, "backend") and hasattr(m, "_resolved"):  # model is: here, the device decides again
            m.backend, m._resolved = "auto", None
    return module.eval()


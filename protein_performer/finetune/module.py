"""The LightningModule of fine-tuning (as :class:`~protein_performer.training.task.ProteinLM` is
pretraining's): the loss, the optimizer and its schedule, and the best validated weights."""
from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model.heads import FineTuneNet
from ..objectives import IGNORE
from .confidence import Validated, bootstrap_confidence
from .schedule import selection_metric, warmup_linear


def _state(net: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors only: the attention layers' ``_extra_state`` (redraw counters) is not a weight."""
    return {k: v for k, v in net.state_dict().items() if isinstance(v, torch.Tensor)}


def snapshot(net: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights now (training goes on changing the net's own)."""
    return {k: v.detach().clone() for k, v in _state(net).items()}


def interpolate(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor], share: float) -> dict[str, torch.Tensor]:
    """Weight-space interpolation (WiSE-FT, Wortsman et al. 2022): ``share`` of ``end`` and the rest of
    ``start`` for each floating-point tensor; other tensors (counters) are ``end``'s."""
    return {k: torch.lerp(start[k], v, share) if v.is_floating_point() else v for k, v in end.items()}


def encoder_groups(encoder: nn.Module, lr: float, decay: float = 1.0) -> list[tuple[list, float]]:
    """The encoder's trainable parameters as (parameters, rate) groups: layer-wise rate decay (ELECTRA,
    BEiT): the final norm and the last block at ``lr``, each block below it ``decay`` times the one
    above, the embeddings ``decay`` times the first block.  decay = 1: one group at ``lr``."""
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad] if m is not None else []  # noqa: E731
    if decay == 1.0:
        layers = [trainable(encoder)]
    else:
        top = trainable(encoder.norm) + (trainable(encoder.blocks[-1]) if len(encoder.blocks) else [])
        below = [trainable(b) for b in reversed(encoder.blocks[:-1])]
        layers = [top, *below, trainable(encoder.embed) + trainable(encoder.pos_embed)]
    return [(params, lr * decay ** i) for i, params in enumerate(layers) if params]


class FineTuner(pl.LightningModule):
    """Loss, optimizer, and the best validated weights (kept in memory, put back at the end): every
    validation is a candidate (``stage``: "probe" for the probed head before training, then each
    epoch, then the interpolations validated after training), ranked by ``select_by`` on the
    validation split (ties: the lower loss, then the earlier).  The probe's validation outputs and the
    best candidate's are kept for :meth:`confidence_over_probe`, and :meth:`keep_probe` puts the probe
    back when the best fine-tuned candidate's lead is not sure enough.

    ``lr``: the encoder's rate (or its LoRA adapters'), ``head_lr`` the head's; ``scale``: the
    regression target's (mean, std), the head trained on standardized values; ``schedule``:
    ``constant`` or ``linear`` (:func:`~.schedule.warmup_linear` over ``warmup`` of the steps,
    ``seconds``: trainer.max_time); ``layer_decay``: :func:`encoder_groups`."""

    def __init__(self, net: FineTuneNet, lr: float, head_lr: float, weight_decay: float,
                 scale: tuple[float, float], schedule: str = "constant", warmup: float = 0.0,
                 seconds: float | None = None, select_by: str = "loss", layer_decay: float = 1.0):
        super().__init__()
        self.layer_decay = layer_decay
        self.net, self.best, self.best_loss, self._val = net, None, math.inf, []
        self.lr, self.head_lr, self.weight_decay, self.scale = lr, head_lr, weight_decay, scale
        self.schedule, self.warmup, self.seconds, self.select_by = schedule, warmup, seconds, select_by
        self.best_epoch = None  # 0 = the start (validated before training), n = after epoch n (or its interpolation)
        self.best_name, self.best_key, self.stage, self.candidates = None, None, "start", []
        self.stage_epoch = 0  # the epoch a candidate validated outside fit comes from (0: the start)
        self.probe_val = self.best_val = None  # Validated: the probe's outputs, the best candidate's
        # the best fine-tuned candidate's weights and name even where the probe ranks above it (the ensemble's member)
        self.best_tuned = self.best_tuned_name = self.best_tuned_key = self.best_tuned_epoch = None
        self.best_tuned_val = self.best_tuned_loss = None  # its validation outputs and loss (the mix's rival)
        self.keep_next = False  # the next candidate is kept whatever its rank (the ensemble: a fixed rule)
        self._seen = 0  # validation proteins so far in this pass (each row's protein index)

    def loss_of(self, out, y) -> tuple[torch.Tensor, int]:
        if self.net.task == "regression":
            return F.mse_loss(out.squeeze(-1), (y - self.scale[0]) / self.scale[1]), len(y)
        if self.net.task == "residue":
            return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=IGNORE), int((y != IGNORE).sum())
        return F.cross_entropy(out, y), len(y)

    def training_step(self, batch, batch_idx):
        loss, n = self.loss_of(self.net(batch["tokens"], batch["padding_mask"]).float(), batch["targets"])
        self.log("train/loss", loss, batch_size=n, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        out, y = self.net(batch["tokens"], batch["padding_mask"]).float(), batch["targets"]
        loss, n = self.loss_of(out, y)
        protein = torch.arange(self._seen, self._seen + len(y))
        self._seen += len(y)
        if self.net.task == "residue":
            keep = y != IGNORE
            out, y, protein = out[keep], y[keep], protein[:, None].expand(keep.shape)[keep.cpu()]
        self._val.append((float(loss) * n, n, out.detach().cpu(), y.detach().cpu(), protein))

    def on_validation_epoch_end(self):
        val, self._val, self._seen = self._val, [], 0
        loss = sum(v[0] for v in val) / max(sum(v[1] for v in val), 1)
        self.log("val/loss", loss, prog_bar=True)
        metric, outputs = None, Validated(*(torch.cat([v[i] for v in val]) for i in (2, 3)),
                                          torch.cat([v[4] for v in val]).numpy()) if val else None
        if self.select_by != "loss" and val:
            metric = selection_metric(self.net.task, self.select_by, outputs.outputs, outputs.targets)
            self.log(f"val/{self.select_by}", metric)
        if self.trainer.sanity_checking:
            return
        self.candidate(loss, metric, outputs)

    def candidate(self, loss: float, metric: float | None, outputs: Validated | None = None) -> None:
        """This validation as a candidate for the kept weights; kept when it ranks above the best so far."""
        fitting = self.trainer.state.fn == "fit"
        name = f"epoch {self.trainer.current_epoch + 1}" if fitting else self.stage
        self.candidates.append({"name": name, "loss": loss, **({self.select_by: metric} if metric is not None else {})})
        if name == "probe":
            self.probe_val = outputs
        key = (-loss,) if metric is None else (-math.inf if math.isnan(metric) else metric, -loss)
        weights, epoch = None, self.trainer.current_epoch + 1 if fitting else self.stage_epoch
        if name != "probe" and (self.best_tuned_key is None or key > self.best_tuned_key):
            weights = snapshot(self.net)
            self.best_tuned, self.best_tuned_name, self.best_tuned_key, self.best_tuned_epoch = weights, name, key, epoch
            self.best_tuned_val, self.best_tuned_loss = outputs, loss
        if self.keep_next or self.best_key is None or key > self.best_key:
            self.best_key, self.best_loss, self.best_name, self.best_val = key, loss, name, outputs
            self.best = snapshot(self.net) if weights is None else weights
            self.best_epoch, self.keep_next = epoch, False

    def confidence_over_probe(self, seed: int) -> float | None:
        """:func:`~.confidence.bootstrap_confidence` of the best candidate over the probe; None when there
        is nothing to weigh (no probe, the probe is best, or candidates ranked by the loss)."""
        if self.select_by == "loss" or self.probe_val is None or self.best_name in (None, "probe"):
            return None
        return bootstrap_confidence(self.net.task, self.select_by, self.probe_val, self.best_val, seed)

    def tuned_record(self) -> tuple:
        """The best fine-tuned candidate so far (weights, name, loss, key, validation outputs, epoch), to keep
        it later (:meth:`keep_record`) whatever is validated in between."""
        return (self.best_tuned, self.best_tuned_name, self.best_tuned_loss, self.best_tuned_key,
                self.best_tuned_val, self.best_tuned_epoch)

    def keep_record(self, record: tuple) -> None:
        """A candidate of :meth:`tuned_record` kept."""
        self.best, self.best_name, self.best_loss, self.best_key, self.best_val, self.best_epoch = record

    def keep_probe(self, weights: dict[str, torch.Tensor]) -> None:
        """The probe's candidate (its ``weights``: a :func:`snapshot` taken when it was validated) kept."""
        probe = next(c for c in self.candidates if c["name"] == "probe")
        self.best, self.best_name, self.best_loss, self.best_epoch = weights, "probe", probe["loss"], 0
        self.best_key, self.best_val = (probe.get(self.select_by, -probe["loss"]), -probe["loss"]), self.probe_val

    def configure_optimizers(self):
        groups = [{"params": list(self.net.head.parameters()), "lr": self.head_lr}] + [
            {"params": params, "lr": lr} for params, lr in encoder_groups(self.net.encoder, self.lr, self.layer_decay)]
        opt = torch.optim.AdamW(groups, weight_decay=self.weight_decay)
        if self.schedule == "constant":
            return opt
        # max_epochs (or max_steps) of batches; inf: max_time alone
        total = float(self.trainer.estimated_stepping_batches)
        step = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(total, self.warmup, self.seconds))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": step, "interval": "step"}}

"""The optimizers a training run can use: AdamW (the default), or Muon on the hidden weight matrices with
AdamW on the rest (``optim.optimizer=muon``), as the nanoGPT speedruns train.

Why one object for two optimizers: Lightning's automatic optimization steps one optimizer per step, and
the learning-rate schedule (LambdaLR) scales every parameter group of it; :class:`MuonWithAdamW` exposes
both optimizers' groups as its own (the same dicts), so the schedule and gradient clipping reach both.
Muon (``torch.optim.Muon``) orthogonalises each matrix's momentum update by Newton-Schulz iterations;
``adjust_lr_fn="match_rms_adamw"`` scales its step to AdamW's RMS, so one ``optim.lr`` serves both.
"""
from __future__ import annotations

import logging

import torch

from ..errors import UserError

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "muon")


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on ``matrices`` (2-D weights), AdamW on ``groups``; one step, one zero_grad, one state_dict."""

    def __init__(self, matrices: list, groups: list[dict], lr: float, betas, weight_decay: float):
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(groups, lr=lr, betas=betas)
        super().__init__([p for o in (self.muon, self.adamw) for g in o.param_groups for p in g["params"]], {})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups  # the same dicts: schedules reach both

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise UserError("the checkpoint's optimizer state is not Muon + AdamW (optim.optimizer=muon): "
                            "resume with the optimizer it was trained with")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def build_optimizer(kind: str, matrices: list, vectors: list, lr: float, betas, weight_decay: float):
    """``kind`` over the hidden weight matrices (weight decay) and the rest (embeddings, norms, biases:
    none); Muon takes the matrices only."""
    if kind == "adamw":
        return torch.optim.AdamW([{"params": matrices, "weight_decay": weight_decay},
                                  {"params": vectors, "weight_decay": 0.0}], lr=lr, betas=tuple(betas))
    if kind == "muon" and not matrices:  # e.g. FSDP's flat shards: no parameter is a whole matrix any more
        log.warning("optim.optimizer=muon: no 2-D weight matrix among the parameters (sharded by FSDP?): "
                    "AdamW trains them all")
        return build_optimizer("adamw", matrices, vectors, lr, betas, weight_decay)
    if kind == "muon":
        return MuonWithAdamW(matrices, [{"params": vectors, "weight_decay": 0.0}], lr, tuple(betas), weight_decay)
    raise UserError(f"optim.optimizer={kind!r}: choose one of {', '.join(OPTIMIZERS)}")

"""How training proceeds and which weights are kept: the learning-rate schedule (:func:`warmup_linear`),
trainer.max_time read as seconds (:func:`time_budget`), and the validation metric that ranks the
candidates (:data:`SELECT_BY`, :func:`selection_metric`)."""
from __future__ import annotations

import math
import time
from collections.abc import Mapping

import numpy as np
import torch

from ..errors import UserError

#: schedule=linear: the share of the steps spent warming up (conf/finetune.yaml's warmup)
WARMUP = 0.06
#: what selects the kept weights on the validation split (select_by=auto: the first of the task's)
SELECT_BY = {"classification": ("accuracy", "macro_f1", "mcc"), "regression": ("spearman",),
             "residue": ("residue_accuracy",)}


def warmup_linear(total: float, warmup: float, seconds: float | None = None, clock=time.monotonic):
    """The learning-rate factor at each optimizer step: up from 0 over the first ``warmup`` share of
    ``total`` steps, then straight down to 0 at ``total`` (BERT's fine-tuning schedule: the last
    epoch's small steps settle the weights the early stopping keeps instead of jumping around them).

    ``seconds`` (trainer.max_time): the run also ends when that much time has passed since the first
    step, so the share done is the larger of the steps' and the clock's (``total`` may then be inf:
    the time alone bounds the run), and the rates reach 0 when the time does."""
    ramp = max(1, round(warmup * total)) if math.isfinite(total) else 1
    start = []

    def factor(step: int) -> float:
        if seconds is None:
            if step < ramp:
                return (step + 1) / ramp
            return max(0.0, (total - step) / max(1, total - ramp))
        if not start:
            start.append(clock())
        done = max(step / total if math.isfinite(total) else 0.0, (clock() - start[0]) / seconds)
        if done < warmup:
            return max(done, (step + 1) / total if math.isfinite(total) else 0.0) / warmup
        return max(0.0, (1.0 - done) / (1.0 - warmup))
    return factor


def time_budget(max_time) -> float | None:
    """trainer.max_time as seconds: Lightning's "DD:HH:MM:SS", a dict of timedelta's keys, or a timedelta;
    None when it is not set.  Anything else is one line naming the key."""
    import datetime
    if max_time is None:
        return None
    try:
        if isinstance(max_time, str):
            days, hours, minutes, secs = (int(x) for x in max_time.split(":"))
            max_time = datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=secs)
        elif isinstance(max_time, Mapping):
            max_time = datetime.timedelta(**max_time)
        seconds = max_time.total_seconds()
    except (TypeError, ValueError, AttributeError):
        raise UserError(f"trainer.max_time={max_time!r}: give DD:HH:MM:SS (e.g. 00:00:10:00), or a dict such as "
                        f"{{minutes: 10}}") from None
    if not seconds > 0:
        raise UserError(f"trainer.max_time={max_time}: must be longer than 0")
    return seconds


def selection_metric(task: str, by: str, outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The validation metric that picks the kept weights: ``outputs`` (n, C) logits or (n, 1) values in
    the head's scale, ``targets`` (n,) (residue tasks: one row per labeled residue).  Higher is better;
    NaN (a constant regression output) is returned as NaN and never wins."""
    from scipy.stats import spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef
    y = targets.numpy()
    if task == "regression":
        p = outputs[:, 0].numpy()
        return float("nan") if np.ptp(p) == 0 or np.ptp(y) == 0 else float(spearmanr(p, y).statistic)
    pred = outputs.argmax(-1).numpy()
    if by == "macro_f1":
        return float(f1_score(y, pred, average="macro"))
    if by == "mcc":
        return float(matthews_corrcoef(y, pred))
    return float((pred == y).mean())

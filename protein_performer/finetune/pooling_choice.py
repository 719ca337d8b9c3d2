"""pooling=auto: which features the head reads, chosen on the validation split by the linear probe.

Why: a linear probe of every layer's mean side by side beats the last layer's mean on some tasks and
loses badly on others (docs/downstream.md, "Which features the linear probe should see": signal-peptide
MCC +0.04, family +0.035; stability's Spearman halved), and which is which is a property of the task,
not something to tune on the test split.  Both probes are fitted on the training split's frozen
features (one pass of the encoder: the last layer's mean is the every-layer features' last block) and
scored on the validation split; the every-layer head is taken only when it beats the last layer's in
``min_confidence`` of the validation bootstrap's draws (:func:`~.confidence.bootstrap_confidence`,
the gate finetune already puts between its probe and its fine-tuned weights)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..model.heads import FineTuneNet
from .batches import Encoded
from .confidence import Validated, bootstrap_confidence
from .head_init import fit_probe, frozen_features
from .schedule import SELECT_BY, selection_metric

log = logging.getLogger(__name__)

#: pooling=auto's choices: the fallback first
CHOICES = ("mean", "layers")


def _validated(pipe, X: np.ndarray, y: np.ndarray, task: str, outputs: int) -> Validated:
    """A fitted probe's validation outputs as finetune's candidates give them: class probabilities in
    the columns of the net's classes (a class absent from train: 0), or the predicted value."""
    if task == "regression":
        out = pipe.predict(X)[:, None]
    else:
        out = np.zeros((len(X), outputs))
        out[:, pipe.classes_] = pipe.predict_proba(X)
    return Validated(torch.as_tensor(out, dtype=torch.float32), torch.as_tensor(y), np.arange(len(y)))


def choose_pooling(net: FineTuneNet, data: dict[str, Encoded], max_tokens: int, scale: tuple[float, float],
                   select_by: str, min_confidence: float, seed: int = 0):
    """``net`` (an every-layer head: pooling=layers) -> (the pooling chosen, what metrics.json says of the
    choice, (the chosen features of the training split as :func:`~.head_init.frozen_features` gives them,
    their targets, the probe fitted on them, or None): the head's probe, not fitted twice).  The validation
    metric is ``select_by`` (the task's own where it is ``loss``)."""
    by = SELECT_BY[net.task][0] if select_by == "loss" else select_by
    dim, outputs = net.encoder.config.dim, net.head.out.out_features
    X, y = frozen_features(net, data["train"], max_tokens, seed)
    if not len(data["valid"]):
        log.warning("pooling=auto: no validation proteins to choose on; the head reads the last layer's mean")
        return "mean", {"requested": "auto", "chosen": "mean", "by": by, "reason": "no validation split"}, \
            (X[:, X.shape[1] - dim:], y, None)
    Xv, yv = frozen_features(net, data["valid"], max_tokens, seed)
    task = "regression" if net.task == "regression" else "classification"
    target = (lambda t: (t - scale[0]) / scale[1]) if task == "regression" else (lambda t: t.astype(int))
    columns = {"mean": slice(X.shape[1] - dim, None), "layers": slice(None)}
    scores, validated, fitted = {}, {}, {}
    for name in CHOICES:
        fitted[name] = fit_probe(X[:, columns[name]], target(y), task, seed)
        if fitted[name] is None:  # a class too rare for the probe's cross-validation: nothing to weigh
            return "mean", {"requested": "auto", "chosen": "mean", "by": by, "reason": "a class too rare for a "
                            "probe"}, (X[:, columns["mean"]], y, None)
        validated[name] = _validated(fitted[name], Xv[:, columns[name]], target(yv), task, outputs)
        scores[name] = selection_metric(net.task, by, validated[name].outputs, validated[name].targets)
    confidence = bootstrap_confidence(net.task, by, validated["mean"], validated["layers"], seed)
    chosen = "layers" if confidence >= min_confidence and scores["layers"] > scores["mean"] else "mean"
    log.info("pooling=auto: %s (the validation split's %s by a linear probe: mean %.4f, layers %.4f; layers ahead "
             "in %.1f%% of the bootstrap's draws, %.0f%% needed)", chosen, by, scores["mean"], scores["layers"],
             100 * confidence, 100 * min_confidence)
    summary = {"requested": "auto", "chosen": chosen, "by": by, "split": "valid", "probe": scores,
               "layers_over_mean": confidence, "min_confidence": float(min_confidence)}
    return chosen, summary, (X[:, columns[chosen]], y, fitted[chosen])

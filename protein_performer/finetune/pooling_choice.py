"""pooling=auto: which features the head reads, chosen on the validation split by the linear probe.

Why: a linear probe of every layer's mean side by side beats the last layer's mean on some tasks and
loses badly on others (docs/downstream.md, "Which features the linear probe should see": signal-peptide
MCC +0.04, family +0.035; stability's Spearman halved), and which is which is a property of the task,
not something to tune on the test split.  Both probes are fitted on the training split's frozen
features (one pass of the encoder: the last layer's mean is the every-layer features' last block) and
scored on the validation split; the every-layer head is taken only when it beats the last layer's in
``min_confidence`` of the validation bootstrap's draws (:func:`~.confidence.bootstrap_confidence`,
the gate finetune already puts between its probe and its fine-tuned weights).  ``pooling_by=cv``
(:func:`choose_by_cv`) weighs the two probes' own cross-validated loss on the training split instead: an
option, not the default (docs/downstream.md, "pooling_by=cv": it gained on one task and lost on two)."""
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


def cv_score(pipe) -> float:
    """A fitted probe's inner cross-validation score at the regularization it chose, higher better: the
    mean over the folds of the negative log-loss (logistic regression), or ridge's leave-one-out negative
    squared error."""
    head = pipe[-1]
    if hasattr(head, "best_score_"):
        return float(head.best_score_)
    return float(np.asarray(head.scores_).mean(0).max())  # (folds, l1 ratios, Cs): C_ is the best mean's


def choose_pooling(net: FineTuneNet, data: dict[str, Encoded], max_tokens: int, scale: tuple[float, float],
                   select_by: str, min_confidence: float, seed: int = 0, by_cv: bool = False):
    """``net`` (an every-layer head: pooling=layers) -> (the pooling chosen, what metrics.json says of the
    choice, (the chosen features of the training split as :func:`~.head_init.frozen_features` gives them,
    their targets, the probe fitted on them, or None): the head's probe, not fitted twice).  The validation
    metric is ``select_by`` (the task's own where it is ``loss``); ``by_cv``: instead the probes' own inner
    cross-validation on the training split (:func:`choose_by_cv`)."""
    by = SELECT_BY[net.task][0] if select_by == "loss" else select_by
    dim, outputs = net.encoder.config.dim, net.head.out.out_features
    X, y = frozen_features(net, data["train"], max_tokens, seed)
    if by_cv:
        return choose_by_cv(net.task, X, y, dim, scale, seed)
    if not len(data["valid"]):
        log.warning("pooling=auto: no validation proteins to choose on; the head reads the last layer's mean")
        return "mean", {"requested": "auto", "chosen": "mean", "by": by, "reason": "no validation split"}, \
            (X[:, X.shape[1] - dim:], y, None)
    task, target, columns, fitted = _both_probes(net.task, X, y, dim, scale, seed)
    if fitted is None:
        return _too_rare(by, X, y, columns)
    Xv, yv = frozen_features(net, data["valid"], max_tokens, seed)
    validated = {name: _validated(fitted[name], Xv[:, columns[name]], target(yv), task, outputs) for name in CHOICES}
    scores = {name: selection_metric(net.task, by, v.outputs, v.targets) for name, v in validated.items()}
    confidence = bootstrap_confidence(net.task, by, validated["mean"], validated["layers"], seed)
    chosen = "layers" if confidence >= min_confidence and scores["layers"] > scores["mean"] else "mean"
    log.info("pooling=auto: %s (the validation split's %s by a linear probe: mean %.4f, layers %.4f; layers ahead "
             "in %.1f%% of the bootstrap's draws, %.0f%% needed)", chosen, by, scores["mean"], scores["layers"],
             100 * confidence, 100 * min_confidence)
    summary = {"requested": "auto", "chosen": chosen, "by": by, "split": "valid", "probe": scores,
               "layers_over_mean": confidence, "min_confidence": float(min_confidence)}
    return chosen, summary, (X[:, columns[chosen]], y, fitted[chosen])


def choose_by_cv(task: str, X: np.ndarray, y: np.ndarray, dim: int, scale: tuple[float, float], seed: int = 0):
    """pooling_by=cv: both probes fitted on the training split's features ``X`` (every layer's mean side
    by side; the last ``dim`` columns: the last layer's), every layer's taken where its inner
    cross-validation scores higher (:func:`cv_score`: log-loss, or squared error).  Why: those folds
    cover every training protein, where the validation split is a tenth of them and its bootstrap gate
    rarely sure; and the validation split is left to the gate between the probe and the fine-tuned
    weights.  Returns what :func:`choose_pooling` does."""
    kind, _, columns, fitted = _both_probes(task, X, y, dim, scale, seed)
    if fitted is None:
        return _too_rare("cv", X, y, columns)
    scores = {name: cv_score(pipe) for name, pipe in fitted.items()}
    chosen = "layers" if scores["layers"] > scores["mean"] else "mean"
    what = "log-loss" if kind == "classification" else "squared error (standardized)"
    log.info("pooling=auto: %s (the training split's cross-validated %s of a linear probe: mean %.4f, layers "
             "%.4f)", chosen, what, -scores["mean"], -scores["layers"])
    summary = {"requested": "auto", "chosen": chosen, "by": "cv", "split": "train", "loss": what,
               "cv_loss": {name: -v for name, v in scores.items()}}
    return chosen, summary, (X[:, columns[chosen]], y, fitted[chosen])


def _both_probes(task: str, X: np.ndarray, y: np.ndarray, dim: int, scale: tuple[float, float], seed: int):
    """Both choices' probes on the training features: (probe task, targets as the probe sees them, each
    choice's columns of ``X``, each choice's fitted probe or None where a class is too rare for one)."""
    kind = "regression" if task == "regression" else "classification"
    target = (lambda t: (t - scale[0]) / scale[1]) if kind == "regression" else (lambda t: t.astype(int))
    columns = {"mean": slice(X.shape[1] - dim, None), "layers": slice(None)}
    fitted = {}
    for name in CHOICES:
        fitted[name] = fit_probe(X[:, columns[name]], target(y), kind, seed)
        if fitted[name] is None:  # a class too rare for the probe's cross-validation: nothing to weigh
            return kind, target, columns, None
    return kind, target, columns, fitted


def _too_rare(by: str, X: np.ndarray, y: np.ndarray, columns: dict):
    return "mean", {"requested": "auto", "chosen": "mean", "by": by, "reason": "a class too rare for a probe"}, \
        (X[:, columns["mean"]], y, None)

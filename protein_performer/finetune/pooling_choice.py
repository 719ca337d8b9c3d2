"""pooling=auto: which features the head reads, chosen on the validation split by the linear probe.

Why: a linear probe of every layer's mean side by side beats the last layer's mean on some tasks and
loses badly on others (docs/downstream.md, "Which features the linear probe should see": signal-peptide
MCC +0.04, family +0.035; stability's Spearman halved), and which is which is a property of the task,
not something to tune on the test split.  Each candidate's probe (``pooling_choices``: the last layer's
mean, every layer's, and with pooling=termini the ends of the protein too) is fitted on the training
split's frozen features (one pass of the encoder: each candidate's features hold the one before's) and
scored on the validation split; a richer candidate replaces the choice so far only when it beats it in
``min_confidence`` of the validation bootstrap's draws (:func:`~.confidence.bootstrap_confidence`, the
gate finetune already puts between its probe and its fine-tuned weights).  ``pooling_by=cv``
(:func:`choose_by_cv`) weighs the probes' own cross-validated loss on the training split instead: an
option, not the default (docs/downstream.md, "pooling_by=cv": it gained on one task and lost on two)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..errors import UserError
from ..model.heads import TERMINUS, FineTuneNet
from .batches import Encoded
from .confidence import Validated, bootstrap_confidence
from .head_init import fit_probe, frozen_features
from .schedule import SELECT_BY, selection_metric

log = logging.getLogger(__name__)

#: pooling=auto's possible candidates, each one's features holding the one before's: the last layer's mean, every
#: layer's mean, and every layer's with the last layer's mean over each end (pooling=termini)
NESTED = ("mean", "layers", "termini")
#: pooling=auto's candidates unless finetune's pooling_choices says otherwise, the fallback first.  termini is an
#: option, not a default: it paid on the bundled tasks (signal peptides +0.011 / +0.006) but on the held-out-shaped
#: family draw a 157-protein validation split chose it and it ended 0.026 below the probe (docs/downstream.md,
#: "pooling=termini")
CHOICES = ("mean", "layers")


def check_choices(choices) -> tuple[str, ...]:
    """``pooling_choices`` as given -> a tuple: at least two of :data:`NESTED`, in its order (each candidate
    must hold the one before's features: one pass of the encoder feeds them all), else one line naming it."""
    try:
        names = (choices,) if isinstance(choices, str) else tuple(str(c) for c in choices)
    except TypeError:  # a number, or null
        names = (str(choices),)
    if len(names) < 2 or len(set(names)) != len(names) or not set(names) <= set(NESTED) \
            or list(names) != sorted(names, key=NESTED.index):
        raise UserError(f"pooling_choices={list(names)}: two or more of {', '.join(NESTED)}, in that order "
                        f"(the first is the fallback; each later one replaces the choice so far only where it wins)")
    return names


def columns(layers: int, dim: int) -> dict[str, slice]:
    """Each candidate's columns of the richest head's features (:meth:`LayerMeansHead.probe_features`: the
    ``layers`` hidden states' means side by side, then the last one's mean over each end)."""
    return {"mean": slice((layers - 1) * dim, layers * dim), "layers": slice(0, layers * dim), "termini": slice(None)}


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
                   select_by: str, min_confidence: float, seed: int = 0, by_cv: bool = False,
                   choices: tuple[str, ...] = CHOICES):
    """``net`` (a head of the last of ``choices``: pooling=layers or termini) -> (the pooling chosen, what
    metrics.json says of the choice, (the chosen features of the training split as
    :func:`~.head_init.frozen_features` gives them, their targets, the probe fitted on them, or None): the
    head's probe, not fitted twice).  On the validation split, by ``select_by`` (the task's own metric where
    it is ``loss``), a ladder: the first choice, replaced by each later one whose probe beats the choice so
    far in ``min_confidence`` of the bootstrap's draws.  ``by_cv``: instead the probes' own inner
    cross-validation on the training split (:func:`choose_by_cv`)."""
    by = SELECT_BY[net.task][0] if select_by == "loss" else select_by
    dim, outputs = net.encoder.config.dim, net.head.out.out_features
    if not hasattr(net.head, "layers") or net.head.ends != (TERMINUS if choices[-1] == "termini" else 0):
        raise ValueError(f"pooling=auto among {choices}: the net's head must be {choices[-1]}'s, whose features hold "
                         f"the others'")
    X, y = frozen_features(net, data["train"], max_tokens, seed)
    cols = columns(net.head.layers, dim)
    if by_cv:
        return choose_by_cv(net.task, X, y, cols, scale, seed, choices)
    if not len(data["valid"]):
        log.warning("pooling=auto: no validation proteins to choose on; the head reads %s", choices[0])
        return choices[0], {"requested": "auto", "choices": list(choices), "chosen": choices[0], "by": by,
                            "reason": "no validation split"}, (X[:, cols[choices[0]]], y, None)
    task, target, fitted = _probes(net.task, X, y, cols, scale, seed, choices)
    if fitted is None:
        return _too_rare(by, X, y, cols, choices)
    Xv, yv = frozen_features(net, data["valid"], max_tokens, seed)
    validated = {name: _validated(fitted[name], Xv[:, cols[name]], target(yv), task, outputs) for name in choices}
    scores = {name: selection_metric(net.task, by, v.outputs, v.targets) for name, v in validated.items()}
    chosen, ahead = choices[0], {}
    for name in choices[1:]:
        confidence = bootstrap_confidence(net.task, by, validated[chosen], validated[name], seed)
        ahead[name] = {"over": chosen, "confidence": confidence}
        if confidence >= min_confidence and scores[name] > scores[chosen]:
            chosen = name
    log.info("pooling=auto: %s (the validation split's %s by a linear probe: %s; %s; %.0f%% needed)", chosen, by,
             ", ".join(f"{k} {v:.4f}" for k, v in scores.items()),
             "; ".join(f"{k} ahead of {a['over']} in {100 * a['confidence']:.1f}% of the bootstrap's draws"
                       for k, a in ahead.items()), 100 * min_confidence)
    summary = {"requested": "auto", "choices": list(choices), "chosen": chosen, "by": by, "split": "valid",
               "probe": scores, "ahead": ahead, "min_confidence": float(min_confidence)}
    return chosen, summary, (X[:, cols[chosen]], y, fitted[chosen])


def choose_by_cv(task: str, X: np.ndarray, y: np.ndarray, cols: dict[str, slice], scale: tuple[float, float],
                 seed: int = 0, choices: tuple[str, ...] = CHOICES):
    """pooling_by=cv: each choice's probe fitted on its columns (``cols``) of the training split's features
    ``X``, the one whose inner cross-validation scores highest taken (:func:`cv_score`: log-loss, or squared
    error).  Why: those folds cover every training protein, where the validation split is a tenth of them
    and its bootstrap gate rarely sure; and the validation split is left to the gate between the probe and
    the fine-tuned weights.  Returns what :func:`choose_pooling` does."""
    kind, _, fitted = _probes(task, X, y, cols, scale, seed, choices)
    if fitted is None:
        return _too_rare("cv", X, y, cols, choices)
    scores = {name: cv_score(pipe) for name, pipe in fitted.items()}
    chosen = max(choices, key=lambda name: scores[name])  # the first of equals: the simpler features
    what = "log-loss" if kind == "classification" else "squared error (standardized)"
    log.info("pooling=auto: %s (the training split's cross-validated %s of a linear probe: %s)", chosen, what,
             ", ".join(f"{k} {-v:.4f}" for k, v in scores.items()))
    summary = {"requested": "auto", "choices": list(choices), "chosen": chosen, "by": "cv", "split": "train",
               "loss": what, "cv_loss": {name: -v for name, v in scores.items()}}
    return chosen, summary, (X[:, cols[chosen]], y, fitted[chosen])


def _probes(task: str, X: np.ndarray, y: np.ndarray, cols: dict[str, slice], scale: tuple[float, float], seed: int,
            choices: tuple[str, ...]):
    """Each choice's probe on the training features: (probe task, targets as the probe sees them, each
    choice's fitted probe, or None where a class is too rare for one)."""
    kind = "regression" if task == "regression" else "classification"
    target = (lambda t: (t - scale[0]) / scale[1]) if kind == "regression" else (lambda t: t.astype(int))
    fitted = {}
    for name in choices:
        fitted[name] = fit_probe(X[:, cols[name]], target(y), kind, seed)
        if fitted[name] is None:  # a class too rare for the probe's cross-validation: nothing to weigh
            return kind, target, None
    return kind, target, fitted


def _too_rare(by: str, X: np.ndarray, y: np.ndarray, cols: dict, choices: tuple[str, ...]):
    return choices[0], {"requested": "auto", "choices": list(choices), "chosen": choices[0], "by": by,
                        "reason": "a class too rare for a probe"}, (X[:, cols[choices[0]]], y, None)

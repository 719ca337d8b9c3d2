"""The head's start: a linear probe of the frozen encoder (LP-FT), fitted on the training split and
folded into the head's linear layer; the probe is also the baseline every epoch competes with."""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from ..model.heads import FineTuneNet, residue_mask
from ..objectives import IGNORE
from ..probe import make_probe
from .batches import Encoded, batches

log = logging.getLogger(__name__)

#: residues the per-residue probe is fitted on (a seeded sample of the training split's)
PROBE_RESIDUES = 20000


@torch.no_grad()
def frozen_features(net: FineTuneNet, data: Encoded, max_tokens: int, seed: int):
    """What the head sees before any training, on ``data``: the mean over each protein's residues of
    the encoder's output (pooled tasks; pooling=layers: of every hidden state, side by side), or the
    output at each residue (a seeded sample of at most :data:`PROBE_RESIDUES`), beside, when the head has a window w, the sum of the outputs of the
    protein's residues within w of it over 2w + 1 (what its convolution can weigh: the probe sees the
    context the head and the windowed composition baseline see); returns (features (n, dim or 2 dim)
    float64, targets (n,))."""
    was_training = net.training
    net.eval()
    X, y = [None] * len(data), [None] * len(data)                       # in data order, as the folds see them
    for batch, b in batches(data, max_tokens, net.tokenizer.pad_id):
        h, residues = net.hidden(b["tokens"], b["padding_mask"]), residue_mask(b["tokens"], net.tokenizer)
        pooled = None if net.task == "residue" else net.head.probe_features(h, residues).float()
        h = h.float() if net.task == "residue" else None
        if net.task == "residue" and net.head.window:
            h = torch.cat([h, _window_mean(h * residues.unsqueeze(-1), net.head.window)], -1)
        for row, i in enumerate(batch):
            if net.task == "residue":
                keep = b["targets"][row] != IGNORE
                X[i], y[i] = h[row][keep].double().numpy(), b["targets"][row][keep].numpy()
            else:
                X[i], y[i] = pooled[row:row + 1].double().numpy(), b["targets"][row:row + 1].numpy()
    net.train(was_training)
    X, y = np.concatenate(X), np.concatenate(y)
    if net.task == "residue" and len(y) > PROBE_RESIDUES:
        pick = np.sort(np.random.default_rng(seed).choice(len(y), PROBE_RESIDUES, replace=False))
        X, y = X[pick], y[pick]
    return X, y


def _window_mean(x: torch.Tensor, w: int) -> torch.Tensor:
    """(B, L, D) -> (B, L, D): at each position the sum of the rows within ``w`` of it over 2w + 1
    (zeros beyond the ends): a convolution with every weight 1 / (2w + 1)."""
    return F.avg_pool1d(x.transpose(1, 2), 2 * w + 1, stride=1, padding=w, count_include_pad=True).transpose(1, 2)


def fit_probe(X: np.ndarray, target: np.ndarray, task: str, seed: int = 0):
    """``probe``'s pipeline (standardize, then logistic regression with C by 3-fold CV, or ridge) fitted on
    frozen features; None when a class is too rare for the cross-validation (or there is one class)."""
    folds = 3 if task == "regression" else int(min(3, np.unique(target, return_counts=True)[1].min()))
    if folds < 2 or (task == "classification" and len(np.unique(target)) < 2):
        return None
    return make_probe(task, folds=folds, seed=seed).fit(X, target)


def probe_head_init(net: FineTuneNet, data: Encoded, max_tokens: int, scale: tuple[float, float],
                    seed: int = 0, features: tuple | None = None) -> dict:
    """Start the head where a linear probe ends (LP-FT, Kumar et al. 2022: fine-tuning from a
    probed head keeps what the pretrained features hold, where a random head first distorts them):
    :func:`fit_probe` on the frozen encoder's features of the training split (``features``: those
    already computed, as :func:`frozen_features` gives them, and the probe fitted on them or None),
    folded into the head's linear layer, so the untrained net predicts what the probe predicts.  An attention-pooling head starts at the plain
    mean (its scores zero).  Returns what was fitted (C or alpha, the examples' count), or None
    when a class is too rare for the cross-validation (the head then stays random)."""
    X, y, pipe = (*frozen_features(net, data, max_tokens, seed), None) if features is None else features
    task = "regression" if net.task == "regression" else "classification"
    target = (y - scale[0]) / scale[1] if task == "regression" else y.astype(int)
    pipe = fit_probe(X, target, task, seed) if pipe is None else pipe
    if pipe is None:
        log.warning("head_init=probe: a class has fewer than 2 training examples, too few for the probe's "
                    "cross-validation; the head starts random")
        return None
    _fold_into_head(net, task, pipe)
    model = pipe[-1]
    chosen = {"C": float(np.atleast_1d(model.C_)[0])} if task == "classification" else {"alpha": float(model.alpha_)}
    return {**chosen, "examples": int(len(y))}


def _fold_into_head(net: FineTuneNet, task: str, pipe) -> None:
    """The fitted probe (scaler, then linear model) as the head's linear layer, on the raw features; a
    window head's context weights take the window features' coefficients over 2w + 1 at every offset."""
    scaler, model = pipe[0], pipe[-1]
    coef = np.atleast_2d(model.coef_) / scaler.scale_                    # on raw features
    bias = np.atleast_1d(model.intercept_) - coef @ scaler.mean_
    out, context = net.head.out, getattr(net.head, "context", None)
    W = np.zeros((out.out_features, coef.shape[1]))
    b = np.zeros(out.out_features)
    if task == "regression":
        W[0], b[0] = coef[0], bias[0]
    elif coef.shape[0] == 1:                                             # binary: logits [0, z]
        W[model.classes_[1]], b[model.classes_[1]] = coef[0], bias[0]
    else:
        W[model.classes_], b[model.classes_] = coef, bias
        missing = np.setdiff1d(np.arange(out.out_features), model.classes_)
        if len(missing):  # a class absent from train: never predicted, as by the probe
            b[missing] = b[model.classes_].min() - 10.0
    with torch.no_grad():
        if context is not None:                                          # [own state, window mean]
            W, around = W[:, :out.in_features], W[:, out.in_features:] / context.kernel_size[0]
            context.weight.copy_(torch.as_tensor(around, dtype=context.weight.dtype)[:, :, None]
                                 .expand_as(context.weight))
        out.weight.copy_(torch.as_tensor(W, dtype=out.weight.dtype))
        out.bias.copy_(torch.as_tensor(b, dtype=out.bias.dtype))
        if hasattr(net.head, "score"):
            net.head.score.weight.zero_()
            net.head.score.bias.zero_()

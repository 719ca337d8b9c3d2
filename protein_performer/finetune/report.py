"""The test split's results: predictions in file order (:func:`predict`), their metrics beside a
constant predictor's (:func:`metrics`, :func:`baseline`), what chose the kept weights
(:func:`selection_summary`), and the lines the command prints (:func:`format_metrics`)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from ..model.heads import FineTuneNet
from .batches import Encoded, batches


@torch.no_grad()
def predict(net: FineTuneNet, data: Encoded, max_tokens: int, classes: list[str], scale: tuple[float, float]):
    """Test-split predictions in file order: class names, values, or a class letter per residue;
    and the positive-class probability for a binary task (else None)."""
    preds, scores = [None] * len(data), [None] * len(data)
    for batch, b in batches(data, max_tokens, net.tokenizer.pad_id):
        out = net(b["tokens"], b["padding_mask"]).float()
        for row, i in enumerate(batch):
            if net.task == "regression":
                preds[i] = float(out[row, 0]) * scale[1] + scale[0]
            elif net.task == "residue":
                preds[i] = "".join(classes[k] for k in out[row, 1:1 + len(data.targets[i])].argmax(-1).tolist())
            else:
                preds[i] = classes[int(out[row].argmax())]
                if len(classes) == 2:
                    scores[i] = float(torch.softmax(out[row], -1)[1])
    return preds, (scores if net.task == "classification" and len(classes) == 2 else None)


def metrics(task: str, classes: list[str], labels: list, predictions: list, scores: list | None = None) -> dict:
    """Test-split metrics: accuracy, MCC and AUROC (binary; the positive class is the second
    in sorted order) or macro-F1 (multi-class); Spearman (regression); per-residue accuracy,
    Q3 when there are three classes (over all test residues together)."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef, roc_auc_score
    if task == "regression":
        y, p = np.asarray(labels, dtype=float), np.asarray(predictions, dtype=float)
        return {"spearman": float(spearmanr(y, p).statistic), "pearson": float(pearsonr(y, p).statistic),
                "rmse": float(np.sqrt(np.mean((y - p) ** 2))), "n": len(y)}
    if task == "residue":
        right = sum(a == b for y, p in zip(labels, predictions) for a, b in zip(y, p))
        total = sum(len(y) for y in labels)
        key = "q3" if len(classes) == 3 else "residue_accuracy"
        return {key: right / total, "residues": total, "n": len(labels)}
    r = {"accuracy": float(accuracy_score(labels, predictions)), "mcc": float(matthews_corrcoef(labels, predictions))}
    if len(classes) == 2:
        positive = np.array([y == classes[1] for y in labels])
        r["auroc"] = float(roc_auc_score(positive, scores)) if 0 < positive.sum() < len(positive) else None
    else:
        r["macro_f1"] = float(f1_score(labels, predictions, average="macro"))
    return {**r, "n": len(labels)}


def baseline(task: str, train: list, test: list) -> dict:
    """A constant predictor fitted on train: the most frequent class (residue), or the mean."""
    if task == "regression":
        return {"rmse": float(np.sqrt(np.mean((np.asarray(test) - np.mean(train)) ** 2)))}
    if task == "residue":
        top = Counter(c for y in train for c in y).most_common(1)[0][0]
        return {"residue_accuracy": sum(c == top for y in test for c in y) / sum(len(y) for y in test)}
    top = Counter(train).most_common(1)[0][0]
    return {"accuracy": sum(y == top for y in test) / len(test)}


def selection_summary(candidates: list[dict], kept: str | None, by: str, gate: dict | None = None) -> dict:
    """What metrics.json says about the choice: every validated candidate, the one kept, the kept one's
    margin over the probe on the validation split (by ``by``; the test split chose nothing), and the
    gate's figures (``gate``: min_confidence; best_tuned, the best fine-tuned candidate, with its
    confidence over the probe and its margin, tuned_over_probe)."""
    summary = {"by": by, "split": "valid", "kept": kept, "candidates": candidates, **(gate or {})}
    probe = next((c for c in candidates if c["name"] == "probe"), None)
    score = {c["name"]: c.get(by) for c in candidates}
    if probe is not None and score.get(kept) is not None:
        summary["over_probe"] = score[kept] - probe[by]
    if probe is not None and score.get(summary.get("best_tuned")) is not None:
        summary["tuned_over_probe"] = score[summary["best_tuned"]] - probe[by]
    return summary


def format_metrics(result: dict) -> str:
    keys = [k for k in ("accuracy", "mcc", "auroc", "macro_f1", "spearman", "pearson", "rmse", "q3",
                        "residue_accuracy") if result.get(k) is not None]
    main = ", ".join(f"{k} {result[k]:.4f}" for k in keys)
    base = ", ".join(f"{k} {v:.4f}" for k, v in result["baseline"].items())
    sel = result.get("selection") or {}
    kept = next((c for c in sel.get("candidates", []) if c["name"] == sel.get("kept")), None)
    choice = ""
    if kept is not None:
        value = kept.get(sel["by"], kept["loss"])
        choice = f"\nkept: {sel['kept']} (valid {sel['by']} {value:.4f}"
        if sel.get("epoch_alone"):
            choice += (f"; alone, not mixed with the probe: ahead of the mix in {sel['epoch_over_mix']:.1%} of the "
                       f"validation bootstrap's draws")
        if "over_probe" in sel and sel["kept"] != "probe":
            choice += f", {sel['over_probe']:+.4f} over the linear probe"
            if "confidence" in sel:
                choice += f", ahead in {sel['confidence']:.1%} of the validation bootstrap's draws"
        elif sel["kept"] == "probe" and "confidence" in sel:
            margin = sel["tuned_over_probe"]
            choice += (f": {sel['best_tuned']} scored {margin:+.4f} {'above' if margin > 0 else 'against'} it "
                       f"{'but' if margin > 0 else 'and'} was ahead in only {sel['confidence']:.1%} of the validation "
                       f"bootstrap's draws, below min_confidence {sel['min_confidence']:g}")
        elif sel["kept"] == "probe":
            choice += ": no epoch beat the linear probe"
        choice += ")"
        refit = (result.get("probe") or {}).get("refit")
        if refit:
            whose = "" if sel["kept"] == "probe" else " its probe half"
            choice += (f";{whose} then fitted again on all {refit['proteins']:,} training proteins, the validation "
                       f"proteins finetune had held out of them included")
    pooled = result.get("pooling")
    if pooled and "cv_loss" in pooled:  # pooling=auto's choice by the probes' cross-validation
        losses = ", ".join(f"{k} {v:.4f}" for k, v in pooled["cv_loss"].items())
        choice += (f"\npooling=auto: {pooled['chosen']} (the training split's cross-validated {pooled['loss']} of a "
                   f"linear probe: {losses})")
    elif pooled and "probe" in pooled:  # pooling=auto's choice on the validation split
        scores = ", ".join(f"{k} {v:.4f}" for k, v in pooled["probe"].items())
        ahead = "; ".join(f"{k} ahead of {a['over']} in {a['confidence']:.1%} of the draws"
                          for k, a in pooled["ahead"].items())
        choice += (f"\npooling=auto: {pooled['chosen']} (valid {pooled['by']} of a linear probe: {scores}; {ahead}, "
                   f"{pooled['min_confidence']:g} needed)")
    elif pooled:
        choice += f"\npooling=auto: {pooled['chosen']} ({pooled['reason']})"
    return (f"test ({result['n']} proteins): {main}; constant predictor: {base}\n"
            f"{result['steps']} steps, {result['epochs']} epochs, {result['train_seconds']:.1f} s{choice}")

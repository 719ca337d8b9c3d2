"""finetune's pooling=auto: the last layer's mean, every layer's, or (pooling_choices with termini) every layer's
and the protein's ends, whichever a linear probe scores higher on the validation split (surely enough: the
bootstrap gate).  Checked against features computed protein by
protein, probes refitted here with scikit-learn and accuracies counted by hand; a run that chose a pooling
is the plain run of that pooling, prediction for prediction."""
import csv
import json

import numpy as np
import pytest
import torch

from protein_performer import finetune as FT
from protein_performer.finetune.batches import Encoded
from protein_performer.finetune.pooling_choice import choose_pooling
from protein_performer.model.heads import TERMINUS, FineTuneNet
from protein_performer.probe import make_probe

from conftest import run_command
from test_finetune_probe_init import TOK, ckpt, reference_features, rich_or_poor  # noqa: F401 (a fixture)


def split_data(rows):
    """rich_or_poor's rows as finetune's encoded train and valid splits (class 0: poor, 1: rich)."""
    part = lambda name: [r for r in rows if r[3] == name]  # noqa: E731
    return {name: Encoded([TOK.encode(r[1]) for r in part(name)], [int(r[2] == "rich") for r in part(name)])
            for name in ("train", "valid")}, {name: part(name) for name in ("train", "valid")}


# seed 3: every layer's probe scores higher on validation (0.85 against 0.825), but not surely (0.71 of the draws)
@pytest.mark.parametrize("min_confidence", [0.0, 0.9])
def test_the_choice_is_the_higher_probe_on_validation_by_hand(ckpt, tmp_path, min_confidence):  # noqa: F811
    rows, _ = rich_or_poor(tmp_path, 200, seed=3)
    data, part = split_data(rows)
    encoder = ckpt[0].model.encoder
    torch.manual_seed(0)
    net = FineTuneNet(encoder, "classification", 2, "layers", dropout=0.0).eval()
    chosen, summary, (X, y, _) = choose_pooling(net, data, 1200, (0.0, 1.0), "accuracy", min_confidence, seed=0,
                                                choices=("mean", "layers"))

    dim, depth = encoder.config.dim, encoder.depth
    ref = {name: reference_features(encoder, [r[1] for r in part[name]], layers=True) for name in part}
    labels = {name: np.array([int(r[2] == "rich") for r in part[name]]) for name in part}
    accuracy = {}
    for pooling, cols in (("mean", slice(depth * dim, None)), ("layers", slice(None))):
        assert ref["train"][:, cols].shape[1] == (dim if pooling == "mean" else (depth + 1) * dim)
        pipe = make_probe("classification", 3, 0).fit(ref["train"][:, cols], labels["train"])
        accuracy[pooling] = float(np.mean(pipe.predict(ref["valid"][:, cols]) == labels["valid"]))
    assert summary["probe"] == pytest.approx(accuracy, abs=1.5 / len(rows[1::5]))  # at most one protein apart
    assert accuracy["layers"] > accuracy["mean"] > 0.6  # what the test is about: a choice with a margin
    assert summary["ahead"]["layers"]["over"] == "mean" and summary["choices"] == ["mean", "layers"]
    confidence = summary["ahead"]["layers"]["confidence"]
    assert 0.5 < confidence < 0.9
    assert chosen == ("layers" if min_confidence == 0.0 else "mean") == summary["chosen"]
    # the training features handed to the head's probe: the chosen pooling's, protein by protein
    cols = slice(None) if chosen == "layers" else slice(depth * dim, None)
    np.testing.assert_allclose(X, ref["train"][:, cols], atol=1e-5)
    np.testing.assert_array_equal(y, labels["train"])


def read_predictions(out):
    with open(out / "predictions.csv", newline="") as fh:
        return list(csv.reader(fh))


# by cv: every layer's probe has the lower cross-validated log-loss here (0.22 against 0.42), gate or not
@pytest.mark.parametrize("by,confidence,expect", [("valid", 0.0, "layers"), ("valid", 0.9, "mean"), ("cv", 0.9, "layers")])
def test_an_auto_run_is_the_plain_run_of_the_pooling_it_chose(ckpt, tmp_path, by, confidence, expect):  # noqa: F811
    _, labels = rich_or_poor(tmp_path, 200, seed=3)
    kw = dict(lr=1e-3, head_lr=1e-2, dropout=0.0, patience=10, pooling_confidence=confidence, max_tokens=1200,
              trainer={"max_epochs": 2, "enable_progress_bar": False}, progress_every=None, progress_seconds=None)
    runs = {}
    for pooling in ("auto", expect):
        out = tmp_path / pooling
        result = FT.finetune(ckpt[1], labels, "classification", out, pooling=pooling, pooling_by=by, **kw)
        if pooling == "auto":  # the closing line says what was chosen, and on what
            on = "valid accuracy" if by == "valid" else "the training split's cross-validated log-loss"
            assert f"pooling=auto: {expect} ({on} of a linear probe: mean " in FT.format_metrics(result)
        runs[pooling] = (out, json.loads((out / "metrics.json").read_text()),
                         json.loads((out / "finetune.json").read_text()))
    auto, plain = runs["auto"], runs[expect]
    assert auto[1]["pooling"]["chosen"] == expect and "pooling" not in plain[1]
    assert auto[1]["pooling"]["choices"] == ["mean", "layers"]  # the default candidates: termini is an option
    assert auto[2]["pooling"] == plain[2]["pooling"] == expect  # what load_finetuned rebuilds
    assert read_predictions(auto[0]) == read_predictions(plain[0])
    assert auto[1]["selection"] == plain[1]["selection"] and auto[1]["accuracy"] == plain[1]["accuracy"]


def test_residue_tasks_take_auto_as_mean_and_a_bad_pooling_is_one_line(ckpt, tmp_path, capsys):  # noqa: F811
    rows, labels = rich_or_poor(tmp_path, 40, seed=1)
    code, _, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                               f"output_dir={tmp_path / 'bad'}", "pooling=max")
    assert code == 2 and "pooling='max': choose one of mean, attention, layers, termini or auto" in err
    assert not (tmp_path / "bad").exists()
    code, _, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                               f"output_dir={tmp_path / 'bad'}", "pooling_by=test")
    assert code == 2 and err.strip().splitlines()[-1].endswith("pooling_by='test': choose valid (the validation "
                                                                "split, through the bootstrap gate) or cv (the probes' "
                                                                "cross-validation on the training split)")
    assert not (tmp_path / "bad").exists()
    code, _, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                               f"output_dir={tmp_path / 'bad'}", "pooling_choices=[layers,mean]")
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "pooling_choices=['layers', 'mean']: two or more of mean, layers, termini, in that order (the first is the "
        "fallback; each later one replaces the choice so far only where it wins)")
    assert not (tmp_path / "bad").exists()
    # a per-residue task: one label letter per residue; auto reads the hidden state at each residue, as mean does
    residue = tmp_path / "residue.csv"
    with open(residue, "w", newline="") as fh:
        csv.writer(fh).writerows([("id", "sequence", "label", "split"),
                                  *[(r[0], r[1], "".join("H" if c in "KE" else "C" for c in r[1]), r[3]) for r in rows]])
    out = tmp_path / "res"
    FT.finetune(ckpt[1], residue, "residue", out, pooling="auto", max_tokens=1200, trainer={"max_epochs": 1,
                "enable_progress_bar": False}, progress_every=None, progress_seconds=None)
    assert json.loads((out / "finetune.json").read_text())["pooling"] == "mean"
    assert "pooling" not in json.loads((out / "metrics.json").read_text())


def cross_validated_log_loss(X, y, seed=0):
    """The lowest mean held-out log-loss over C (the probe's grid) of a logistic regression on the standardized
    features, over the probe's 3 shuffled stratified folds: each fold fitted and scored here."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss
    from sklearn.model_selection import StratifiedKFold
    from sklearn.preprocessing import StandardScaler
    Z = StandardScaler().fit_transform(X)
    folds = list(StratifiedKFold(3, shuffle=True, random_state=seed).split(Z, y))
    return min(np.mean([log_loss(y[te], LogisticRegression(C=C, max_iter=10000, tol=1e-10)
                                 .fit(Z[tr], y[tr]).predict_proba(Z[te])) for tr, te in folds])
               for C in np.logspace(-4, 2, 7))


def leave_one_out_squared_error(X, t):
    """The lowest mean squared error over alpha (ridge's grid) of ridge on the standardized features, each
    protein predicted by a ridge fitted here on all the others."""
    from sklearn.linear_model import Ridge
    from sklearn.preprocessing import StandardScaler
    Z, n = StandardScaler().fit_transform(X), len(t)
    return min(np.mean([(Ridge(alpha=a).fit(np.delete(Z, i, 0), np.delete(t, i)).predict(Z[i:i + 1])[0] - t[i]) ** 2
                        for i in range(n)]) for a in np.logspace(-3, 5, 9))


# pooling_by=cv: the two probes' own cross-validation on the training split decides, not the validation split.
# classification: rich in K + E, which every layer's mean (the embedding's among them) holds better; regression:
# a fixed linear read-out of the last layer's mean plus noise, where every layer's 96 columns only add variance
@pytest.mark.parametrize("task,expect", [("classification", "layers"), ("regression", "mean")])
def test_by_cv_the_choice_is_the_probe_with_the_lower_cross_validated_loss_by_hand(ckpt, tmp_path, task,  # noqa: F811
                                                                                  expect):
    rows, _ = rich_or_poor(tmp_path, 200, seed=3)
    encoder = ckpt[0].model.encoder
    dim, depth = encoder.config.dim, encoder.depth
    part = {name: [r for r in rows if r[3] == name] for name in ("train", "valid")}
    ref = {name: reference_features(encoder, [r[1] for r in part[name]], layers=True) for name in part}
    if task == "regression":
        last, rng = ref["train"][:, depth * dim:], np.random.RandomState(0)
        w, noise = rng.randn(dim) / np.sqrt(dim), 0.5
        readout = lambda f: ((f[:, depth * dim:] - last.mean(0)) / last.std(0)) @ w  # noqa: E731
        target = {name: readout(ref[name]) + noise * rng.randn(len(ref[name])) for name in part}
    else:
        target = {name: np.array([int(r[2] == "rich") for r in part[name]]) for name in part}
    data = {name: Encoded([TOK.encode(r[1]) for r in part[name]], list(target[name])) for name in part}
    scale = (float(target["train"].mean()), float(target["train"].std())) if task == "regression" else (0.0, 1.0)
    torch.manual_seed(0)
    net = FineTuneNet(encoder, task, 1 if task == "regression" else 2, "layers", dropout=0.0).eval()
    chosen, summary, (X, y, pipe) = choose_pooling(net, data, 1200, scale, "loss", 0.9, seed=0, by_cv=True,
                                                   choices=("mean", "layers"))

    t = (target["train"] - scale[0]) / scale[1]
    loss = {pooling: cross_validated_log_loss(ref["train"][:, cols], t.astype(int)) if task == "classification"
            else leave_one_out_squared_error(ref["train"][:, cols], t)
            for pooling, cols in (("mean", slice(depth * dim, None)), ("layers", slice(None)))}
    assert summary["by"] == "cv" and summary["split"] == "train"
    assert summary["cv_loss"] == pytest.approx(loss, rel=1e-3)
    assert abs(loss["layers"] - loss["mean"]) > 0.04 * min(loss.values())  # a choice with a margin
    assert chosen == min(loss, key=loss.get) == expect == summary["chosen"]
    cols = slice(None) if chosen == "layers" else slice(depth * dim, None)
    np.testing.assert_allclose(X, ref["train"][:, cols], atol=1e-5)  # the chosen features feed the head's probe
    np.testing.assert_allclose(y, target["train"], atol=1e-6)
    assert pipe[0].n_features_in_ == X.shape[1]


def signal_at_start_or_within(tmp_path, n, seed):
    """labels.csv of ``n`` random proteins of 120 to 200 residues, each holding one hydrophobic stretch of 20
    (a signal peptide's core): "start" at residue 1, "within" in the middle (residues len/2 - 10 onwards, at
    least 50 from either end). Both classes have the same composition; only where the stretch lies tells
    them apart, which the mean over a protein's first TERMINUS residues sees and the whole-protein means
    hardly do. Split test / valid / train by position, as rich_or_poor. (its rows, its path)"""
    import random
    rng, aa = random.Random(seed), "ACDEFGHIKLMNPQRSTVWY"
    rows = []
    for k in range(n):
        length, label = rng.randint(120, 200), "start" if k % 2 else "within"
        s = [rng.choice(aa) for _ in range(length)]
        at = 0 if label == "start" else length // 2 - 10
        s[at:at + 20] = [rng.choice("LLLAVIF") for _ in range(20)]
        rows.append([f"p{k}", "".join(s), label, "test" if k % 5 == 0 else "valid" if k % 5 == 1 else "train"])
    labels = tmp_path / "ends.csv"
    with open(labels, "w", newline="") as fh:
        csv.writer(fh).writerows([("id", "sequence", "label", "split"), *rows])
    return rows, labels


def test_termini_is_chosen_where_only_the_ends_tell_by_hand(ckpt, tmp_path):  # noqa: F811
    rows, _ = signal_at_start_or_within(tmp_path, 200, seed=0)
    part = {name: [r for r in rows if r[3] == name] for name in ("train", "valid")}
    target = {name: np.array([int(r[2] == "start") for r in part[name]]) for name in part}
    data = {name: Encoded([TOK.encode(r[1]) for r in part[name]], list(target[name])) for name in part}
    encoder = ckpt[0].model.encoder
    dim, depth = encoder.config.dim, encoder.depth
    torch.manual_seed(0)
    net = FineTuneNet(encoder, "classification", 2, "termini", dropout=0.0).eval()
    chosen, summary, (X, y, pipe) = choose_pooling(net, data, 4000, (0.0, 1.0), "accuracy", 0.9, seed=0,
                                                   choices=("mean", "layers", "termini"))

    ref = {name: reference_features(encoder, [r[1] for r in part[name]], layers=True, ends=TERMINUS) for name in part}
    cols = {"mean": slice(depth * dim, (depth + 1) * dim), "layers": slice(0, (depth + 1) * dim), "termini": slice(None)}
    accuracy = {}
    for pooling, c in cols.items():
        fitted = make_probe("classification", 3, 0).fit(ref["train"][:, c], target["train"])
        accuracy[pooling] = float(np.mean(fitted.predict(ref["valid"][:, c]) == target["valid"]))
    assert summary["probe"] == pytest.approx(accuracy, abs=1.5 / len(part["valid"]))  # at most one protein apart
    assert accuracy["termini"] > 0.9 > max(accuracy["mean"], accuracy["layers"]) + 0.15  # only the ends tell
    assert chosen == summary["chosen"] == "termini" and summary["ahead"]["termini"]["confidence"] >= 0.9
    assert summary["ahead"]["termini"]["over"] in ("mean", "layers")  # whichever the ladder held before
    np.testing.assert_allclose(X, ref["train"], atol=1e-5)  # the head's probe gets every column, protein by protein
    np.testing.assert_array_equal(y, target["train"])
    assert pipe[0].n_features_in_ == (depth + 3) * dim


def test_an_auto_run_that_chose_termini_is_the_plain_termini_run(ckpt, tmp_path):  # noqa: F811
    _, labels = signal_at_start_or_within(tmp_path, 120, seed=1)
    kw = dict(lr=1e-3, head_lr=1e-2, dropout=0.0, patience=10, max_tokens=4000,
              trainer={"max_epochs": 1, "enable_progress_bar": False}, progress_every=None, progress_seconds=None)
    auto = FT.finetune(ckpt[1], labels, "classification", tmp_path / "auto", pooling="auto",
                       pooling_choices=["mean", "layers", "termini"], **kw)
    assert auto["pooling"]["chosen"] == "termini" and auto["pooling"]["choices"] == ["mean", "layers", "termini"]
    assert "pooling=auto: termini (valid accuracy of a linear probe: mean " in FT.format_metrics(auto)
    plain = FT.finetune(ckpt[1], labels, "classification", tmp_path / "plain", pooling="termini", **kw)
    assert read_predictions(tmp_path / "auto") == read_predictions(tmp_path / "plain")
    assert auto["selection"] == plain["selection"] and auto["accuracy"] == plain["accuracy"]
    assert json.loads((tmp_path / "auto" / "finetune.json").read_text())["pooling"] == "termini"

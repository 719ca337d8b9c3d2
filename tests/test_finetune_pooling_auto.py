"""finetune's pooling=auto: the last layer's mean or every layer's, whichever a linear probe scores higher on
the validation split (surely enough: the bootstrap gate).  Checked against features computed protein by
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
from protein_performer.model.heads import FineTuneNet
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
    chosen, summary, (X, y, _) = choose_pooling(net, data, 1200, (0.0, 1.0), "accuracy", min_confidence, seed=0)

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
    confidence = summary["layers_over_mean"]
    assert 0.5 < confidence < 0.9
    assert chosen == ("layers" if min_confidence == 0.0 else "mean") == summary["chosen"]
    # the training features handed to the head's probe: the chosen pooling's, protein by protein
    cols = slice(None) if chosen == "layers" else slice(depth * dim, None)
    np.testing.assert_allclose(X, ref["train"][:, cols], atol=1e-5)
    np.testing.assert_array_equal(y, labels["train"])


def read_predictions(out):
    with open(out / "predictions.csv", newline="") as fh:
        return list(csv.reader(fh))


@pytest.mark.parametrize("confidence,expect", [(0.0, "layers"), (0.9, "mean")])
def test_an_auto_run_is_the_plain_run_of_the_pooling_it_chose(ckpt, tmp_path, confidence, expect):  # noqa: F811
    _, labels = rich_or_poor(tmp_path, 200, seed=3)
    kw = dict(lr=1e-3, head_lr=1e-2, dropout=0.0, patience=10, pooling_confidence=confidence, max_tokens=1200,
              trainer={"max_epochs": 2, "enable_progress_bar": False}, progress_every=None, progress_seconds=None)
    runs = {}
    for pooling in ("auto", expect):
        out = tmp_path / pooling
        result = FT.finetune(ckpt[1], labels, "classification", out, pooling=pooling, **kw)
        if pooling == "auto":  # the closing line says what was chosen, and on what
            assert f"pooling=auto: {expect} (valid accuracy of a linear probe: mean " in FT.format_metrics(result)
        runs[pooling] = (out, json.loads((out / "metrics.json").read_text()),
                         json.loads((out / "finetune.json").read_text()))
    auto, plain = runs["auto"], runs[expect]
    assert auto[1]["pooling"]["chosen"] == expect and "pooling" not in plain[1]
    assert auto[2]["pooling"] == plain[2]["pooling"] == expect  # what load_finetuned rebuilds
    assert read_predictions(auto[0]) == read_predictions(plain[0])
    assert auto[1]["selection"] == plain[1]["selection"] and auto[1]["accuracy"] == plain[1]["accuracy"]


def test_residue_tasks_take_auto_as_mean_and_a_bad_pooling_is_one_line(ckpt, tmp_path, capsys):  # noqa: F811
    rows, labels = rich_or_poor(tmp_path, 40, seed=1)
    code, _, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                               f"output_dir={tmp_path / 'bad'}", "pooling=max")
    assert code == 2 and "pooling='max': choose one of mean, attention, layers or auto" in err
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

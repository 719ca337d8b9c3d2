"""finetune's output-space ensemble (issue 45): by default the fine-tuned candidate is 0.5 of the best
epoch's probabilities (regression: values) and 0.5 of the linear probe's. Checked against hand-computed
mixes, against a probe refitted here with scikit-learn on features computed protein by protein, and
against the two member networks run apart; the probe's member is the checkpoint's encoder bit for bit."""
import csv
import json
import math

import numpy as np
import pytest
import torch

from protein_performer import finetune as FT
from protein_performer.hub.hf_code.modeling_protein_performer import mix_outputs as hf_mix_outputs
from protein_performer.hub.load import load_finetuned
from protein_performer.model.heads import FineTuneNet, mix_outputs
from protein_performer.probe import make_probe

from conftest import run_command
from test_finetune_probe_init import (TOK, ckpt, no_valid_rows, reference_features,  # noqa: F401 (a fixture)
                                     rich_or_poor)


def test_mix_outputs_by_hand():
    # probabilities (0.2, 0.8) and (0.6, 0.4), as logits with arbitrary offsets: the mean is (0.4, 0.6)
    tuned = torch.log(torch.tensor([[0.2, 0.8]])) + 3.0
    probe = torch.log(torch.tensor([[0.6, 0.4]])) - 7.0
    torch.testing.assert_close(torch.softmax(mix_outputs(tuned, probe, 0.5, "classification"), -1),
                               torch.tensor([[0.4, 0.6]]))
    # share 0.75: 0.75 * 0.2 + 0.25 * 0.6 = 0.3
    torch.testing.assert_close(torch.softmax(mix_outputs(tuned, probe, 0.75, "classification"), -1),
                               torch.tensor([[0.3, 0.7]]))
    # regression: standardized values, 0.25 * 2 + 0.75 * 6 = 5
    assert float(mix_outputs(torch.tensor([[2.0]]), torch.tensor([[6.0]]), 0.25, "regression")) == 5.0
    # logits far apart in size: no overflow, and the mix is still the mean of the probabilities
    big = mix_outputs(torch.tensor([[1e4, -1e4]]), torch.tensor([[-1e4, 1e4]]), 0.5, "residue")
    assert torch.isfinite(big).all()
    torch.testing.assert_close(torch.softmax(big, -1), torch.tensor([[0.5, 0.5]]))


def test_the_exported_code_mixes_as_the_package_does():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 9, 3, generator=g) * 5, torch.randn(4, 9, 3, generator=g) * 5
    for task in ("classification", "regression", "residue"):
        for share in (0.3, 0.5):
            torch.testing.assert_close(hf_mix_outputs(a, b, share, task), mix_outputs(a, b, share, task))


def test_attach_probe_refuses_a_share_outside_the_open_interval(ckpt):  # noqa: F811
    net = FineTuneNet(ckpt[0].model.encoder, "classification", 2, dropout=0.0)
    other = FineTuneNet(ckpt[0].model.encoder, "classification", 2, dropout=0.0)
    for share in (0.0, 1.0, 1.5):
        with pytest.raises(Exception, match="share of the mix"):
            net.attach_probe(other, share)


def test_the_default_ensemble_predicts_the_mean_of_the_epochs_and_the_probes_probabilities(ckpt, tmp_path):  # noqa: F811
    rows, labels = rich_or_poor(tmp_path, 200, seed=10)
    out = tmp_path / "out"
    FT.finetune(ckpt[1], labels, "classification", out, lr=3e-3, head_lr=1e-2, dropout=0.0, patience=10,
                min_confidence=0, epoch_confidence=1.0, max_tokens=1200, pooling="mean",
                trainer={"max_epochs": 3, "enable_progress_bar": False}, progress_every=None, progress_seconds=None)
    m = json.loads((out / "metrics.json").read_text())
    meta = json.loads((out / "finetune.json").read_text())
    sel = m["selection"]
    epochs = [c for c in sel["candidates"] if c["name"].startswith("epoch ")]
    best = max(enumerate(epochs), key=lambda ic: (ic[1]["accuracy"], -ic[1]["loss"], -ic[0]))[1]
    assert sel["kept"] == f"ensemble: 0.5 {best['name']} + 0.5 probe" == sel["candidates"][-1]["name"]
    assert meta["ensemble"] == 0.5 and m["best_epoch"] == int(best["name"].split()[1])

    net, _ = load_finetuned(out)
    assert net.probe is not None and net.share == 0.5
    # the probe's member: the checkpoint's encoder, bit for bit, and the head of a probe refitted here
    for k, v in ckpt[0].model.encoder.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(net.probe.encoder.state_dict()[k], v), k
    encoder = ckpt[0].model.encoder.eval()
    classes = sorted({r[2] for r in rows})
    train, test = [r for r in rows if r[3] == "train"], [r for r in rows if r[3] == "test"]
    pipe = make_probe("classification", folds=3, seed=0).fit(
        reference_features(encoder, [r[1] for r in train]), [classes.index(r[2]) for r in train])
    probe_p = pipe.predict_proba(reference_features(encoder, [r[1] for r in test]))
    # the fine-tuned member alone: its own weights in a plain network, protein by protein
    tuned = FineTuneNet(net.encoder, "classification", len(classes), dropout=0.0).eval()
    tuned.head.load_state_dict(net.head.state_dict())
    with torch.no_grad():
        tuned_p = np.array([torch.softmax(tuned(torch.tensor([TOK.encode(r[1])]))[0].double(), -1).numpy()
                            for r in test])
    assert np.abs(tuned_p - probe_p).max() > 0.05  # two different members: the mix is not either one
    expected = 0.5 * tuned_p + 0.5 * probe_p
    with open(out / "predictions.csv", newline="") as fh:
        written = list(csv.DictReader(fh))
    np.testing.assert_allclose([float(r["score"]) for r in written], expected[:, 1], atol=1e-3)
    assert [r["prediction"] for r in written] == [classes[i] for i in expected.argmax(1)]
    right = np.mean([r["prediction"] == r["label"] for r in written])
    assert m["accuracy"] == pytest.approx(right)


def test_ensemble_1_keeps_the_epoch_alone_and_bad_values_are_one_line(ckpt, tmp_path, capsys):  # noqa: F811
    _, labels = rich_or_poor(tmp_path, 120, seed=3)
    out = tmp_path / "alone"
    code, stdout, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                    f"output_dir={out}", "ensemble=1", "min_confidence=0", "trainer.max_epochs=1",
                                    "max_tokens=1200")
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert not any(c["name"].startswith("ensemble") for c in m["selection"]["candidates"])
    assert json.loads((out / "finetune.json").read_text())["ensemble"] is None
    net, _ = load_finetuned(out)
    assert net.probe is None
    for bad in ("0", "1.5", "true"):
        code, _, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                   f"output_dir={tmp_path / ('bad' + bad)}", f"ensemble={bad}")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "ensemble=" in err, err
        assert not (tmp_path / ("bad" + bad)).exists()
    assert math.isclose(FT.ENSEMBLE, 0.5) and math.isclose(FT.EPOCH_CONFIDENCE, 0.9)


def test_epoch_confidence_keeps_the_epoch_alone_only_where_it_beats_the_mix_that_surely(ckpt, tmp_path):  # noqa: F811
    """epoch_confidence c < 1: the best epoch alone replaces the mix when it wins c of the validation bootstrap's
    draws against it; the weights kept are then the ensemble's fine-tuned member, bit for bit, predicting alone."""
    rows, labels = rich_or_poor(tmp_path, 200, seed=10)
    kw = dict(lr=3e-3, head_lr=1e-2, dropout=0.0, patience=10, min_confidence=0, max_tokens=1200,
              trainer={"max_epochs": 3, "enable_progress_bar": False}, progress_every=None, progress_seconds=None)
    runs = {}
    for name, c in (("mix", 1.0), ("alone", 0.0)):
        out = tmp_path / name
        result = FT.finetune(ckpt[1], labels, "classification", out, **kw, epoch_confidence=c)
        runs[name] = out, json.loads((out / "metrics.json").read_text())["selection"]
        # the closing line says whether the epoch stands alone, and how sure validation was
        assert ("alone, not mixed with the probe: ahead of the mix in" in FT.format_metrics(result)) == (c == 0.0)
    mix, alone = runs["mix"][1], runs["alone"][1]
    assert mix["kept"].startswith("ensemble: 0.5 epoch ") and "epoch_over_mix" not in mix  # 1: never
    best = mix["kept"].split()[2:4]  # ["epoch", "N"]
    assert alone["epoch_alone"] is True and alone["kept"] == " ".join(best)
    assert 0 <= alone["epoch_over_mix"] <= 1
    assert json.loads((runs["alone"][0] / "finetune.json").read_text())["ensemble"] is None
    mixed, _ = load_finetuned(runs["mix"][0])
    kept, _ = load_finetuned(runs["alone"][0])
    assert kept.probe is None
    member = {**{f"encoder.{k}": v for k, v in mixed.encoder.state_dict().items()},
              **{f"head.{k}": v for k, v in mixed.head.state_dict().items()}}
    own = kept.state_dict()
    assert member.keys() == own.keys()
    assert all(torch.equal(own[k], v) if isinstance(v, torch.Tensor) else own[k] == v for k, v in member.items())
    classes = sorted({r[2] for r in rows})
    test = [r for r in rows if r[3] == "test"]
    with torch.no_grad():
        p = np.array([torch.softmax(kept(torch.tensor([TOK.encode(r[1])]))[0].double(), -1).numpy() for r in test])
    with open(runs["alone"][0] / "predictions.csv", newline="") as fh:
        written = list(csv.DictReader(fh))
    np.testing.assert_allclose([float(r["score"]) for r in written], p[:, 1], atol=1e-4)
    # just above the epoch's confidence (or 1: never), the mix stays
    out = tmp_path / "above"
    FT.finetune(ckpt[1], labels, "classification", out, **kw,
                epoch_confidence=min(1.0, alone["epoch_over_mix"] + 1e-3))
    above = json.loads((out / "metrics.json").read_text())["selection"]
    assert above["kept"] == mix["kept"] and not above.get("epoch_alone", False)


# issue 45: without valid rows finetune draws its validation proteins from the training ones; once a mix is
# kept, its probe half is fitted again on all of them (refit_probe), as a kept probe is
@pytest.mark.parametrize("refit", [True, False])
def test_a_kept_mixs_probe_half_is_refitted_on_the_held_out_validation_proteins_too(ckpt, tmp_path, capsys,  # noqa: F811
                                                                                     refit):
    rows, labels = no_valid_rows(tmp_path, 200, seed=10)
    out = tmp_path / "out"
    code, stdout, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                    f"output_dir={out}", "lr=3e-3", "head_lr=1e-2", "dropout=0.0", "patience=10",
                                    "min_confidence=0", "epoch_confidence=1", "pooling=mean", "max_tokens=1200",
                                    "trainer.max_epochs=3", f"refit_probe={str(refit).lower()}")
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    train, test = [r for r in rows if r[3] == "train"], [r for r in rows if r[3] == "test"]
    assert m["selection"]["kept"].startswith("ensemble: 0.5 epoch ")
    assert m["probe"]["examples"] == len(train) - m["proteins"]["valid"] < len(train) == 160
    if not refit:
        assert "refit" not in m["probe"] and "fitted again" not in stdout
        return
    assert m["probe"]["refit"]["examples"] == len(train)
    assert f"its probe half then fitted again on all {len(train)} training proteins" in stdout
    encoder, classes = ckpt[0].model.encoder.eval(), sorted({r[2] for r in rows})
    pipe = make_probe("classification", folds=3, seed=0).fit(
        reference_features(encoder, [r[1] for r in train]), [classes.index(r[2]) for r in train])
    assert m["probe"]["refit"]["C"] == pytest.approx(float(np.ravel(pipe[-1].C_)[0]))
    net, _ = load_finetuned(out)
    with torch.no_grad():  # the probe member alone, protein by protein: the probe fitted here on all 160
        member_p = np.array([torch.softmax(net.probe(torch.tensor([TOK.encode(r[1])]))[0].double(), -1).numpy()
                             for r in test])
    np.testing.assert_allclose(member_p, pipe.predict_proba(reference_features(encoder, [r[1] for r in test])),
                               atol=1e-4)

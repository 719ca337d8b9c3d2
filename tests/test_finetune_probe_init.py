"""head_init=probe (LP-FT): the untrained head predicts what scikit-learn's probe predicts, with the
features computed here protein by protein (no batching, no padding) and the probe refitted here;
an attention-pooling head starts at the plain mean; a fine-tune that cannot move (learning rates 0)
or can only get worse keeps the probed start: its test predictions are the probe's."""
import copy
import csv
import json
import random

import numpy as np
import pytest
import torch

from protein_performer import finetune as FT
from protein_performer.model.heads import TERMINUS, FineTuneNet
from protein_performer.probe import make_probe
from protein_performer.tokenizer import Tokenizer

from protein_performer.training.task import ProteinLM

from conftest import TINY_MODEL, run_command, save_checkpoint

AA = "ACDEFGHIKLMNPQRSTVWY"
TOK = Tokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    task = ProteinLM(model=TINY_MODEL, objective="mlm").eval()
    return task, save_checkpoint(task, tmp_path_factory.mktemp("lpft") / "mlm.ckpt")


def proteins(n, seed=0, lengths=(15, 45)):
    rng = random.Random(seed)
    return ["".join(rng.choice(AA) for _ in range(rng.randint(*lengths))) for _ in range(n)]


def reference_features(encoder, seqs, per_residue=False, window=0, layers=False, ends=0):
    """The encoder's output for each protein alone: mean over its residues, or each residue's (with
    ``window`` w, beside the sum of its residues' outputs within w of it over 2w + 1, by a loop);
    ``layers``: the mean of every hidden state (embedding, each block, final norm), side by side, and with
    ``ends`` = k the last one's mean over the protein's first k and its last k residues (pooling=termini)."""
    rows = []
    with torch.no_grad():
        for s in seqs:
            if layers:
                _, hs = encoder(torch.tensor([TOK.encode(s)]), return_layers=True)
                assert len(hs) == encoder.depth + 1
                own = [h[0, 1:1 + len(s)].double().numpy() for h in hs]
                rows.append(np.concatenate([h.mean(0) for h in own] + ([own[-1][:ends].mean(0), own[-1][-ends:].mean(0)]
                                                                       if ends else []))[None])
                continue
            h = encoder(torch.tensor([TOK.encode(s)]))[0, 1:1 + len(s)].double().numpy()
            if per_residue and window:
                around = [h[max(0, i - window):i + window + 1].sum(0) / (2 * window + 1) for i in range(len(s))]
                h = np.concatenate([h, np.array(around)], 1)
            rows.append(h if per_residue else h.mean(0, keepdims=True))
    return np.concatenate(rows)


def net_outputs(net, seqs):
    with torch.no_grad():
        return [net(torch.tensor([TOK.encode(s)]))[0].double() for s in seqs]


def make_net(ckpt, task, n_out, pooling="mean", window=0):
    torch.manual_seed(0)
    return FineTuneNet(copy.deepcopy(ckpt[0].model.encoder), task, n_out, pooling, dropout=0.0, window=window).eval()


@pytest.mark.parametrize("n_classes,pooling", [(2, "mean"), (3, "mean"), (3, "attention"), (3, "layers"),
                                               (3, "termini")])
def test_probed_head_gives_the_probes_probabilities(ckpt, n_classes, pooling):
    # termini: proteins shorter than, and more than twice, TERMINUS residues (their ends apart), in one batch
    seqs = proteins(90, lengths=(30, 130) if pooling == "termini" else (15, 45))
    # labels that the features can partly tell: by the share of K and D
    y = np.array([min(n_classes - 1, int(3 * (s.count("K") + s.count("D")) / len(s) * n_classes / 0.6))
                  for s in seqs])
    assert len(set(y)) == n_classes
    net = make_net(ckpt, "classification", n_classes, pooling)
    data = FT.Encoded([np.array(TOK.encode(s)) for s in seqs], [int(v) for v in y])
    fitted = FT.probe_head_init(net, data, max_tokens=400, scale=(0.0, 1.0), seed=0)

    X = reference_features(net.encoder, seqs, layers=pooling in ("layers", "termini"),
                           ends=TERMINUS if pooling == "termini" else 0)
    width = {"layers": net.encoder.depth + 1, "termini": net.encoder.depth + 3}.get(pooling, 1)
    assert X.shape[1] == net.encoder.config.dim * width
    pipe = make_probe("classification", folds=3, seed=0).fit(X, y)
    assert fitted["C"] == pytest.approx(float(np.atleast_1d(pipe[-1].C_)[0]))
    probs = torch.stack([torch.softmax(o, -1) for o in net_outputs(net.eval(), seqs)]).numpy()
    # float32 encoder and head (batched, padded) against float64 features of each protein alone
    np.testing.assert_allclose(probs, pipe.predict_proba(X), atol=1e-3)
    assert (probs.argmax(1) == pipe.predict(X)).mean() > 0.95
    assert len(np.unique(probs.argmax(1))) > 1  # not a constant predictor


def test_probed_regression_head_gives_the_ridge_prediction(ckpt):
    seqs = proteins(80, seed=1)
    y = np.array([5.0 + 20 * s.count("W") / len(s) + 0.1 * (i % 3) for i, s in enumerate(seqs)])
    scale = (float(y.mean()), float(y.std()))
    net = make_net(ckpt, "regression", 1)
    data = FT.Encoded([np.array(TOK.encode(s)) for s in seqs], [float(v) for v in y])
    fitted = FT.probe_head_init(net, data, max_tokens=400, scale=scale, seed=0)

    X = reference_features(net.encoder, seqs)
    pipe = make_probe("regression").fit(X, (y - scale[0]) / scale[1])
    assert fitted["alpha"] == pytest.approx(float(pipe[-1].alpha_))
    pred = np.array([float(o[0]) for o in net_outputs(net, seqs)]) * scale[1] + scale[0]
    np.testing.assert_allclose(pred, pipe.predict(X) * scale[1] + scale[0], atol=1e-4)
    assert np.std(pred) > 0.01


@pytest.mark.parametrize("window", [0, 2])
def test_probed_residue_head_gives_the_probes_probabilities(ckpt, window):
    """Per residue, with a window the probe also sees the neighbours' mean, and the head's convolution
    carries it: the net's probabilities are those of a probe refitted on features computed by a loop."""
    seqs = proteins(30, seed=2)
    helix = set("AELMQKRH")
    # a label that depends on the neighbours too (helix formers around the residue), so the window matters
    targets = [np.array([0 if sum(c in helix for c in s[max(0, i - 2):i + 3]) >= 3 else 1 if s[i] in "VIYFWT" else 2
                         for i in range(len(s))]) for s in seqs]
    net = make_net(ckpt, "residue", 3, window=window)
    data = FT.Encoded([np.array(TOK.encode(s)) for s in seqs], targets)
    assert sum(map(len, targets)) < FT.PROBE_RESIDUES  # every residue is fitted on: the reference can refit
    FT.probe_head_init(net, data, max_tokens=400, scale=(0.0, 1.0), seed=0)

    X, y = reference_features(net.encoder, seqs, per_residue=True, window=window), np.concatenate(targets)
    assert X.shape[1] == net.encoder.config.dim * (2 if window else 1)
    pipe = make_probe("classification", folds=3, seed=0).fit(X, y)
    probs = np.concatenate([torch.softmax(o[1:1 + len(s)], -1).numpy() for o, s in zip(net_outputs(net, seqs), seqs)])
    np.testing.assert_allclose(probs, pipe.predict_proba(X), atol=1e-3)
    if window:  # the neighbours' coefficients are in use: the window's weights are not all zero
        assert net.head.context.weight.abs().max() > 0


def rich_or_poor(tmp_path, n, seed):
    """labels.csv of ``n`` random proteins, "rich" in K + E above 10 % else "poor", split test / valid /
    train by position (every 5th, the next, the rest): (its rows, its path)."""
    label = lambda s: "rich" if s.count("K") + s.count("E") > 0.1 * len(s) else "poor"  # noqa: E731
    rows = [[f"p{k}", s, label(s), "test" if k % 5 == 0 else "valid" if k % 5 == 1 else "train"]
            for k, s in enumerate(proteins(n, seed=seed))]
    labels = tmp_path / "labels.csv"
    with open(labels, "w", newline="") as fh:
        csv.writer(fh).writerows([("id", "sequence", "label", "split"), *rows])
    return rows, labels


def no_valid_rows(tmp_path, n, seed):
    """rich_or_poor's proteins with no valid rows (its valid ones train): finetune then draws its own."""
    rows, _ = rich_or_poor(tmp_path, n, seed)
    rows = [[r[0], r[1], r[2], "test" if r[3] == "test" else "train"] for r in rows]
    labels = tmp_path / "no_valid.csv"
    with open(labels, "w", newline="") as fh:
        csv.writer(fh).writerows([("id", "sequence", "label", "split"), *rows])
    return rows, labels


# learning rates 0: the weights cannot move; 5 / 50: every epoch wrecks them, so only keeping the
# validated probe gives the probe's predictions; head_init=random too (issue 45: the default never ends
# below its own linear probe: the probe is fitted and validated whatever the start)
@pytest.mark.parametrize("head_init", ["probe", "random"])
@pytest.mark.parametrize("rates", [("0", "0"), ("5", "50")])
def test_a_finetune_that_cannot_improve_keeps_the_probe(ckpt, tmp_path, capsys, rates, head_init):
    rows, labels = rich_or_poor(tmp_path, 150, seed=3)
    out = tmp_path / "out"
    code, stdout, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                f"output_dir={out}", f"head_init={head_init}", f"lr={rates[0]}",
                                f"head_lr={rates[1]}", "weight_decay=0", "dropout=0.0", "pooling=mean",
                                "trainer.max_epochs=2", "max_tokens=1200")
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert m["head_init"] == head_init and m["best_epoch"] == 0
    sel = m["selection"]
    assert sel["by"] == "accuracy" and sel["split"] == "valid" and sel["kept"] == "probe"
    names = [c["name"] for c in sel["candidates"]]
    epochs = [f"epoch {e + 1}" for e in range(len(names) - 2)]
    # the default ensemble (0.5 of the best epoch's probabilities and 0.5 of the probe's) is validated last
    assert names[0] == "probe" and names[1:-1] == epochs and names[-1].startswith("ensemble: 0.5 epoch ")
    assert all(c["accuracy"] <= sel["candidates"][0]["accuracy"] for c in sel["candidates"])
    assert sel["best_tuned"] == names[-1] and sel["confidence"] < 0.9  # the gate keeps the probe
    assert "kept: probe (valid accuracy" in stdout and "below min_confidence 0.9" in stdout
    # the probe kept: the network stands alone again (one encoder saved, no ensemble recorded)
    assert json.loads((out / "finetune.json").read_text())["ensemble"] is None

    train = [r for r in rows if r[3] == "train"]
    test = [r for r in rows if r[3] == "test"]
    encoder = ckpt[0].model.encoder.eval()
    classes = sorted({r[2] for r in rows})
    pipe = make_probe("classification", folds=3, seed=0).fit(
        reference_features(encoder, [r[1] for r in train]), [classes.index(r[2]) for r in train])
    expected = [classes[i] for i in pipe.predict(reference_features(encoder, [r[1] for r in test]))]
    with open(out / "predictions.csv", newline="") as fh:
        got = [r["prediction"] for r in csv.DictReader(fh)]
    assert got == expected
    assert 0 < sum(g == "rich" for g in got) < len(got)


def test_window_head_is_the_hand_computed_convolution_over_residues_and_ignores_padding():
    from protein_performer.model.heads import TokenClassificationHead, residue_mask
    torch.manual_seed(0)
    w, dim, n = 2, 8, 3
    head = TokenClassificationHead(dim, n, dropout=0.0, window=w).eval()
    assert head.context.weight.abs().max() == 0          # starts as the plain linear head
    torch.nn.init.normal_(head.context.weight)
    seqs = ["ACDEFG", "KLMNPQRSTVW"]
    tokens = [list(TOK.encode(s)) for s in seqs]
    L = max(map(len, tokens))
    batch = torch.tensor([t + [TOK.pad_id] * (L - len(t)) for t in tokens])
    hidden = torch.randn(2, L, dim, dtype=torch.float64)
    with torch.no_grad():
        head = head.double()
        got = head(hidden, residue_mask(batch))
        for b, s in enumerate(seqs):
            for i in range(1, 1 + len(s)):               # residue positions (after <cls>)
                want = head.out.weight @ hidden[b, i] + head.out.bias
                for o in range(-w, w + 1):
                    j = i + o
                    if 1 <= j <= len(s):                 # neighbours that are residues of the same protein
                        want = want + head.context.weight[:, :, o + w] @ hidden[b, j]
                torch.testing.assert_close(got[b, i], want, atol=1e-12, rtol=0)
        # the short protein alone (no padding) gives the same outputs at its residues
        alone = head(hidden[:1, :len(tokens[0])], residue_mask(batch[:1, :len(tokens[0])]))
        torch.testing.assert_close(alone[0, 1:7], got[0, 1:7], atol=1e-12, rtol=0)


def test_window_is_refused_where_it_means_nothing(ckpt):
    from protein_performer.errors import UserError
    with pytest.raises(UserError, match="task=residue"):
        FineTuneNet(ckpt[0].model.encoder, "classification", 2, window=3)
    with pytest.raises(UserError, match="window=-1"):
        FineTuneNet(ckpt[0].model.encoder, "residue", 3, window=-1)


def test_the_kept_weights_are_the_best_on_validation_by_the_task_metric(ckpt, tmp_path, capsys):
    """A fine-tune that can learn: every candidate's validation accuracy in metrics.json is recomputed here
    from the saved candidates' rule (the kept one has the highest accuracy, ties to the lower loss, then the
    earlier); the closing line names it and its margin over the probe."""
    _, labels = rich_or_poor(tmp_path, 200, seed=5)
    code, stdout, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                    f"output_dir={tmp_path / 'out'}", "lr=3e-3", "head_lr=1e-2", "dropout=0.0",
                                    "trainer.max_epochs=4", "max_tokens=1200", "patience=10", "select_by=mcc",
                                    "min_confidence=0")  # the ranking alone (the gate: test_finetune_gate.py)
    assert code == 0, err
    sel = json.loads((tmp_path / "out" / "metrics.json").read_text())["selection"]
    assert sel["by"] == "mcc" and [c["name"] for c in sel["candidates"]][:2] == ["probe", "epoch 1"]
    ranked = sorted(enumerate(sel["candidates"]), key=lambda ic: (-ic[1]["mcc"], ic[1]["loss"], ic[0]))
    assert sel["kept"] == ranked[0][1]["name"]
    probe = sel["candidates"][0]["mcc"]
    assert sel["over_probe"] == pytest.approx(ranked[0][1]["mcc"] - probe) and sel["over_probe"] >= 0
    line = next(x for x in stdout.splitlines() if x.startswith("kept: "))
    assert line.startswith(f"kept: {sel['kept']} (valid mcc {ranked[0][1]['mcc']:.4f}")


def test_selection_metric_matches_sklearn_and_scipy():
    from scipy.stats import spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    y = torch.tensor([0, 1, 1, 0, 2])
    pred = [0, 1, 2, 0, 1]
    assert FT.selection_metric("classification", "accuracy", logits, y) == 3 / 5
    assert FT.selection_metric("classification", "macro_f1", logits, y) == pytest.approx(
        f1_score(y.numpy(), pred, average="macro"))
    assert FT.selection_metric("classification", "mcc", logits, y) == pytest.approx(matthews_corrcoef(y.numpy(), pred))
    values, target = torch.tensor([[0.1], [0.4], [0.2], [0.9]]), torch.tensor([1.0, 3.0, 2.0, 2.5])
    assert FT.selection_metric("regression", "spearman", values, target) == pytest.approx(
        spearmanr([0.1, 0.4, 0.2, 0.9], [1.0, 3.0, 2.0, 2.5]).statistic)   # 0.8
    assert np.isnan(FT.selection_metric("regression", "spearman", torch.ones(4, 1), target))


def test_a_held_out_validation_share_is_drawn_per_class(caplog):
    """No valid rows: a seeded valid_fraction of each class of the training proteins (90 'a', 30 'b', 10 %:
    9 and 3), said in one line; the test rows are never drawn from."""
    import logging
    labels = ["a"] * 90 + ["b"] * 30 + ["a"] * 20
    ex = FT.Examples([f"p{k}" for k in range(140)], ["MKV"] * 140, labels, ["train"] * 120 + ["test"] * 20)
    with caplog.at_level(logging.INFO, logger="protein_performer"):
        split = FT.assign_splits(ex, 0.1, 0.2, seed=0, source="l.csv", strata=labels)
    valid = [labels[i] for i in np.flatnonzero(split == "valid")]
    assert sorted(valid) == ["a"] * 9 + ["b"] * 3 and (split[120:] == "test").all()
    assert "no valid split given: 12 of the 120 training proteins held out for validation" in caplog.text


def test_interpolate_is_the_weighted_sum_of_floats_and_keeps_other_tensors():
    start = {"w": torch.tensor([0.0, 4.0]), "n": torch.tensor([1])}
    end = {"w": torch.tensor([8.0, 0.0]), "n": torch.tensor([7])}
    from protein_performer.finetune.module import interpolate
    got = interpolate(start, end, 0.25)
    assert torch.equal(got["w"], torch.tensor([2.0, 3.0])) and torch.equal(got["n"], torch.tensor([7]))


def test_interpolated_candidates_are_validated_from_the_probe_and_best_epoch_weights(ckpt, tmp_path, monkeypatch):
    """interpolate=true: after the epochs, 1/4, 1/2 and 3/4 of the way from the probe's weights (the
    checkpoint's encoder and a head equal to a probe refitted here) to the best epoch's are candidates.
    Each one's validation accuracy in metrics.json is recomputed here from weights mixed by hand, and
    the kept model.safetensors is the mix (or epoch, or probe) that ranks first."""
    from safetensors.torch import load_file

    import protein_performer.finetune.run as run
    seen = []
    real = run.interpolate
    monkeypatch.setattr(run, "interpolate", lambda a, b, s: seen.append((a, b, s)) or real(a, b, s))
    rows, labels = rich_or_poor(tmp_path, 200, seed=10)  # a seed where a mix ranks first
    out = tmp_path / "out"
    FT.finetune(ckpt[1], labels, "classification", out, lr=3e-3, head_lr=1e-2, dropout=0.0, patience=10,
                pooling="mean", interpolate=True, min_confidence=0, ensemble=1.0, max_tokens=1200, trainer={"max_epochs": 4, "enable_progress_bar": False}, progress_every=None,
                progress_seconds=None)
    m = json.loads((out / "metrics.json").read_text())
    cands = m["selection"]["candidates"]
    epochs = [c for c in cands if c["name"].startswith("epoch ")]
    best = max(enumerate(epochs), key=lambda ic: (ic[1]["accuracy"], -ic[1]["loss"], -ic[0]))[1]
    assert best["accuracy"] > cands[0]["accuracy"], "the fixture needs an epoch that beats the probe"
    assert [c["name"] for c in cands[-3:]] == [f"{s:g} {best['name']} + {1 - s:g} probe" for s in (0.25, 0.5, 0.75)]
    assert [s for _, _, s in seen] == [0.25, 0.5, 0.75]

    # the start is the probe's: the checkpoint's encoder and the head of a probe refitted here
    start, end = seen[0][0], seen[0][1]
    encoder = ckpt[0].model.encoder.eval()
    for k, v in encoder.state_dict().items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            torch.testing.assert_close(start[f"encoder.{k}"], v)
    train, valid = [r for r in rows if r[3] == "train"], [r for r in rows if r[3] == "valid"]
    classes = sorted({r[2] for r in rows})
    pipe = make_probe("classification", folds=3, seed=0).fit(
        reference_features(encoder, [r[1] for r in train]), [classes.index(r[2]) for r in train])
    X = reference_features(encoder, [r[1] for r in valid])
    head_logits = X @ start["head.out.weight"].double().numpy().T + start["head.out.bias"].double().numpy()
    np.testing.assert_allclose(torch.softmax(torch.tensor(head_logits), -1).numpy(), pipe.predict_proba(X), atol=1e-3)

    # each mix's validation accuracy, from weights mixed here
    net = make_net(ckpt, "classification", 2)
    y = [classes.index(r[2]) for r in valid]
    for (_, _, s), cand in zip(seen, cands[-3:]):
        net.load_state_dict({k: (1 - s) * start[k] + s * v if v.is_floating_point() else v for k, v in end.items()},
                            strict=False)
        pred = [int(o.argmax()) for o in net_outputs(net.eval(), [r[1] for r in valid])]
        assert np.mean(np.array(pred) == y) == pytest.approx(cand["accuracy"], abs=1.01 / len(y))

    ranked = sorted(enumerate(cands), key=lambda ic: (-ic[1]["accuracy"], ic[1]["loss"], ic[0]))
    assert m["selection"]["kept"] == ranked[0][1]["name"]
    assert " + " in ranked[0][1]["name"], "the fixture is meant to keep a mix"
    s = seen[[c["name"] for c in cands[-3:]].index(ranked[0][1]["name"])][2]
    kept = load_file(out / "model.safetensors")
    assert m["best_epoch"] == int(best["name"].split()[1])
    for name in ("head.out.weight", "encoder.blocks.0.attn.to_qkv.weight"):
        torch.testing.assert_close(kept[name], (1 - s) * start[name] + s * end[name])
    assert not torch.equal(start["encoder.blocks.0.attn.to_qkv.weight"], end["encoder.blocks.0.attn.to_qkv.weight"])


# issue 45: without valid rows finetune holds out a share of the training proteins to choose with; a kept probe
# is then fitted again on all of them (refit_probe, default true), so it is the probe a user fits on their
# training proteins, not one on 90 % of them
@pytest.mark.parametrize("refit", [True, False])
def test_a_kept_probe_is_refitted_on_the_held_out_validation_proteins_too(ckpt, tmp_path, capsys, refit):
    rows, labels = no_valid_rows(tmp_path, 150, seed=3)
    out = tmp_path / "out"
    code, stdout, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                    f"output_dir={out}", "lr=0", "head_lr=0", "pooling=mean", "trainer.max_epochs=1",
                                    "max_tokens=1200", f"refit_probe={str(refit).lower()}")
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    train = [r for r in rows if r[3] == "train"]
    held_out = m["proteins"]["valid"]
    assert m["selection"]["kept"] == "probe" and held_out == 12 and m["probe"]["examples"] == len(train) - held_out
    if not refit:
        assert "refit" not in m["probe"] and "fitted again" not in stdout
        return
    assert m["probe"]["refit"]["examples"] == len(train) == 120
    assert f"then fitted again on all {len(train)} training proteins, the validation proteins finetune had held" in stdout
    encoder, classes = ckpt[0].model.encoder.eval(), sorted({r[2] for r in rows})
    pipe = make_probe("classification", folds=3, seed=0).fit(
        reference_features(encoder, [r[1] for r in train]), [classes.index(r[2]) for r in train])
    assert m["probe"]["refit"]["C"] == pytest.approx(float(np.ravel(pipe[-1].C_)[0]))
    test = [r for r in rows if r[3] == "test"]
    expected = [classes[i] for i in pipe.predict(reference_features(encoder, [r[1] for r in test]))]
    with open(out / "predictions.csv", newline="") as fh:
        assert [r["prediction"] for r in csv.DictReader(fh)] == expected

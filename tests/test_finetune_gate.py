"""The gate between the linear probe and the fine-tuned weights (issue 45): the bootstrap confidence
against values computed by hand, and finetune keeping the probe below min_confidence (its encoder
bit-identical to the checkpoint's) and the fine-tuned weights at or above it, with the confidence in
metrics.json recomputed from the two nets' own validation predictions by an independent loop."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from protein_performer.finetune.confidence import Validated, bootstrap_confidence
from protein_performer.hub.load import load_finetuned

from conftest import run_command
from test_finetune_probe_init import TOK, ckpt, rich_or_poor  # noqa: F401 (ckpt: the fixture)


def logits_for(right: list[bool], targets: list[int]) -> torch.Tensor:
    """Two-class logits that predict ``targets`` where ``right``, the other class elsewhere."""
    pred = [t if r else 1 - t for r, t in zip(right, targets)]
    return torch.nn.functional.one_hot(torch.tensor(pred), 2).float()


def test_one_extra_right_protein_of_ten_is_ahead_unless_no_draw_holds_it():
    """Ten proteins; the tuned net is right on one more than the probe, the same elsewhere.  A draw ties
    exactly when it misses that protein, (9/10)^10 of the time, and a tie counts half: 1 - 0.9^10 / 2."""
    y = [0, 1] * 5
    probe = Validated(logits_for([True] * 5 + [False] * 5, y), torch.tensor(y), np.arange(10))
    tuned = Validated(logits_for([True] * 6 + [False] * 4, y), torch.tensor(y), np.arange(10))
    expected = 1 - 0.9 ** 10 / 2  # 0.8257
    assert bootstrap_confidence("classification", "accuracy", probe, tuned, draws=20000) == pytest.approx(expected, abs=0.01)
    # the other way round: ahead only on the draws that miss it, and half of them
    assert bootstrap_confidence("classification", "accuracy", tuned, probe, draws=20000) == pytest.approx(
        0.9 ** 10 / 2, abs=0.01)
    # one protein won each way: symmetric, 0.5
    swap = Validated(logits_for([True] * 5 + [False, True] + [False] * 3, y), torch.tensor(y), np.arange(10))
    assert bootstrap_confidence("classification", "accuracy", tuned, swap, draws=20000) == pytest.approx(0.5, abs=0.01)
    # the same predictions: every draw a tie
    assert bootstrap_confidence("classification", "accuracy", probe, probe, draws=200) == 0.5


def test_residue_tasks_draw_whole_proteins():
    """Ten proteins of 30 residues; the tuned net is right on 20 more residues, all in protein 0.  Drawn
    by protein, that is one protein's evidence (1 - 0.9^10 / 2); drawn by residue it would be near 1."""
    protein = np.repeat(np.arange(10), 30)
    y = np.zeros(300, dtype=int)
    base = np.arange(300) % 2 == 0
    better = base.copy()
    better[:30] = np.arange(30) < 25  # protein 0: 25 right instead of 15
    probe = Validated(logits_for(base.tolist(), y.tolist()), torch.tensor(y), protein)
    tuned = Validated(logits_for(better.tolist(), y.tolist()), torch.tensor(y), protein)
    assert bootstrap_confidence("residue", "residue_accuracy", probe, tuned, draws=20000) == pytest.approx(
        1 - 0.9 ** 10 / 2, abs=0.01)


def test_spearman_confidence_and_a_constant_prediction_loses():
    y = torch.arange(12.0)
    ordered = Validated(y[:, None] + 0.0, y, np.arange(12))
    reversed_ = Validated(-y[:, None], y, np.arange(12))
    constant = Validated(torch.ones(12, 1), y, np.arange(12))
    # a draw of one protein repeated is a NaN for both (a tie): 12 / 12^12 of the draws
    assert bootstrap_confidence("regression", "spearman", reversed_, ordered, draws=500) == 1.0
    assert bootstrap_confidence("regression", "spearman", ordered, reversed_, draws=500) == 0.0
    assert bootstrap_confidence("regression", "spearman", reversed_, constant, draws=500) == 0.0


def validation_outputs(out, rows):
    """The saved net's logits on the validation proteins, one protein at a time."""
    net, meta = load_finetuned(out)
    seqs = [r[1] for r in rows if r[3] == "valid"]
    with torch.no_grad():
        logits = torch.cat([net(torch.tensor([TOK.encode(s)])).float() for s in seqs])
    y = torch.tensor([meta["classes"].index(r[2]) for r in rows if r[3] == "valid"])
    return logits, y


def test_finetune_keeps_the_probe_below_min_confidence_and_the_epoch_at_it(ckpt, tmp_path, capsys):  # noqa: F811
    rows, labels = rich_or_poor(tmp_path, 200, seed=5)
    common = [f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification", "lr=3e-3", "head_lr=1e-2",
              "dropout=0.0", "trainer.max_epochs=4", "max_tokens=1200", "patience=10"]
    code, _, err = run_command("finetune", capsys, *common, f"output_dir={tmp_path / 'tuned'}", "min_confidence=0")
    assert code == 0, err
    tuned = json.loads((tmp_path / "tuned" / "metrics.json").read_text())["selection"]
    assert tuned["kept"] == tuned["best_tuned"] != "probe" and tuned["tuned_over_probe"] > 0
    confidence = tuned["confidence"]
    assert 0.5 < confidence < 1

    code, stdout, err = run_command("finetune", capsys, *common, f"output_dir={tmp_path / 'gated'}",
                                    f"min_confidence={(confidence + 1) / 2}")
    assert code == 0, err
    gated = json.loads((tmp_path / "gated" / "metrics.json").read_text())["selection"]
    assert gated["kept"] == "probe" and gated["over_probe"] == 0
    assert (gated["best_tuned"], gated["confidence"]) == (tuned["best_tuned"], confidence)  # the same run until then
    line = next(x for x in stdout.splitlines() if x.startswith("kept: probe"))
    assert f"{tuned['best_tuned']} scored {tuned['tuned_over_probe']:+.4f} above it but was ahead in only " \
           f"{confidence:.1%}" in line
    # the probe kept: the checkpoint's encoder, bit for bit, under the probed head
    saved = load_file(str(tmp_path / "gated" / "model.safetensors"))
    for k, v in ckpt[0].model.encoder.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(saved["encoder." + k], v), k

    # the confidence recomputed from the two saved nets' validation predictions, by a loop of its own draws
    (a, y), (b, _) = validation_outputs(tmp_path / "tuned", rows), validation_outputs(tmp_path / "gated", rows)
    right_a, right_b = (a.argmax(-1) == y).numpy(), (b.argmax(-1) == y).numpy()
    assert right_a.mean() - right_b.mean() == pytest.approx(tuned["tuned_over_probe"], abs=1e-9)
    rng, wins = np.random.default_rng(123), []
    for _ in range(4000):
        i = rng.integers(0, len(y), len(y))
        d = right_a[i].mean() - right_b[i].mean()
        wins.append(1.0 if d > 0 else 0.5 if d == 0 else 0.0)
    assert np.mean(wins) == pytest.approx(confidence, abs=0.04)

    code, _, err = run_command("finetune", capsys, *common, f"output_dir={tmp_path / 'at'}",
                               f"min_confidence={confidence}")
    assert code == 0, err
    assert json.loads((tmp_path / "at" / "metrics.json").read_text())["selection"]["kept"] == tuned["kept"]


@pytest.mark.parametrize("value", ["1.5", "-0.1", "yes"])
def test_a_bad_min_confidence_is_one_line_exit_2(ckpt, tmp_path, capsys, value):  # noqa: F811
    _, labels = rich_or_poor(tmp_path, 20, seed=1)
    code, _, err = run_command("finetune", capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                               f"output_dir={tmp_path / 'out'}", f"min_confidence={value}")
    assert code == 2 and err.startswith(f"error: min_confidence=") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()

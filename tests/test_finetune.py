"""Fine-tuning: learnable synthetic tasks beat a constant predictor on the test split; the
metrics equal scikit-learn / scipy recomputed from predictions.csv; Q3 by hand; freeze=all
leaves the encoder bit-identical and the saved weights reproduce the predictions; bad input
is one line naming file and line, exit 2, nothing written; output_dir holds only its files."""
import csv
import json
import os
import random
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from scipy.stats import spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef, roc_auc_score

from protein_performer import finetune as FT
from protein_performer.errors import UserError
from protein_performer.hub.load import load_finetuned
from protein_performer.training.task import ProteinLM
from protein_performer.tokenizer import Tokenizer

from conftest import ROOT, TINY_MODEL, dead_pid, run_command, save_checkpoint
from forkserver import forks

AA = "ACDEFGHIKLMNPQRSTVWY"
FAST = ["trainer.max_epochs=30", "trainer.max_steps=40", "head_lr=1e-2", "lr=3e-3", "dropout=0.0",
        "max_tokens=1200", "patience=30"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    task = ProteinLM(model=TINY_MODEL, objective="mlm").eval()
    return task, save_checkpoint(task, tmp_path_factory.mktemp("ft") / "mlm.ckpt")


def protein(rng, enriched=None, share=0.0):
    """A random protein of 20-40 residues; ``share`` of them (on average) ``enriched``."""
    return "".join(enriched if enriched and rng.random() < share else rng.choice(AA)
                   for _ in range(rng.randint(20, 40)))


def write_csv(path, rows, header=("id", "sequence", "label", "split")):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def run_finetune(capsys, *overrides):
    """``protein-performer finetune`` with ``overrides``: (exit status, stdout, stderr)."""
    return run_command("finetune", capsys, *overrides)

def predictions(out):
    with open(out / "predictions.csv", newline="") as fh:
        return list(csv.DictReader(fh))


# --- per protein ---------------------------------------------------------------------------
@pytest.mark.parametrize("classes", [("many_K", "few_K"), ("D", "K", "W")])
def test_classification_learns_and_metrics_equal_sklearn(classes, ckpt, tmp_path, capsys):
    rng = random.Random(1)
    rows = []
    for k in range(240):
        label = classes[k % len(classes)]
        enriched = ("K" if label == "many_K" else None) if len(classes) == 2 else label
        if rng.random() < 0.15:  # label noise: imperfect predictions, so the metrics say something
            label = rng.choice(classes)
        split = "test" if k % 5 == 0 else "valid" if k % 5 == 1 else "train"
        rows.append([f"p{k}", protein(rng, enriched, 0.35), label, split])
    labels = write_csv(tmp_path / "labels.csv", rows)
    out = tmp_path / "out"
    code, stdout, err = run_finetune(capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                     f"output_dir={out}", *FAST)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    p = predictions(out)
    assert [r["id"] for r in p] == [r[0] for r in rows if r[3] == "test"]
    assert [r["label"] for r in p] == [r[2] for r in rows if r[3] == "test"]
    y, yhat = [r["label"] for r in p], [r["prediction"] for r in p]
    assert m["accuracy"] == pytest.approx(accuracy_score(y, yhat), abs=1e-12)
    assert m["mcc"] == pytest.approx(matthews_corrcoef(y, yhat), abs=1e-12)
    if len(classes) == 2:  # positive class: the second in sorted order
        positive = sorted(classes)[1]
        assert m["auroc"] == pytest.approx(roc_auc_score([v == positive for v in y],
                                                         [float(r["score"]) for r in p]), abs=1e-12)
        assert "macro_f1" not in m
    else:
        assert m["macro_f1"] == pytest.approx(f1_score(y, yhat, average="macro"), abs=1e-12)
        assert "auroc" not in m and "score" not in p[0]
    constant = max(y.count(c) for c in classes) / len(y)  # the best constant on the test split itself
    assert constant + 0.25 < m["accuracy"] < 1, (m, constant)
    assert m["proteins"] == {"train": 144, "valid": 48, "test": 48}
    assert "test (48 proteins): accuracy" in stdout


def test_regression_with_a_drawn_split_beats_the_mean(ckpt, tmp_path, capsys):
    rng = random.Random(2)
    rows = []
    for k in range(240):
        seq = protein(rng, "A", rng.random() * 0.6)
        rows.append([seq, f"{seq.count('A') / len(seq) + rng.gauss(0, 0.05):.6f}"])
    labels = write_csv(tmp_path / "labels.csv", rows, header=("seq", "label"))  # no id, no split
    out = tmp_path / "out"
    code, _, err = run_finetune(capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=regression",
                                f"output_dir={out}", "pooling=attention", *FAST)
    assert code == 0, err
    m, p = json.loads((out / "metrics.json").read_text()), predictions(out)
    assert m["proteins"] == {"train": 173, "valid": 19, "test": 48}
    y, yhat = np.array([float(r["label"]) for r in p]), np.array([float(r["prediction"]) for r in p])
    assert m["spearman"] == pytest.approx(spearmanr(y, yhat).statistic, abs=1e-12)
    assert m["rmse"] == pytest.approx(np.sqrt(np.mean((y - yhat) ** 2)), abs=1e-12)
    assert m["spearman"] > 0.6
    assert m["rmse"] < 0.8 * y.std()  # y.std(): the best constant on the test split itself


# --- per residue ---------------------------------------------------------------------------
def test_q3_by_hand():
    m = FT.metrics("residue", ["C", "E", "H"], ["HHC", "EC"], ["HCC", "EE"])
    assert m["q3"] == pytest.approx(3 / 5) and m["residues"] == 5


HELIX, STRAND = set("AELMQKRH"), set("VIYFWT")


def ss3(seq, noise=None):
    """Secondary structure by residue type; with ``noise`` (a Random) 15 % of the letters drawn at random."""
    return "".join(noise.choice("CEH") if noise and noise.random() < 0.15 else
                   "H" if c in HELIX else "E" if c in STRAND else "C" for c in seq)


def write_flip(tmp_path, n, seed=3):
    """FLIP's two FASTA files: labels (``>id SET=... VALIDATION=...``) and sequences."""
    rng = random.Random(seed)
    seqs = {f"s{k}": protein(rng) for k in range(n)}
    heads = {i: "SET=test VALIDATION=False" if k % 4 == 0 else f"SET=train VALIDATION={k % 4 == 1}"
             for k, i in enumerate(seqs)}
    labels = {i: ss3(s, rng) for i, s in seqs.items()}
    (tmp_path / "labels.fasta").write_text("".join(f">{i} {heads[i]}\n{labels[i]}\n" for i, s in seqs.items()))
    (tmp_path / "seqs.fasta").write_text("".join(f">{i}\n{s}\n" for i, s in seqs.items()))
    return tmp_path / "labels.fasta", tmp_path / "seqs.fasta", seqs, labels


def test_residue_labels_from_flip_fasta_q3_from_predictions(ckpt, tmp_path, capsys):
    labels, seqs_file, seqs, truth = write_flip(tmp_path, 120)
    out = tmp_path / "out"
    code, _, err = run_finetune(capsys, f"ckpt={ckpt[1]}", f"labels={labels}", f"sequences={seqs_file}",
                                "task=residue", f"output_dir={out}", *FAST)
    assert code == 0, err
    m, p = json.loads((out / "metrics.json").read_text()), predictions(out)
    assert m["proteins"] == {"train": 60, "valid": 30, "test": 30}
    assert all(r["label"] == truth[r["id"]] and len(r["prediction"]) == len(r["label"]) for r in p)
    right = sum(a == b for r in p for a, b in zip(r["label"], r["prediction"]))
    total = sum(len(r["label"]) for r in p)
    assert m["q3"] == pytest.approx(right / total, abs=1e-12) and m["residues"] == total
    constant = max("".join(r["label"] for r in p).count(c) for c in "CEH") / total
    assert m["q3"] > constant + 0.3 and m["q3"] < 1, (m, constant)


# --- freezing, the saved weights --------------------------------------------------------
def test_freeze_all_leaves_the_encoder_bit_identical_and_the_weights_reproduce_predictions(ckpt, tmp_path, capsys):
    task, path = ckpt
    rng = random.Random(4)
    rows = [[f"p{k}", protein(rng, "K" if k % 2 else None, 0.35), "yes" if k % 2 else "no"] for k in range(60)]
    labels = write_csv(tmp_path / "labels.csv", rows, header=("id", "sequence", "label"))
    out = tmp_path / "out"
    code, _, err = run_finetune(capsys, f"ckpt={path}", f"labels={labels}", "task=classification",
                                f"output_dir={out}", "freeze=all", "gradient_checkpointing=true",
                                "pooling=attention", "trainer.max_steps=6", "max_tokens=600", "head_lr=1e-2")
    assert code == 0, err
    saved = load_file(str(out / "model.safetensors"))
    before = {k: v for k, v in task.model.encoder.state_dict().items() if isinstance(v, torch.Tensor)}
    assert {k.removeprefix("encoder.") for k in saved if k.startswith("encoder.")} == set(before)
    for k, v in before.items():
        assert torch.equal(saved["encoder." + k], v), k
    net, meta = load_finetuned(out)
    head0 = FT.FineTuneNet(task.model.encoder, "classification", 2, "attention", 0.0)
    assert not torch.equal(net.head.out.weight, head0.head.out.weight)  # the head did train
    p = predictions(out)
    tok = Tokenizer()
    seq = {r[0]: r[1] for r in rows}
    with torch.no_grad():
        for r in p:
            probs = torch.softmax(net(torch.tensor(tok.encode(seq[r["id"]]))[None])[0], -1)
            assert meta["classes"][int(probs.argmax())] == r["prediction"]
            assert float(probs[1]) == pytest.approx(float(r["score"]), abs=1e-5)
    # a rerun: refused without overwrite, allowed with it; a file of someone else's: refused
    code, _, err = run_finetune(capsys, f"ckpt={path}", f"labels={labels}", "task=classification",
                                f"output_dir={out}", "trainer.max_steps=1")
    assert code == 2 and "holds an earlier finetune output; overwrite=true replaces it" in err
    code, _, err = run_finetune(capsys, f"ckpt={path}", f"labels={labels}", "task=classification",
                                f"output_dir={out}", "trainer.max_steps=1", "overwrite=true")
    assert code == 0, err
    # what a kill inside finetune's own atomic writes left: a dead process's temporaries count as finetune's
    dead = dead_pid()
    left = [out / f".model.safetensors.{dead}.tmp", out / f"..finetune-files.json.{dead}.tmp"]
    for p in left:
        p.write_text("partial")
    code, _, err = run_finetune(capsys, f"ckpt={path}", f"labels={labels}", "task=classification",
                                f"output_dir={out}", "trainer.max_steps=1", "overwrite=true")
    assert code == 0, err
    assert not any(p.exists() for p in left) and (out / "metrics.json").is_file()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_finetune(capsys, f"ckpt={path}", f"labels={labels}", "task=classification",
                                f"output_dir={out}", "trainer.max_steps=1", "overwrite=true")
    assert code == 2 and err == (f"error: output_dir {out}: holds notes.txt, not written by finetune; "
                                 f"move it away or choose another folder\n")


def test_output_check_counts_only_dead_temporaries_of_its_own_names_as_finetunes(tmp_path):
    """No journal yet (a kill inside its first write): the folder holding only that dead
    temporary is empty to finetune, and the sweep removes it; a live process's temporary, a
    dead one of a name finetune never writes, or of one no journal records (export writes
    model.safetensors too) is someone else's."""
    out = tmp_path / "ft"
    out.mkdir()
    left = out / f"..finetune-files.json.{dead_pid()}.tmp"
    left.write_text('{"written": []}')
    FT._check_output(out, overwrite=False)
    assert left.exists()  # only a check: removing is for the holder of the output's lock
    FT._check_output(out, overwrite=False, sweep=True)
    assert not any(out.iterdir())
    for name in (f".model.safetensors.{os.getpid()}.tmp", f".notes.txt.{dead_pid()}.tmp",
                 f".model.safetensors.{dead_pid()}.tmp"):  # no journal records model.safetensors here
        (out / name).write_text("x")
        with pytest.raises(UserError, match="holds files finetune did not write"):
            FT._check_output(out, overwrite=True, sweep=True)
        assert (out / name).exists()
        (out / name).unlink()


# --- bad input ---------------------------------------------------------------------------
BAD = {  # name: (task, header, rows, message after "FILE:LINE: ")
    "no label column": ("classification", ("id", "sequence", "class"), [["a", "MKV", "x"]],
                        "1: no 'label' column (header: id, sequence, class)"),
    "unknown split": ("classification", ("id", "sequence", "label", "split"),
                      [["a", "MKV", "x", "train"], ["b", "MKW", "y", "holdout"]],
                      "3: protein 'b': split 'holdout': expected train, valid or test"),
    "label NaN": ("regression", ("id", "sequence", "label"), [["a", "MKV", "0.5"], ["b", "MKW", "nan"]],
                  "3: protein 'b' has no label ('nan')"),
    "label not a number": ("regression", ("id", "sequence", "label"), [["a", "MKV", "high"]],
                           "2: protein 'a': label 'high' is not a number"),
    "residue length": ("residue", ("id", "sequence", "label"), [["a", "MKV", "HHC"], ["b", "MKVL", "HHC"]],
                       "3: protein 'b': 3 residue labels for 4 residues"),
    "bad residue": ("classification", ("id", "sequence", "label"), [["a", "MK1V", "x"]],
                    "2: record 'a': invalid residue '1' at position 3"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_labels_are_one_line_exit_2_and_write_nothing(name, ckpt, tmp_path, capsys):
    task, header, rows, message = BAD[name]
    labels = write_csv(tmp_path / "labels.csv", rows, header=header)
    code, _, err = run_finetune(capsys, f"ckpt={ckpt[1]}", f"labels={labels}", f"task={task}",
                                f"output_dir={tmp_path / 'out'}")
    assert code == 2 and err.startswith(f"error: {labels}:{message}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.csv"]


def test_flip_length_mismatch_and_the_script_entry_point(ckpt, tmp_path):
    labels, seqs_file, seqs, _ = write_flip(tmp_path, 4)
    text = labels.read_text().splitlines()
    text[5] = text[5][:-1]  # the third record's labels, one short
    labels.write_text("\n".join(text) + "\n")
    cmd = [sys.executable, str(ROOT / "scripts" / "finetune.py"), f"ckpt={ckpt[1]}", f"labels={labels}",
           f"sequences={seqs_file}", "task=residue", f"output_dir={tmp_path / 'out'}"]
    r = forks().run(cmd, capture_output=True, text=True, cwd=tmp_path)
    n = len(seqs["s2"])
    assert r.returncode == 2 and r.stderr == (f"error: {labels}:5: protein 's2': {n - 1} residue labels "
                                              f"for {n} residues\n"), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.fasta", "seqs.fasta"]


def test_gradient_checkpointing_gives_the_same_gradients_and_freeze_n_stops_the_first_layers(ckpt):
    tok = Tokenizer()
    x = torch.tensor(np.stack([tok.encode(protein(random.Random(k))[:20]) for k in range(3)]))

    def grads(checkpointing, freeze):
        torch.manual_seed(0)
        net = FT.FineTuneNet(ProteinLM(model=TINY_MODEL).model.encoder, "regression", 1, "mean", 0.0)
        net.load_state_dict({f"encoder.{k}": v for k, v in ckpt[0].model.encoder.state_dict().items()}, strict=False)
        net.freeze(freeze)
        if checkpointing:
            net.checkpoint_blocks()
        net.train()
        net(x).square().sum().backward()
        calls = [b.attn.forward_calls for b in net.encoder.blocks]  # a recomputed block runs twice
        return {k: p.grad for k, p in net.named_parameters()}, calls

    (plain, once), (recomputed, twice) = grads(False, "none"), grads(True, "none")
    assert once == [1, 1] and twice == [2, 2]
    assert all(torch.allclose(plain[k], recomputed[k], atol=1e-6, rtol=1e-5) for k in plain)
    frozen, _ = grads(False, 1)
    assert all(frozen[k] is None for k in frozen if k.startswith(("encoder.embed", "encoder.blocks.0.")))
    assert all(torch.allclose(frozen[k], plain[k], atol=1e-6, rtol=1e-5)
               for k in frozen if k.startswith(("encoder.blocks.1.", "encoder.norm", "head")))


def test_a_bad_trainer_setting_is_one_line_before_anything_is_written(ckpt, tmp_path, capsys):
    labels = write_csv(tmp_path / "labels.csv", [[f"p{k}", "MKVL" * (k + 1), "ab"[k % 2]] for k in range(12)],
                       header=("id", "sequence", "label"))
    code, _, err = run_finetune(capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                f"output_dir={tmp_path / 'out'}", "+trainer.max_stpes=3")
    assert code == 2 and err == ("error: trainer: TypeError: Trainer.__init__() got an unexpected keyword "
                                 "argument 'max_stpes'\n"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.csv"]


@pytest.mark.parametrize("setting, message", [
    (["freeze=some"], "error: freeze='some': all, none, or a number of layers from 0 to the model depth\n"),
    (["freeze=3"], "error: freeze=3: all, none, or a number of layers from 0 to 2\n"),  # the tiny model's depth
    (["lora=true", "lora_rank=0"], "error: lora_rank=0, lora_alpha=16: a positive integer rank and a positive "
                                   "alpha\n"),
    (["+trainer.max_stpes=3"], "error: trainer: TypeError: Trainer.__init__() got an unexpected keyword argument "
                               "'max_stpes'\n")])
def test_every_setting_is_checked_before_the_probes_run(setting, message, ckpt, tmp_path, capsys, monkeypatch):
    """freeze=, LoRA's and the Trainer's settings are refused before any work: the probes (13 s on a
    real task) never start."""
    if "lora=true" in setting:
        pytest.importorskip("peft", reason="LoRA needs peft (pip install '.[lora]')")

    def work(*a, **k):
        raise AssertionError("the probes ran before the settings were checked")
    monkeypatch.setattr(FT.run, "choose_pooling", work)
    monkeypatch.setattr(FT.run, "probe_head_init", work)
    labels = write_csv(tmp_path / "labels.csv", [[f"p{k}", "MKVL" * (k + 1), "ab"[k % 2]] for k in range(12)],
                       header=("id", "sequence", "label"))
    code, _, err = run_finetune(capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                f"output_dir={tmp_path / 'out'}", *setting)
    assert code == 2 and err == message, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.csv"]


def test_linear_schedule_warms_up_then_falls_to_zero_at_the_last_step():
    """schedule=linear: each group's rate is its base rate times (s + 1) / ramp over the first ramp
    steps, then (total - s) / (total - ramp): written out here for 10 steps with 20 % warmup."""
    import pytorch_lightning as pl
    torch.manual_seed(0)
    net = FT.FineTuneNet(ProteinLM(model=TINY_MODEL).model.encoder, "classification", 2, "mean", 0.0)
    module = FT.FineTuner(net, lr=1e-3, head_lr=1e-2, weight_decay=0.0, scale=(0.0, 1.0),
                          schedule="linear", warmup=0.2)
    tok = Tokenizer()
    rng = random.Random(0)
    data = FT.Encoded([tok.encode(protein(rng)) for _ in range(20)], [k % 2 for k in range(20)])
    seen = []

    class Rates(pl.Callback):
        def on_train_batch_start(self, trainer, *_):
            seen.append([g["lr"] for g in trainer.optimizers[0].param_groups])

    fit = pl.Trainer(accelerator="cpu", max_epochs=100, max_steps=10, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[Rates()])
    fit.fit(module, FT._loader(data, tok.pad_id, max_tokens=400, train=True))
    assert len(seen) == 10
    factors = [0.5, 1.0] + [(10 - s) / 8 for s in range(2, 10)]
    assert np.allclose(seen, [[1e-2 * f, 1e-3 * f] for f in factors], rtol=1e-12, atol=0)
    assert FT.warmup_linear(10, 0.2)(10) == 0.0


def test_a_time_budget_schedules_on_the_clock():
    """trainer.max_time with schedule=linear (issue 45): the share done is the larger of steps / total and
    elapsed / budget; written out for a 100 s budget, 10 % warmup, on a fake clock."""
    now = [50.0]
    time_only = FT.warmup_linear(float("inf"), 0.1, 100.0, clock=lambda: now[0])
    seen = []
    for elapsed in (0, 5, 10, 55, 100, 130):
        now[0] = 50.0 + elapsed
        seen.append(time_only(len(seen)))
    assert seen == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0, 0.0], abs=1e-12)
    now[0] = 0.0
    both = FT.warmup_linear(10.0, 0.1, 100.0, clock=lambda: now[0])
    assert both(0) == 1 / 10 / 0.1                          # step 1 of 10 ends the warmup at once
    now[0] = 20.0
    assert both(5) == pytest.approx((1 - 0.5) / 0.9)         # steps (5 / 10) ahead of the clock (20 / 100)
    now[0] = 80.0
    assert both(5) == pytest.approx((1 - 0.8) / 0.9)         # the clock ahead of the steps
    assert FT.time_budget("00:00:10:00") == 600 and FT.time_budget("1:2:3:4") == 93784
    assert FT.time_budget({"minutes": 10}) == 600 and FT.time_budget(None) is None


def test_a_time_budget_alone_bounds_a_linear_finetune(ckpt, tmp_path, capsys):
    """trainer.max_epochs=-1 trainer.max_time=00:00:00:03: the run stops on time (Lightning's Timer) and
    still writes its outputs and metrics."""
    rng = random.Random(4)
    rows = [[f"p{k}", protein(rng, "K" if k % 2 else None, 0.3), "ab"[k % 2], "test" if k % 5 == 0 else
             "valid" if k % 5 == 1 else "train"] for k in range(60)]
    labels = write_csv(tmp_path / "labels.csv", rows)
    start = time.monotonic()
    code, _, err = run_finetune(capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                f"output_dir={tmp_path / 'out'}", "trainer.max_epochs=-1",
                                "trainer.max_time=00:00:00:03", "patience=1000")
    assert code == 0, err
    assert 3 <= time.monotonic() - start < 60
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    p = predictions(tmp_path / "out")
    assert len(p) == 12 and metrics["proteins"] == {"train": 36, "valid": 12, "test": 12}
    assert metrics["accuracy"] == pytest.approx(accuracy_score([r["label"] for r in p], [r["prediction"] for r in p]))


@pytest.mark.parametrize("setting, message", [
    ("schedule=cosine", "error: schedule='cosine': choose constant or linear (warmup, then down to 0 at the last epoch)\n"),
    ("warmup=1.5", "error: warmup=1.5: a fraction of the steps in [0, 1)\n"),
    ("trainer.max_epochs=-1", "error: schedule=linear falls to 0 at the last step: set trainer.max_epochs, "
                              "trainer.max_steps or trainer.max_time, or use schedule=constant\n"),
    ("trainer.max_time=10min", "error: trainer.max_time='10min': give DD:HH:MM:SS (e.g. 00:00:10:00), or a dict "
                               "such as {minutes: 10}\n"),
    ("trainer.max_time=00:00:00:00", "error: trainer.max_time=0:00:00: must be longer than 0\n"),
    ("layer_decay=0", "error: layer_decay=0: a factor in (0, 1] (1: every block at lr)\n"),
    ("layer_decay=1.5", "error: layer_decay=1.5: a factor in (0, 1] (1: every block at lr)\n"),
    ("stop_on=accuracy", "error: stop_on='accuracy': choose loss or metric (the one select_by names)\n"),
    ("interpolate=maybe", "error: interpolate='maybe': true or false\n"),
    ("probe_baseline=2", "error: probe_baseline=2: true or false\n")])
def test_a_bad_schedule_is_one_line_before_anything_is_written(setting, message, ckpt, tmp_path, capsys):
    labels = write_csv(tmp_path / "labels.csv", [[f"p{k}", "MKVL" * (k + 1), "ab"[k % 2]] for k in range(12)],
                       header=("id", "sequence", "label"))
    code, _, err = run_finetune(capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                f"output_dir={tmp_path / 'out'}", setting)
    assert code == 2 and err == message, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.csv"]


@pytest.mark.parametrize("freeze", ["none", 1])
def test_layer_decay_gives_each_block_its_rate_and_every_trainable_weight_one(freeze, ckpt):
    """layer_decay=0.5, depth 2: the final norm and block 1 at lr, block 0 at lr / 2, the embedding at
    lr / 4 (by parameter name); frozen parts in no group; 1.0: one group at lr."""
    torch.manual_seed(0)
    net = FT.FineTuneNet(ProteinLM(model=TINY_MODEL).model.encoder, "regression", 1, "mean", 0.0)
    net.freeze(freeze)
    expected = {}
    for name, p in net.encoder.named_parameters():
        if p.requires_grad:
            expected[name] = 0.1 * (0.25 if name.startswith(("embed", "pos_embed")) else
                                    0.5 if name.startswith("blocks.0.") else 1.0)
    by_id = {id(p): name for name, p in net.encoder.named_parameters()}
    got = {}
    for params, lr in FT.encoder_groups(net.encoder, 0.1, 0.5):
        for p in params:
            assert by_id[id(p)] not in got  # every weight in one group
            got[by_id[id(p)]] = lr
    assert got == pytest.approx(expected)
    assert any(v == pytest.approx(0.025) for v in got.values()) == (freeze == "none")
    ((params, lr),) = FT.encoder_groups(net.encoder, 0.1, 1.0)
    assert lr == 0.1 and {by_id[id(p)] for p in params} == set(expected)


def test_stop_on_metric_stops_when_the_validation_metric_stalls(ckpt, tmp_path, capsys):
    """stop_on=metric patience=1: the epochs run end at the first epoch whose validation accuracy is not
    above the best before it (replayed by hand from metrics.json's candidates), and finetune.json says so."""
    rng = random.Random(5)
    rows = [[f"p{k}", protein(rng, "K" if k % 2 else None, 0.3), "ab"[k % 2], "test" if k % 5 == 0 else
             "valid" if k % 5 == 1 else "train"] for k in range(60)]
    labels = write_csv(tmp_path / "labels.csv", rows)
    code, _, err = run_finetune(capsys, f"ckpt={ckpt[1]}", f"labels={labels}", "task=classification",
                                f"output_dir={tmp_path / 'out'}", "stop_on=metric", "patience=1",
                                "trainer.max_epochs=25", "schedule=constant", "lr=3e-3", "head_lr=1e-2")
    assert code == 0, err
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    epochs = [c["accuracy"] for c in metrics["selection"]["candidates"] if c["name"].startswith("epoch")]
    best, stop = -1.0, len(epochs)
    for i, acc in enumerate(epochs):
        if acc > best:
            best = acc
        else:
            stop = i + 1
            break
    assert stop < 25 and len(epochs) == stop and metrics["epochs"] == stop
    assert json.loads((tmp_path / "out" / "finetune.json").read_text())["stop_on"] == "metric"


def test_command_defaults_are_the_functions():
    """conf/finetune.yaml (the command) and ``finetune()`` (the Python API) default every shared key alike, and
    a run given no trainer.max_epochs stops at MAX_EPOCHS either way."""
    import inspect

    from omegaconf import OmegaConf
    from protein_performer.finetune import run
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "finetune.yaml"))
    params = inspect.signature(run.finetune).parameters
    shared = [k for k in cfg if k in params and params[k].default is not inspect.Parameter.empty and k != "trainer"]
    listed = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 (YAML has lists where Python has tuples)
    assert len(shared) > 30 and {k: cfg[k] for k in shared} == {k: listed(params[k].default) for k in shared}
    assert cfg["trainer"]["max_epochs"] == run.MAX_EPOCHS == 10
    settings, _ = run._trainer_settings(None, "linear", 3, None, None)
    assert settings["max_epochs"] == run.MAX_EPOCHS

"""``export`` of a ``finetune`` output: the directory opens with transformers'
AutoModelForSequenceClassification / AutoModelForTokenClassification (trust_remote_code, offline)
and with this project's own loader, and both give the fine-tuned network's logits on a padded
batch (mean, attention, layers and termini pooling, classification and regression, per residue; finetune's
output-space ensemble with its probe too); the loss is the usual one; the wrong auto class and a finetune folder with a changed file are refused."""
import csv
import json
import random

import pytest
import torch
import torch.nn.functional as F

from protein_performer import finetune as FT
from protein_performer.hub.load import load_finetuned
from protein_performer.data.collate import pad_batch
from protein_performer.training.task import ProteinLM

from conftest import TINY_MODEL, run_command, save_checkpoint

AA = "ACDEFGHIKLMNPQRSTVWY"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    task = ProteinLM(model=TINY_MODEL, objective="mlm").eval()
    return save_checkpoint(task, tmp_path_factory.mktemp("hfheads") / "mlm.ckpt")


def proteins(n=6, seed=0, lengths=(12, 40)):
    rng = random.Random(seed)
    return ["".join(rng.choice(AA) for _ in range(rng.randint(*lengths))) for _ in range(n)]


def write_labels(path, task, n=60):
    rng = random.Random(1)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "sequence", "label", "split"])
        for k, s in enumerate(proteins(n, seed=2)):
            label = {"classification": rng.choice("abc"), "regression": f"{rng.gauss(3, 2):.3f}",
                     "residue": "".join(rng.choice("HEC") for _ in s)}[task]
            w.writerow([f"p{k}", s, label, "test" if k % 5 == 0 else "valid" if k % 5 == 1 else "train"])
    return path


@pytest.fixture(scope="module")
def finetuned(ckpt, tmp_path_factory):
    """(task, pooling, window, ensemble) -> (finetune folder, its export), a few steps of training each;
    ensemble: finetune's default mix with its probe, kept whatever the gate would say (min_confidence 0)."""
    from protein_performer.hub.export import export
    made = {}

    def make(task, pooling="mean", window=0, ensemble=False):
        if (task, pooling, window, ensemble) not in made:
            d = tmp_path_factory.mktemp(f"{task}-{pooling}-{window}-{ensemble}")
            ft, out = d / "ft", d / "export"
            FT.finetune(ckpt, write_labels(d / "labels.csv", task), task, ft, pooling=pooling, lr=1e-2,
                        head_lr=0.1, window=window, head_init="random",
                        probe_baseline=ensemble, min_confidence=0, epoch_confidence=1.0,  # the mix, not the probe
                        trainer={"max_steps": 3, "enable_progress_bar": False})
            made[task, pooling, window, ensemble] = ft, export(ft, out)
        return made[task, pooling, window, ensemble]
    return make


def batch(lengths=(12, 40)):
    from protein_performer.tokenizer import Tokenizer
    tok = Tokenizer()
    seqs = proteins(lengths=lengths)
    tokens, pad = pad_batch([tok.encode(s) for s in seqs], tok.pad_id)
    return seqs, tokens, pad


@pytest.mark.parametrize("task,pooling,window,ensemble", [
    ("classification", "mean", 0, False), ("classification", "attention", 0, False), ("regression", "mean", 0, False),
    ("residue", "mean", 0, False), ("residue", "mean", 3, False),
    ("classification", "mean", 0, True), ("regression", "mean", 0, True), ("residue", "mean", 3, True),
    ("classification", "layers", 0, True), ("classification", "termini", 0, True)])
def test_transformers_and_the_own_loader_give_the_finetuned_logits(finetuned, transformers, task, pooling, window,
                                                                   ensemble):
    ft, out = finetuned(task, pooling, window, ensemble)
    ref_net, meta = load_finetuned(ft)
    assert (ref_net.probe is not None) == ensemble and meta["ensemble"] == (0.5 if ensemble else None)
    if window:  # the context weights trained away from their zero start: the export must carry them
        assert ref_net.head.context.weight.abs().max() > 0
    # termini: proteins shorter than the 50 residues at each end and more than twice as long, padded together
    seqs, tokens, pad = batch((10, 140) if pooling == "termini" else (12, 40))
    assert pooling != "termini" or (min(map(len, seqs)) < 50 and max(map(len, seqs)) > 100)
    auto = transformers.AutoModelForTokenClassification if task == "residue" else \
        transformers.AutoModelForSequenceClassification
    model = auto.from_pretrained(out, trust_remote_code=True)
    assert not model.training
    enc = transformers.AutoTokenizer.from_pretrained(out)(seqs, return_tensors="pt", padding=True)
    assert torch.equal(enc["input_ids"], tokens) and torch.equal(enc["attention_mask"] == 0, pad)
    with torch.no_grad():
        ref = ref_net(tokens, pad)
        got = model(**enc).logits
        if pooling in ("layers", "termini"):  # the head reads every hidden state; the output holds them only when asked
            assert model(**enc).hidden_states is None
            assert len(model(**enc, output_hidden_states=True).hidden_states) == ref_net.encoder.depth + 1
        own, own_meta = load_finetuned(out)  # the exported directory, opened by this project
        mine = own(tokens, pad)
    real = ~pad if task == "residue" else slice(None)
    assert ref.shape == got.shape
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(mine[real], ref[real], atol=1e-6, rtol=0)
    assert own_meta["classes"] == meta["classes"] and own_meta["target_scale"] == meta["target_scale"]
    config = json.loads((out / "config.json").read_text())
    assert config["ensemble_share"] == meta["ensemble"]
    assert ("An output-space ensemble: the logits are the log of 0.5" in (out / "README.md").read_text()) == ensemble
    if task == "regression":
        assert config["num_labels"] == 1 and config["problem_type"] == "regression"
        y = torch.linspace(0, 6, len(seqs))
        with torch.no_grad():
            loss = model(**enc, labels=y).loss
        mean, std = meta["target_scale"]
        torch.testing.assert_close(loss, F.mse_loss(ref[:, 0], (y - mean) / std), atol=1e-5, rtol=0)
    else:
        assert [config["id2label"][str(i)] for i in range(len(meta["classes"]))] == meta["classes"]
        if task == "residue":
            y = torch.randint(0, 3, tokens.shape).masked_fill(pad, -100)
            expected = F.cross_entropy(ref.flatten(0, 1), y.flatten(), ignore_index=-100)
        else:
            y = torch.arange(len(seqs)) % 3
            expected = F.cross_entropy(ref, y)
        with torch.no_grad():
            loss = model(**enc, labels=y).loss
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)


def test_the_wrong_auto_class_is_refused_in_one_line(finetuned, transformers):
    _, out = finetuned("residue")
    with pytest.raises(ValueError, match="AutoModelForTokenClassification"):
        transformers.AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True)


def test_the_export_command_takes_a_finetune_folder_and_refuses_one_whose_weights_do_not_match(
        finetuned, tmp_path, capsys):
    ft, _ = finetuned("classification")
    code, stdout, err = run_command("export", capsys, f"ckpt={ft}", f"output={tmp_path / 'good'}")
    assert code == 0, err
    assert json.loads((tmp_path / "good" / "config.json").read_text())["architectures"] == [
        "ProteinPerformerForSequenceClassification"]
    import shutil
    bad = tmp_path / "ft"
    shutil.copytree(ft, bad)
    meta = json.loads((bad / "finetune.json").read_text())
    meta["num_outputs"] = 5
    (bad / "finetune.json").write_text(json.dumps(meta))
    code, _, err = run_command("export", capsys, f"ckpt={bad}", f"output={tmp_path / 'out'}")
    assert code == 2 and "model.safetensors" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()

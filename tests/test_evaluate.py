"""Evaluation: hand-computed metrics on a model whose answer is known, buckets, seeds,
full-length scoring beyond the training crop, windows for exact attention, the CLI."""
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.evaluate import (BUCKETS, evaluate, evaluate_model, length_bucket,
                                        load_proteins, window_spans)
from protein_performer.objectives import IGNORE, scored_example
from protein_performer.training.task import ProteinLM
from protein_performer.tokenizer import STANDARD_AA, Tokenizer

from conftest import ROOT, TINY_MODEL, save_checkpoint as save
from forkserver import forks

TOK = Tokenizer()
AA = {a: TOK.aa_offset + i for i, a in enumerate(STANDARD_AA)}
TINY = TINY_MODEL

# the model below predicts A 1/2, C 1/4, D 1/4 everywhere; the baseline is these frequencies
MODEL_P = {"A": 0.5, "C": 0.25, "D": 0.25}
BASE_P = {"A": 0.4, "C": 0.3, "D": 0.2, "E": 0.1}


def frequencies(p):
    f = [0.0] * TOK.vocab_size
    for a, v in p.items():
        f[AA[a]] = v
    return f


def constant_model(objective, kernel="softmax"):
    """Every parameter zero except the output bias = log MODEL_P: the hidden state is zero
    (LayerNorm of zeros), so the logits are the bias at every position, whatever the input."""
    model = dict(TINY, attention=dict(kernel=kernel, nb_features=16))
    task = ProteinLM(model=model, objective=objective, aa_frequencies=frequencies(BASE_P))
    with torch.no_grad():
        for p in task.parameters():
            p.zero_()
        bias = torch.full((TOK.vocab_size,), -1e4)
        for a, v in MODEL_P.items():
            bias[AA[a]] = math.log(v)
        task.model.head_bias.copy_(bias)
    return task.eval()


def test_length_buckets():
    cases = {1: "<=256", 256: "<=256", 257: "257-512", 512: "257-512", 513: "513-1024", 1024: "513-1024",
             1025: "1025-2048", 2048: "1025-2048", 2049: "2049-4096", 4096: "2049-4096", 4097: ">4096",
             35213: ">4096"}
    for n, label in cases.items():
        assert length_bucket(n) == label, n
    assert [b[0] for b in BUCKETS] == ["<=256", "257-512", "513-1024", "1025-2048", "2049-4096", ">4096"]


def test_causal_metrics_by_hand():
    # "AACD": targets A A C D -> nll 2 ln2 + 2 ln4 = 6 ln2 over 4 tokens; argmax A right twice
    # 300 x "C" (bucket 257-512): nll 300 ln4, accuracy 0; baseline nll 300 ln(1/0.3)
    long = "C" * 300
    m = evaluate_model(constant_model("clm"), ["AACD", long], progress=False)
    nll_short, nll_long = 6 * math.log(2), 300 * math.log(4)
    assert m["num_tokens"] == 304 and m["num_sequences"] == 2
    assert m["loss"] == pytest.approx((nll_short + nll_long) / 304, rel=1e-6)
    assert m["perplexity"] == pytest.approx(math.exp((nll_short + nll_long) / 304), rel=1e-6)
    assert m["accuracy"] == pytest.approx(2 / 304)
    base_short = 2 * math.log(1 / 0.4) + math.log(1 / 0.3) + math.log(1 / 0.2)
    base_long = 300 * math.log(1 / 0.3)
    assert m["baseline_perplexity"] == pytest.approx(math.exp((base_short + base_long) / 304), rel=1e-6)
    assert m["baseline_accuracy"] == pytest.approx(2 / 304)  # baseline argmax is A as well

    b = m["buckets"]
    assert b["<=256"]["perplexity"] == pytest.approx(2 ** 1.5, rel=1e-6)
    assert b["<=256"]["accuracy"] == 0.5 and b["<=256"]["num_tokens"] == 4 and b["<=256"]["num_sequences"] == 1
    assert b["257-512"]["perplexity"] == pytest.approx(4.0, rel=1e-6)
    assert b["257-512"]["accuracy"] == 0.0 and b["257-512"]["num_tokens"] == 300
    assert b["257-512"]["baseline_perplexity"] == pytest.approx(1 / 0.3, rel=1e-6)
    for label in ("513-1024", "1025-2048", "2049-4096", ">4096"):
        assert b[label]["num_tokens"] == 0 and b[label]["perplexity"] is None


def test_masked_metrics_by_hand_and_seed():
    # all-A proteins: every masked position has label A -> perplexity exactly 2, accuracy 1
    seqs = ["A" * 40, "A" * 700, "A" * 130]
    m = evaluate_model(constant_model("mlm"), seqs, seed=3, progress=False)
    assert m["perplexity"] == pytest.approx(2.0, rel=1e-6) and m["accuracy"] == 1.0
    assert m["baseline_perplexity"] == pytest.approx(1 / 0.4, rel=1e-6) and m["baseline_accuracy"] == 1.0
    expected = sum(int((scored_example(TOK.encode(s), "mlm", TOK, 3)[1] != IGNORE).sum()) for s in seqs)
    assert m["num_tokens"] == expected and 0.1 * 870 < expected < 0.2 * 870
    assert m["buckets"]["513-1024"]["num_sequences"] == 1


def test_same_seed_same_numbers_regardless_of_batching(tmp_path):
    torch.manual_seed(0)
    task = ProteinLM(model=TINY, objective="mlm", aa_frequencies=frequencies(BASE_P)).eval()
    rng = np.random.default_rng(0)
    seqs = ["".join(rng.choice(list(STANDARD_AA), n)) for n in (30, 90, 260, 600, 45)]
    a = evaluate_model(task, seqs, seed=1, progress=False)
    b = evaluate_model(task, list(reversed(seqs)), seed=1, max_tokens=64, batch_size=1, progress=False)
    c = evaluate_model(task, seqs, seed=2, progress=False)
    assert a["num_tokens"] == b["num_tokens"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["accuracy"] == b["accuracy"]
    assert json.dumps(a) == json.dumps(evaluate_model(task, seqs, seed=1, progress=False))  # identical
    assert (c["num_tokens"], c["loss"]) != (a["num_tokens"], a["loss"])


@pytest.mark.parametrize("objective", ["clm", "mlm"])
def test_longer_than_training_crop_is_scored_whole(objective):
    """A protein 10x the crop (64) is one forward pass over all of it: the figures equal a
    by-hand full-length pass and differ from scoring the first crop only."""
    torch.manual_seed(0)
    task = ProteinLM(model=TINY, objective=objective, aa_frequencies=frequencies(BASE_P)).eval()
    rng = np.random.default_rng(1)
    seq = "".join(rng.choice(list(STANDARD_AA), 640))
    m = evaluate_model(task, [seq], seed=0, progress=False)
    assert m["evaluation"]["full_length"] and m["buckets"]["513-1024"]["num_sequences"] == 1

    ids = torch.from_numpy(TOK.encode(seq)).long()
    if objective == "clm":  # by hand: predict residue t + 1 from <cls> and residues up to t; <eos> not scored
        inputs, labels = ids[:-1], ids[1:].clone()
        labels[-1] = IGNORE
    else:
        inputs, labels = scored_example(TOK.encode(seq), objective, TOK, 0)
    with torch.no_grad():
        logp = torch.log_softmax(task(inputs[None]).double()[0], -1)
    keep = labels != IGNORE
    nll = -logp[keep].gather(-1, labels[keep][:, None]).sum().item()
    if objective == "clm":
        assert m["num_tokens"] == 640
    assert m["num_tokens"] == int(keep.sum())
    assert m["loss"] == pytest.approx(nll / int(keep.sum()), rel=1e-5)
    with torch.no_grad():  # the last 64 tokens alone give other numbers: context matters
        crop = torch.log_softmax(task(inputs[None, -64:]).double()[0], -1)
    k64 = keep[-64:]
    assert not torch.allclose(crop[k64], logp[-64:][k64], atol=1e-4)


def test_window_spans_cover_every_position_once():
    for causal in (True, False):
        for n, w, s in [(10, 10, 5), (11, 4, 2), (100, 32, 16), (100, 32, 32), (7, 3, 1)]:
            owned = np.zeros(n, int)
            for start, end, own_s, own_e in window_spans(n, w, s, causal):
                assert end - start <= w and start <= own_s < own_e <= end
                owned[own_s:own_e] += 1
            assert (owned == 1).all(), (n, w, s, causal)
    # causal: after the first window each scored position has >= window - stride left context
    for start, end, own_s, own_e in window_spans(100, 32, 8, True)[1:]:
        assert own_s - start >= 32 - 8
    with pytest.raises(ValueError):
        window_spans(10, 4, 5, True)


@pytest.mark.parametrize("objective", ["clm", "mlm"])
def test_exact_attention_windows_long_proteins_and_says_so(objective):
    torch.manual_seed(0)
    model = dict(TINY, attention=dict(kernel="exact"))
    task = ProteinLM(model=model, objective=objective, aa_frequencies=frequencies(BASE_P)).eval()
    rng = np.random.default_rng(2)
    seqs = ["".join(rng.choice(list(STANDARD_AA), n)) for n in (50, 300)]
    full = evaluate_model(task, seqs, window=None, progress=False)
    win = evaluate_model(task, seqs, window=128, stride=64, progress=False)
    assert full["evaluation"]["full_length"] and full["evaluation"]["window"] is None
    ev = win["evaluation"]
    assert not ev["full_length"] and ev["window"] == 128 and ev["stride"] == 64 and ev["windowed_sequences"] == 1
    assert win["num_tokens"] == full["num_tokens"]  # every position still scored exactly once
    assert win["buckets"]["<=256"] == full["buckets"]["<=256"]  # short protein untouched
    assert win["loss"] != pytest.approx(full["loss"], rel=1e-7)  # long one saw less context
    # a constant model gives the by-hand answer through windows as well
    c = evaluate_model(constant_model("clm", kernel="exact"), ["C" * 300], window=64, stride=16, progress=False)
    assert c["num_tokens"] == 300 and c["perplexity"] == pytest.approx(4.0, rel=1e-6)


def test_evaluate_writes_json_csv_png_for_several_checkpoints(tmp_path):
    fasta = tmp_path / "held.fasta"
    fasta.write_text(">a\nAACD\n>b desc\n" + "C" * 60 + "\n" + "C" * 240 + "\n")
    c1 = save(constant_model("clm"), tmp_path / "one.ckpt")
    torch.manual_seed(0)
    c2 = save(ProteinLM(model=TINY, objective="clm", aa_frequencies=frequencies(BASE_P)), tmp_path / "two.ckpt")
    out = tmp_path / "out"
    res = evaluate([c1, c2], fasta, out, progress=False)
    assert list(res) == ["one", "two"]
    data = json.loads((out / "metrics.json").read_text())["checkpoints"]
    assert data["one"]["perplexity"] == pytest.approx(math.exp((6 * math.log(2) + 300 * math.log(4)) / 304))
    single = json.loads((out / "one" / "metrics.json").read_text())
    for k in ("perplexity", "accuracy", "loss", "num_tokens", "num_sequences", "baseline_perplexity",
              "baseline_accuracy", "buckets"):
        assert k in single
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("checkpoint,bucket,perplexity,accuracy,loss,num_tokens")
    assert len(rows) == 1 + 2 * 7 and rows[1].startswith("one,all,")
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs_give_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        evaluate(str(tmp_path / "missing.ckpt"), ROOT / "data/heldout/uniprotkb_mix_heldout_2k.fasta.gz", tmp_path)
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match=r"checkpoint .*junk.ckpt: cannot load") as e:
        evaluate(str(junk), ROOT / "tests/fixtures/pyswrd_uniprot_sprot15.fasta", tmp_path)
    assert "\n" not in str(e.value)
    ckpt = save(constant_model("mlm"), tmp_path / "m.ckpt")
    bad = tmp_path / "bad.fasta"
    bad.write_text(">ok\nMKV\n>broken\nMK1V\n")
    with pytest.raises(ValueError, match=r"bad.fasta:3.*broken"):
        evaluate(ckpt, bad, tmp_path / "o")


def _cli(args, cwd):
    env = dict(os.environ, WANDB_MODE="disabled")
    return forks().run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), *args], capture_output=True,
                       text=True, cwd=cwd, env=env, timeout=300)


def test_cli(tmp_path):
    ckpt = save(constant_model("clm"), tmp_path / "m.ckpt")
    fasta = tmp_path / "x.fasta"
    fasta.write_text(">a\nAACD\n")
    out = _cli([f"ckpt={ckpt}", f"data.path={fasta}", f"output_dir={tmp_path / 'o'}", "progress=false"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert m["perplexity"] == pytest.approx(2 ** 1.5, rel=1e-6) and m["num_sequences"] == 1

    out = _cli([f"ckpt={tmp_path / 'nope.ckpt'}", f"data.path={fasta}", f"output_dir={tmp_path / 'o2'}"], tmp_path)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1] == f"error: checkpoint {tmp_path / 'nope.ckpt'}: no such file"
    out = _cli([f"ckpt={ckpt}", f"data.path={fasta}", "windw=5"], tmp_path)
    assert out.returncode != 0 and "windw" in out.stderr


def test_logs_to_wandb_only_when_a_run_is_active(tmp_path):
    wandb = pytest.importorskip("wandb")
    fasta = tmp_path / "x.fasta"
    fasta.write_text(">a\nAACD\n")
    ckpt = save(constant_model("clm"), tmp_path / "m.ckpt")
    evaluate(ckpt, fasta, tmp_path / "no_run", progress=False)  # no run: nothing to log to, no error
    run = wandb.init(mode="offline", dir=str(tmp_path), project="test-evaluate")
    try:
        evaluate(ckpt, fasta, tmp_path / "with_run", progress=False)
        assert run.summary["eval/m/perplexity"] == pytest.approx(2 ** 1.5, rel=1e-6)
        assert run.summary["eval/m/<=256/accuracy"] == 0.5
    finally:
        wandb.finish()


def test_compare_trains_evaluates_and_writes_the_table(tmp_path):
    from protein_performer.compare import GENERATED_END, compare
    small = tmp_path / "train.fasta"
    from protein_performer.formats import read_records
    with open(small, "w") as f:
        for i, r in enumerate(read_records(ROOT / "data/sample/swissprot_sample_20k.fasta.gz")):
            if i == 300:
                break
            f.write(f">{r.id}\n{r.sequence}\n")
    overrides = [f"data.path={small}", "data.max_len=64", "data.batch_size=8", "data.valid_fraction=0.1",
                 "model.dim=32", "model.depth=1", "model.heads=2", "model.attention.nb_features=16",
                 "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.enable_progress_bar=false",
                 "logger=none", "seed=0"]
    doc = tmp_path / "docs" / "comparison.md"
    doc.parent.mkdir()
    doc.write_text("old\n" + GENERATED_END + "\nhand-written notes\n")
    heldout = ROOT / "data/heldout/uniprotkb_mix_heldout_2k.fasta.gz"
    long = ROOT / "data/heldout/swissprot_long_heldout.fasta.gz"
    res = compare(["performer", "transformer"], overrides, heldout, tmp_path / "out", doc=doc, max_records=12,
                  progress=False, window=256, stride=128, long_heldout=long)
    assert set(res) == {"performer", "transformer"}
    # the long set: scored the same way, its own figures and table (its first 12 proteins: one > 4,096)
    lp, lt = res["performer"]["long_heldout"], res["transformer"]["long_heldout"]
    assert lp["num_sequences"] == lt["num_sequences"] == 12 and lp["num_tokens"] == lt["num_tokens"]
    assert lp["buckets"]["2049-4096"]["num_sequences"] == 11 and lp["buckets"][">4096"]["num_sequences"] == 1
    assert lp["perplexity"] != res["performer"]["perplexity"]
    assert res["performer"]["step"] == res["transformer"]["step"] == 4
    assert res["performer"]["evaluation"]["full_length"]
    assert res["transformer"]["evaluation"]["window"] == 256 and not res["transformer"]["evaluation"]["full_length"]
    assert res["performer"]["num_tokens"] == res["transformer"]["num_tokens"]  # same masks, same positions
    text = doc.read_text()
    assert "| performer | softmax | 4 |" in text and "(reference)" in text and "hand-written notes" in text
    assert f"long held-out set `{long}` (12 proteins" in text
    assert f"| performer | 4 | {lp['perplexity']:.3f} |" in text.split("long held-out set")[1]
    assert "old" not in text.split(GENERATED_END)[0] and (doc.parent / "comparison.png").is_file()
    stamp = (tmp_path / "out/runs/performer/train_summary.json").stat().st_mtime
    compare(["performer", "transformer"], overrides, heldout, tmp_path / "out", max_records=12, progress=False)
    assert (tmp_path / "out/runs/performer/train_summary.json").stat().st_mtime == stamp  # reused
    # another step budget: the finished run is not reused under the new figures, it is trained again
    longer = [o.replace("trainer.max_steps=4", "trainer.max_steps=6") for o in overrides]
    res = compare(["performer"], longer, heldout, tmp_path / "out", max_records=12, progress=False)
    assert res["performer"]["step"] == 6 and res["performer"]["training"]["max_steps"] == 6
    summary = json.loads((tmp_path / "out/runs/performer/train_summary.json").read_text())
    assert summary["settings"]["trainer.max_steps"] == "6"


def test_compare_command_takes_the_readme_budget_key_and_finds_its_data_anywhere(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from protein_performer.compare import flatten_overrides
    from protein_performer.resources import bundled
    monkeypatch.chdir(tmp_path)  # not the checkout: default paths must not depend on the working directory
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("compare", overrides=["trainer.max_steps=200"])  # as docs/commands.md writes it
        explicit = compose("compare", overrides=["train.trainer.max_steps=600"])
        long = compose("long_proteins")
    assert cfg.heldout.long_path is None and long.heldout.path == cfg.heldout.path
    assert long.heldout.long_path == bundled("heldout/swissprot_long_heldout.fasta.gz")
    train = flatten_overrides(OmegaConf.to_container(cfg.train, resolve=True))
    assert "trainer.max_steps=200" in train and "trainer.val_check_interval=200" in train
    assert "trainer.max_steps=600" in flatten_overrides(OmegaConf.to_container(explicit.train, resolve=True))
    assert cfg.heldout.path == bundled("heldout/uniprotkb_mix_heldout_2k.fasta.gz")
    assert f"data.path={bundled('sample/swissprot_sample_20k.fasta.gz')}" in train
    assert Path(cfg.heldout.path).is_file() and Path(bundled("sample/swissprot_sample_20k.fasta.gz")).is_file()


def test_uniprot_dat_input_scores_every_residue():
    """A UniProt flat file: every record is read and, causal, every residue scored; the
    residue count comes from Biopython's own swiss parser."""
    from Bio import SeqIO
    path = ROOT / "tests/fixtures/emboss_trembl_9records_2012.dat"
    records = list(SeqIO.parse(str(path), "swiss"))
    m = evaluate_model(constant_model("clm"), load_proteins(path), progress=False)
    assert m["num_sequences"] == len(records) == 9
    assert m["num_tokens"] == sum(len(r.seq) for r in records)
    lengths = [len(r.seq) for r in records]
    for label, lo, hi in BUCKETS:
        assert m["buckets"][label]["num_sequences"] == sum(lo <= n <= hi for n in lengths)


def test_compare_refuses_a_missing_long_heldout_before_training(tmp_path):
    from protein_performer.compare import compare
    missing = tmp_path / "long.fasta.gz"
    with pytest.raises(FileNotFoundError, match=f"heldout.long_path={missing}: no such file"):
        compare(["performer"], ["trainer.max_steps=1"], ROOT / "data/heldout/uniprotkb_mix_heldout_2k.fasta.gz",
                tmp_path / "out", long_heldout=missing)
    assert not (tmp_path / "out").exists()                # nothing trained, nothing written

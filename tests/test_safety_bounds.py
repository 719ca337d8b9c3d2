"""Issue 44's audit, findings 4-6 and 8-10, as tests: bounds derived from the data, consistency
checks before any work, no traceback (Lightning's and Hydra's errors become one ``error:`` line,
exit 2, the run folder gone), and no ``outputs/`` folder from a command other than ``train``.

Commands run through the console entry point in this process (tests/inprocess.py), or, where only
the library is at stake, as functions."""
import argparse
import json
import logging
import random
import re
from pathlib import Path

import pytest
import torch

from protein_performer.errors import UserError

from inprocess import checksums, run_main

PROTEINS = {"P1": "MKTAYIAKQRQISFVKSHFSRQ", "P2": "MQIFVKTLTGKTITLEVEPSDT", "P3": "MSDNGPQNQRNAPRITFGGPSD",
            "P4": "MKVLAAGIVGLLLAQPALA", "P5": "MSTNPKPQRKTKRNTNRRPQDVKFPGG"}
TRAIN = ["model.dim=16", "model.depth=1", "model.heads=2", "model.attention.nb_features=8", "model.dropout=0.0",
         "data.max_len=48", "data.batch_size=16", "data.max_tokens=null", "data.crop_schedule=null",
         "data.valid_fraction=0.1", "optim.warmup_steps=2", "trainer.enable_progress_bar=false",
         "+trainer.enable_model_summary=false", "logger=none", "trainer.max_steps=3"]


@pytest.fixture(scope="module")
def labeled(small_fasta, tmp_path_factory) -> dict[str, Path]:
    """Label files over 60 of the small FASTA's proteins (their first 60 residues)."""
    from protein_performer.formats.fasta import read_fasta
    d = tmp_path_factory.mktemp("labels")
    recs = [(r.id, r.sequence[:60]) for r in read_fasta(small_fasta)][:60]
    rng = random.Random(0)
    files = {"classes": [f"{i},{s},{rng.choice('ab')}" for i, s in recs],
             "continuous": [f"{i},{s},{rng.random():.4f}" for i, s in recs],
             "residues": [f"{i},{s},{''.join(rng.choice('HEC') for _ in s)}" for i, s in recs]}
    files["contradictory"] = files["classes"] + [f"{recs[3][0]},{recs[3][1]},{'b' if files['classes'][3][-1] == 'a' else 'a'}"]
    out = {}
    for name, rows in files.items():
        out[name] = d / f"{name}.csv"
        out[name].write_text("id,sequence,label\n" + "\n".join(rows) + "\n")
    return out


def one_line(code: int, out: str, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err[-3000:])
    assert "Traceback" not in out + err
    return lines[0]


# --- finding 4: bounds ----------------------------------------------------------------------
def test_local_window_beyond_its_maximum_is_one_line_stating_the_cost(tmp_path, capsys, monkeypatch, small_fasta):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    line = one_line(*run_main(capsys, "train", *TRAIN, f"data.path={small_fasta}", f"hydra.run.dir={run}",
                              "model.attention.local_window=100000"))
    assert "model.attention.local_window=100000: above the maximum 16384" in line and "bytes" in line
    assert not run.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.timeout(120)
def test_finetune_window_is_capped_at_the_longest_protein(tmp_path, ckpts, labeled, caplog):
    """``window=100000`` ran for more than 300 s; capped, it trains in seconds."""
    from protein_performer.finetune import finetune
    with caplog.at_level(logging.WARNING, logger="protein_performer"):
        finetune(ckpts["mlm"], labeled["residues"], "residue", tmp_path / "ft", window=100000,
                 trainer={"max_epochs": 1})
    meta = json.loads((tmp_path / "ft" / "finetune.json").read_text())
    assert meta["window"] == 59  # the longest protein: 60 residues
    assert "window=100000: capped at 59" in caplog.text


# --- finding 5: test proteins the model trains on, contradictory labels ----------------------
def test_finetune_refuses_its_training_proteins_as_test_proteins(tmp_path, ckpts, labeled):
    from protein_performer.finetune import finetune
    with pytest.raises(UserError, match="every test protein is also a training protein"):
        finetune(ckpts["mlm"], labeled["classes"], "classification", tmp_path / "ft", test_labels=labeled["classes"])
    assert not (tmp_path / "ft").exists()


def test_finetune_warns_with_counts_when_some_test_proteins_are_training_proteins(tmp_path, labeled, caplog):
    from protein_performer.finetune import finetune
    rows = labeled["classes"].read_text().splitlines()
    test = tmp_path / "test.csv"
    test.write_text("\n".join(rows[:4]) + "\nNEW1,MKVLAAGIVGLLLAQPALAW,a\n")  # 3 of 4 are training proteins
    with caplog.at_level(logging.WARNING, logger="protein_performer"), \
            pytest.raises(FileNotFoundError):  # the checks come before the model is opened
        finetune(tmp_path / "no-model.ckpt", labeled["classes"], "classification", tmp_path / "ft", test_labels=test)
    assert "3 of 4 test proteins" in caplog.text and "also training proteins" in caplog.text


def test_finetune_refuses_a_protein_labeled_twice_with_other_classes(tmp_path, ckpts, labeled):
    from protein_performer.finetune import finetune
    with pytest.raises(UserError, match=r"contradictory\.csv:62: protein '.*' labeled '.', but '.' on line 5; "
                                        r"one label per protein"):
        finetune(ckpts["mlm"], labeled["contradictory"], "classification", tmp_path / "ft")


def test_regression_replicates_are_kept_and_counted(tmp_path, caplog):
    """A measurement repeated with another value (the bundled stability set has 42) is a replicate:
    counted in a warning, not refused."""
    from protein_performer.finetune import read_examples
    p = tmp_path / "r.csv"
    p.write_text("sequence,label\nMKTAYIAKQ,1.5\nMKVLAAGIV,2.0\nMKTAYIAKQ,1.7\nMKVLAAGIV,2.0\n")
    with caplog.at_level(logging.WARNING, logger="protein_performer"):
        ex = read_examples(p, "regression")
    assert len(ex.ids) == 4 and "2 rows repeat a protein listed before (1 with another value: replicates)" in caplog.text


# --- finding 6: conflicts -------------------------------------------------------------------
@pytest.mark.parametrize("case", ["architecture", "init_from with ckpt_path", "objective"])
def test_conflicting_start_settings_are_one_line(tmp_path, capsys, monkeypatch, small_fasta, ckpts, case):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    args = {"architecture": [f"init_from={ckpts['mlm']}", "model.dim=64", "model.depth=4"],
            "init_from with ckpt_path": [f"init_from={ckpts['mlm']}", f"ckpt_path={ckpts['mlm']}"],
            "objective": ["objective=clm", f"ckpt_path={ckpts['mlm']}"]}[case]
    base = [a for a in TRAIN if not a.startswith(("model.dim", "model.depth"))]
    line = one_line(*run_main(capsys, "train", *base, f"data.path={small_fasta}", f"hydra.run.dir={run}", *args))
    expected = {"architecture": "its model has model.dim=32, model.depth=2, but the command line sets model.dim=64, "
                                "model.depth=4",
                "init_from with ckpt_path": "init_from=", "objective": "a checkpoint of objective=mlm, but this "
                                                                       "run's objective is clm"}[case]
    assert expected in line and (case != "init_from with ckpt_path" or "ckpt_path=" in line)
    assert not run.exists()


def test_init_from_with_the_checkpoints_own_architecture_is_no_conflict(ckpts):
    from protein_performer.training.distill import check_architecture
    from protein_performer.training.task import load_checkpoint
    source = load_checkpoint(ckpts["mlm"]).model
    check_architecture(source, {"dim": 32, "depth": 2}, ["model.dim=32", "model.attention.kernel=relu"], "init_from")
    with pytest.raises(UserError, match=r"model\.heads=2, but the command line sets model\.heads=4"):
        check_architecture(source, {"heads": 4}, ["+model.heads=4"], "init_from")


# --- finding 8: settings accepted and ignored ------------------------------------------------
def test_continuous_labels_are_not_classes(tmp_path, ckpts, labeled, caplog):
    """Refused before the split, whose line (validation proteins held out per class) would treat them
    as classes just before the refusal."""
    from protein_performer.finetune import finetune
    caplog.set_level("INFO", logger="protein_performer")
    with pytest.raises(UserError, match=r"distinct labels among 60 proteins \(numbers, not all whole.*"
                                        r"do not look like classes; for measurements use task=regression"):
        finetune(ckpts["mlm"], labeled["continuous"], "classification", tmp_path / "ft")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("protein_performer")] == []
    from protein_performer.probe import check_classes
    check_classes(["a", "b"] * 50 + [str(i) for i in range(15)], "x")  # 17 classes: fine
    with pytest.raises(UserError, match="do not look like classes"):
        check_classes([f"{i / 7:.3f}" for i in range(200)], "x")


@pytest.mark.parametrize("residue", ["X", "B", "U"])
def test_score_refuses_mutations_to_non_standard_residues(tmp_path, capsys, ckpts, residue):
    from conftest import run_command
    assay = tmp_path / "assay.csv"
    assay.write_text(f"mutant,DMS_score\nM1A,0.1\nK2{residue},0.2\n")
    code, out, err = run_command("score", capsys, f"ckpt={ckpts['mlm']}", f"input={assay}",
                                 f"sequence={PROTEINS['P1']}", f"output={tmp_path / 's.csv'}")
    line = one_line(code, out, err)
    assert f"{assay}:3: mutant 'K2{residue}': '{residue}' is not one of the 20 standard amino acids" in line
    assert not (tmp_path / "s.csv").exists()


# --- finding 9: no traceback -----------------------------------------------------------------
@pytest.mark.parametrize("override,expected", [
    ("+trainer.max_step=3", "trainer.max_step: pytorch_lightning.trainer.trainer.Trainer takes no such argument "
                            "(did you mean max_steps?)"),
    ("trainer.max_steps=-5", "trainer: `max_steps` must be a non-negative integer or -1"),
])
def test_lightnings_errors_are_one_line_and_leave_no_run_folder(tmp_path, capsys, monkeypatch, small_fasta,
                                                               override, expected):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "r"
    line = one_line(*run_main(capsys, "train", *TRAIN, f"data.path={small_fasta}", f"hydra.run.dir={run}", override))
    assert expected in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="trainer=gpu runs where there is a GPU")
def test_trainer_gpu_without_a_gpu_is_one_line(tmp_path, capsys, monkeypatch, small_fasta):
    monkeypatch.chdir(tmp_path)
    line = one_line(*run_main(capsys, "train", *TRAIN, f"data.path={small_fasta}", "hydra.run.dir=run",
                              "trainer=gpu"))
    assert line.startswith("error: trainer: ") and "gpu" in line.lower()
    assert not (tmp_path / "run").exists()


def test_library_error_translation_names_the_key():
    from hydra.errors import InstantiationException
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    from protein_performer.errors import user_error
    try:
        try:
            raise MisconfigurationException("No supported gpu backend found!")
        except Exception as e:
            raise InstantiationException("Error in call to target 'pytorch_lightning.Trainer':\n"
                                         "MisconfigurationException(...)\nfull_key: trainer") from e
    except Exception as e:
        assert str(user_error(e)) == "trainer: No supported gpu backend found!"
    assert user_error(RuntimeError("a bug")) is None  # a bug keeps its traceback


@pytest.mark.parametrize("case", ["single example of each class", "inf label", "task=foo", "folds=1",
                                  "continuous classes"])
def test_probe_bad_labels_and_settings_are_one_line(tmp_path, capsys, case):
    import h5py
    import numpy as np

    from conftest import run_command
    ids = [f"p{i}" for i in range(40)]
    h5 = tmp_path / "e.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
        f["mean"] = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    labels = tmp_path / "l.csv"
    rows = {"single example of each class": ["p0,a", "p1,b"],
            "inf label": [f"{i},{k / 2 if k else 'inf'}" for k, i in enumerate(ids)],
            "task=foo": [f"{i},{'ab'[k % 2]}" for k, i in enumerate(ids)],
            "folds=1": [f"{i},{'ab'[k % 2]}" for k, i in enumerate(ids)],
            "continuous classes": [f"{i},{k / 7:.4f}" for k, i in enumerate(ids)]}[case]
    labels.write_text("id,label\n" + "\n".join(rows) + "\n")
    extra = {"task=foo": ["task=foo"], "folds=1": ["folds=1"], "continuous classes": ["task=classification"]}
    line = one_line(*run_command("probe", capsys, f"embeddings={h5}", f"labels={labels}", *extra.get(case, [])))
    assert {"single example of each class": "2 training proteins; the probe's 5-fold cross-validation needs",
            "inf label": "protein 'p0': label 'inf' is not a finite number",
            "task=foo": "task='foo': choose auto, classification or regression",
            "folds=1": "folds=1: the cross-validation's folds",
            "continuous classes": "do not look like classes"}[case] in line


def test_evaluate_score_export_bad_values_are_one_line(tmp_path, capsys, monkeypatch, ckpts, small_fasta):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("mine\n")
    assay = tmp_path / "assay.csv"
    assay.write_text("mutant\nM1A\n")
    line = one_line(*run_main(capsys, "evaluate", f"ckpt={ckpts['mlm']}", f"data.path={small_fasta}",
                              "data.max_records=-1", "output_dir=ev"))
    assert "data.max_records=-1: a positive number" in line
    line = one_line(*run_main(capsys, "score", f"ckpt={ckpts['mlm']}", f"input={assay}", f"sequence={PROTEINS['P1']}",
                              "offset=abc", "output=s.csv"))
    assert "offset='abc': the number of the wild type's first residue, an integer" in line
    for output in (".", str(tmp_path), "..", str(tmp_path.parent)):
        line = one_line(*run_main(capsys, "export", f"ckpt={ckpts['mlm']}", f"output={output}"))
        assert "is the current folder or one above it" in line or "holds the input ckpt" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["assay.csv", "mine.txt"]


def fair_esm_file(path: Path, dim: int = 8, depth: int = 1, heads: int = 2, **claims) -> Path:
    """A fair-esm ESM-2 checkpoint of random tensors (``claims``: what its config says instead)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.1  # noqa: E731
    embed = r(33, dim)
    state = {"embed_tokens.weight": embed, "emb_layer_norm_after.weight": r(dim), "emb_layer_norm_after.bias": r(dim),
             "lm_head.dense.weight": r(dim, dim), "lm_head.dense.bias": r(dim), "lm_head.layer_norm.weight": r(dim),
             "lm_head.layer_norm.bias": r(dim), "lm_head.bias": r(33), "lm_head.weight": embed}
    for i in range(depth):
        for name, shape in (("self_attn_layer_norm", (dim,)), ("final_layer_norm", (dim,)),
                            ("self_attn.q_proj", (dim, dim)), ("self_attn.k_proj", (dim, dim)),
                            ("self_attn.v_proj", (dim, dim)), ("self_attn.out_proj", (dim, dim)),
                            ("fc1", (4 * dim, dim)), ("fc2", (dim, 4 * dim))):
            state[f"layers.{i}.{name}.weight"], state[f"layers.{i}.{name}.bias"] = r(*shape), r(shape[0])
    state = {("encoder." if k.startswith("lm_head") else "encoder.sentence_encoder.") + k: v for k, v in state.items()}
    cfg = {"encoder_layers": depth, "encoder_embed_dim": dim, "encoder_attention_heads": heads, "token_dropout": True,
           **claims}
    torch.save({"model": state, "cfg": {"model": argparse.Namespace(**cfg)}}, path)
    return path


def test_fair_esm_config_is_checked_before_any_allocation(tmp_path, monkeypatch):
    from protein_performer import convert_esm
    with pytest.raises(UserError, match=r"encoder_layers is 1\.5, not a positive integer"):
        convert_esm.convert(fair_esm_file(tmp_path / "frac.pt", encoder_layers=1.5), tmp_path / "o1")
    with pytest.raises(UserError, match=r"encoder_attention_heads is 'two', not a positive integer"):
        convert_esm.convert(fair_esm_file(tmp_path / "str.pt", encoder_attention_heads="two"), tmp_path / "o2")
    built = []
    real = convert_esm.PerformerLM

    def recording(config):  # a model the config claims, allocated for real: what the small file must not cause
        on_meta = torch.empty(0).device.type == "meta"
        assert on_meta or config.dim < 1000, f"allocated a dim-{config.dim} model before checking the shapes"
        built.append(on_meta)
        return real(config)
    monkeypatch.setattr(convert_esm, "PerformerLM", recording)
    huge = fair_esm_file(tmp_path / "huge.pt", encoder_embed_dim=5120, encoder_attention_heads=40)
    assert huge.stat().st_size < 125_000
    with pytest.raises(UserError, match=r"huge\.pt: .* has shape \(33, 8\), the model its config describes needs "
                                        r"\(33, 5120\)"):
        convert_esm.convert(huge, tmp_path / "o3")
    assert built == [True]
    convert_esm.convert(fair_esm_file(tmp_path / "ok.pt"), tmp_path / "o4")  # the same file, honest: converts
    assert built == [True, True, False] and (tmp_path / "o4" / "model.safetensors").is_file()
    assert not any((tmp_path / n).exists() for n in ("o1", "o2", "o3"))


# --- finding 10: only train writes under outputs/ ------------------------------------------------
def test_only_train_creates_an_outputs_folder(tmp_path, capsys, monkeypatch, ckpts, small_fasta):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "evaluate", f"ckpt={ckpts['mlm']}", f"data.path={small_fasta}",
                            "data.max_records=5", "output_dir=ev", "progress=false")
    assert code == 0 and (tmp_path / "ev" / "metrics.json").is_file(), err
    code, _, err = run_main(capsys, "export", f"ckpt={ckpts['mlm']}", "output=exported")
    assert code == 0 and (tmp_path / "exported" / "config.json").is_file(), err
    esm = fair_esm_file(tmp_path / "esm.pt")
    code, _, err = run_main(capsys, "convert-esm", f"input={esm}", "output=converted")
    assert code == 0 and (tmp_path / "converted" / "config.json").is_file(), err
    for command, args in (("evaluate", ["ckpt=nope.ckpt", "output_dir=ev2"]), ("export", ["ckpt=nope", "output=x"]),
                          ("convert-esm", ["input=nope.pt", "output=y"])):
        one_line(*run_main(capsys, command, *args))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted", "esm.pt", "ev", "exported"]
    assert not list(tmp_path.rglob("*.log")) and not list(tmp_path.rglob(".hydra"))
    before = checksums(tmp_path)
    code, _, err = run_main(capsys, "evaluate", f"ckpt={ckpts['mlm']}", f"data.path={small_fasta}",
                            "data.max_records=5", "progress=false")  # the default output_dir
    assert code == 0, err
    made = sorted(set(checksums(tmp_path)) - set(before))
    assert made and all(re.fullmatch(r"evaluation(/[\d-]+){0,2}(/[^/]+)?", m) for m in made), made
    assert not (tmp_path / "outputs").exists()


# --- re-check of issue 44: what the first pass left ----------------------------------------------
def test_a_failed_run_in_a_folder_with_checkpoints_leaves_every_file_as_it_was(tmp_path, capsys, monkeypatch,
                                                                             small_fasta):
    """A failed run (overwrite=true or not) in an old run's folder appended to its train.log and
    added .hydra.pending/ names to its journal."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    code, _, err = run_main(capsys, "train", *TRAIN, f"data.path={small_fasta}", f"hydra.run.dir={run}")
    assert code == 0 and (run / "checkpoints" / "last.ckpt").is_file(), err[-3000:]
    before = checksums(run)
    for bad in (["overwrite=true", "optim.lr=-1"], ["overwrite=true", f"data.path={tmp_path / 'missing.fasta'}"],
                ["overwrite=true", "trainer.max_steps=-5"], [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
                                                              "objective=clm"]):
        line = one_line(*run_main(capsys, "train", *TRAIN, f"data.path={small_fasta}", f"hydra.run.dir={run}", *bad))
        assert line.startswith("error: "), line
        assert checksums(run) == before, (bad, line)  # train.log, the journal, .hydra/, checkpoints: unchanged
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("command, args, key, value", [
    ("probe", ["embeddings=e.h5", "labels=l.csv", "output=mine.json"], "overwrite", "nope"),
    ("evaluate", ["ckpt=m.ckpt", "output_dir=ev"], "progress", "nope"),
    ("embed", ["ckpt=m.ckpt", "input=p.fasta", "output=mine.json"], "per_residue", "1"),
    ("train", ["hydra.run.dir=run"], "overwrite", "yes"),  # compile is auto | true | false: tests/test_compile.py
    ("finetune", ["ckpt=m.ckpt", "labels=l.csv", "task=regression", "output_dir=ft"], "lora", "maybe")])
def test_a_true_or_false_key_given_another_value_is_one_line(tmp_path, capsys, monkeypatch, command, args, key, value):
    """overwrite=nope read as true (Python's bool of a non-empty string) and replaced the user's file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.json").write_text('{"mine": 1}\n')
    before = checksums(tmp_path)
    line = one_line(*run_main(capsys, command, *args, f"{key}={value}"))
    shown = repr(int(value)) if value.isdigit() else repr(value)
    assert line == f"error: {key}={value}: {key} is true or false, not {shown}"
    assert checksums(tmp_path) == before


def test_compare_refuses_an_exact_reference_that_is_no_model(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line(*run_main(capsys, "compare", "exact=nope", "models=[performer,linear]", "hydra.run.dir=cmp",
                              "heldout.max_records=5", "train.data.max_records=50", "trainer.max_steps=2"))
    assert line == ("error: exact=nope: no such model (conf/model/nope.yaml); exact names the exact-softmax "
                    "reference the gaps are measured against, one of models=['performer', 'linear']")
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_an_unfinished_finetune_output(tmp_path, capsys, ckpts, labeled):
    """finetune writes metrics.json last; a folder without it may hold half its files."""
    from protein_performer.finetune import finetune
    ft = tmp_path / "ft"
    finetune(ckpts["mlm"], labeled["classes"], "classification", ft, trainer={"max_epochs": 1})
    (ft / "metrics.json").unlink()
    before = checksums(tmp_path)
    line = one_line(*run_main(capsys, "export", f"ckpt={ft}", f"output={tmp_path / 'exported'}"))
    assert line == (f"error: ckpt={ft}: an unfinished finetune output (no metrics.json: finetune was cut short in "
                    f"its final writes); rerun the same finetune command to complete it")
    assert checksums(tmp_path) == before

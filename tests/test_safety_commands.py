"""evaluate, generate, export, probe and prepare: no code from a user's file, nothing but their
own outputs written or replaced, settings checked before work, and a kill -9 at any of a few
seeded points followed by a rerun gives what a clean run gives.

Each command runs as ``protein-performer <command>`` runs it (its config composed by Hydra,
inside the ``cli`` wrapper), in this process; the fault injection runs child processes."""
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch


from conftest import ROOT, dead_pid, run_command
from forkserver import forks

PROTEINS = {"P1": "MKTAYIAKQRQISFVKSHFSRQ", "P2": "MQIFVKTLTGKTITLEVEPSDT", "P3": "MSDNGPQNQRNAPRITFGGPSD",
            "P4": "MKVLAAGIVGLLLAQPALA", "P5": "MSTNPKPQRKTKRNTNRRPQDVKFPGG"}


class Evil:
    """Unpickling this creates ``marker``: what a checkpoint with code in it would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def evil_file(path: Path, marker: Path, real: str | None = None) -> Path:
    """A torch.save file holding an Evil object (beside a real checkpoint's content, if given)."""
    ckpt = torch.load(real, weights_only=True) if real else {"state_dict": {}, "global_step": 3}
    torch.save({**ckpt, "hyper_parameters": {**ckpt.get("hyper_parameters", {}), "x": Evil(marker)}}, path)
    return path


def run(name: str, capsys, *overrides: str) -> tuple[int, str]:
    """``protein-performer <name> OVERRIDES`` in this process: (exit status, stderr)."""
    code, _, err = run_command(name, capsys, *overrides)
    return code, err

def refused(name: str, capsys, *overrides: str) -> str:
    code, err = run(name, capsys, *overrides)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err[-3000:])
    return lines[0]


def checksums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def user_folder(d: Path) -> Path:
    """A folder of the user's own files, named like the project's (they must survive every command)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text("mine: true\n")
    (d / "train.log").write_text("my log\n")
    torch.save({"my": torch.arange(3)}, d / "mine.pt")
    (d / "notes.txt").write_text("notes\n")
    (d / ".hydra").mkdir(exist_ok=True)
    (d / ".hydra" / "config.yaml").write_text("mine\n")
    return d


def assert_only_added(before: dict, after: dict, added: set[str]) -> None:
    """Every file that was there is unchanged; the new ones are exactly ``added``."""
    assert {k: after.get(k) for k in before} == before
    assert set(after) - set(before) == added


@pytest.fixture
def fasta(tmp_path) -> Path:
    p = tmp_path / "proteins.fasta"
    p.write_text("".join(f">{k}\n{v}\n" for k, v in PROTEINS.items()))
    return p


def write_h5(path, ids, X, **attrs):
    with h5py.File(path, "w") as f:
        f.create_dataset("ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
        f["mean"] = np.asarray(X, dtype=np.float32)
        f.attrs.update(attrs)
    return path


# --- 1. no code from a file -----------------------------------------------------------------
def test_the_crafted_pickle_does_run_code_when_unpickled(tmp_path):
    """The reference for the tests below: the file is armed."""
    evil = evil_file(tmp_path / "evil.ckpt", tmp_path / "marker")
    torch.load(evil, weights_only=False)
    assert (tmp_path / "marker").is_file()


@pytest.mark.parametrize("real", [False, True], ids=["pickle", "checkpoint-with-pickle"])
@pytest.mark.parametrize("command", ["evaluate", "generate", "export", "probe"])
def test_no_command_runs_code_from_a_file(tmp_path, capsys, monkeypatch, ckpts, fasta, command, real):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch's default may not protect
    marker = tmp_path / "marker"
    evil = evil_file(tmp_path / "evil.ckpt", marker, ckpts["clm"] if real else None)
    labels = tmp_path / "labels.csv"
    labels.write_text("id,label\nP1,a\nP2,b\n")
    args = {"evaluate": [f"ckpt={evil}", f"data.path={fasta}", f"output_dir={tmp_path / 'out'}", "progress=false"],
            "generate": [f"ckpt={evil}", f"output={tmp_path / 'out.fasta'}", "num_samples=2", "max_length=5"],
            "export": [f"ckpt={evil}", f"output={tmp_path / 'out'}"],
            "probe": [f"embeddings={evil}", f"labels={labels}", f"output={tmp_path / 'out.json'}"]}[command]
    before = checksums(tmp_path)
    line = refused(command, capsys, *args)
    assert str(evil) in line
    assert not marker.exists()
    assert_only_added(before, checksums(tmp_path), set())  # refused before the output is locked: nothing left


def test_the_step_of_a_checkpoint_is_read_without_unpickling(tmp_path, monkeypatch, ckpts):
    from protein_performer.hub.load import checkpoint_step
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert checkpoint_step(evil_file(tmp_path / "e.ckpt", tmp_path / "marker")) is None
    assert checkpoint_step(evil_file(tmp_path / "r.ckpt", tmp_path / "marker", ckpts["mlm"])) is None
    assert not (tmp_path / "marker").exists()
    assert checkpoint_step(ckpts["mlm"]) == 0  # a real one: its step


# --- 2. only the command's own outputs, never over an input ---------------------------------
def test_generate_writes_its_two_outputs_and_nothing_over_an_input(tmp_path, capsys, ckpts):
    work = user_folder(tmp_path / "work")
    ckpt = work / "clm.ckpt"
    ckpt.write_bytes(Path(ckpts["clm"]).read_bytes())
    odd = work / "m.json"  # a checkpoint named like a report
    odd.write_bytes(ckpt.read_bytes())
    before = checksums(work)
    common = ["num_samples=2", "max_length=8", "seed=0", "device=cpu"]
    assert "temperature must be >= 0" in refused("generate", capsys, f"ckpt={ckpt}", f"output={work}/s.fasta",
                                                  "temperature=-1", *common)
    assert refused("generate", capsys, f"ckpt={ckpt}", f"output={ckpt}", *common) == \
        f"error: output={ckpt}: is the input ckpt={ckpt}; choose another output"
    assert "output (its report)" in refused("generate", capsys, f"ckpt={odd}", f"output={work}/m.fasta", *common)
    assert_only_added(before, checksums(work), set())
    code, err = run("generate", capsys, f"ckpt={ckpt}", f"output={work}/samples.json", *common)
    assert code == 0, err
    after = checksums(work)
    assert_only_added(before, after, {"samples.json", "samples.report.json"})
    assert (work / "samples.json").read_text().count(">sample_") == 2  # the FASTA, not the report
    assert json.loads((work / "samples.report.json").read_text())["summary"]["num_samples"] == 2


def test_export_never_replaces_a_folder_it_did_not_write(tmp_path, capsys, ckpts):
    run_dir = user_folder(tmp_path / "run")
    (run_dir / "checkpoints").mkdir()
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(Path(ckpts["mlm"]).read_bytes())
    (run_dir / "checkpoints" / "best-3.ckpt").write_bytes(ckpt.read_bytes())
    before = checksums(tmp_path)
    for output, message in ((run_dir, f"output={run_dir}: holds the input ckpt={ckpt}"),
                            (run_dir / "checkpoints", "holds the input ckpt"),
                            (ckpt, "is the input ckpt")):
        assert message in refused("export", capsys, f"ckpt={ckpt}", f"output={output}", "overwrite=true")
    mine = user_folder(tmp_path / "mine")
    before = checksums(tmp_path)
    assert "not a directory written by export" in refused("export", capsys, f"ckpt={ckpt}", f"output={mine}",
                                                          "overwrite=true")
    assert_only_added(before, checksums(tmp_path), set())  # its lock too: removed by the run that made it
    before = checksums(tmp_path)
    code, err = run("export", capsys, f"ckpt={ckpt}", f"output={run_dir}/export")
    assert code == 0, err
    after = checksums(tmp_path)
    written = {k for k in after if k.startswith("run/export/")}
    assert {Path(k).name for k in written} >= {"config.json", "model.safetensors", "README.md"}
    assert_only_added(before, after, written)
    (run_dir / "export" / "notes.txt").write_text("added by the user\n")
    assert "holds notes.txt, not written by export" in refused("export", capsys, f"ckpt={ckpt}",
                                                              f"output={run_dir}/export", "overwrite=true")
    (run_dir / "export" / "notes.txt").unlink()
    code, err = run("export", capsys, f"ckpt={ckpt}", f"output={run_dir}/export", "overwrite=true")
    assert code == 0, err
    assert checksums(tmp_path) == after  # replaced by the same export, nothing else touched


def test_evaluate_writes_only_its_metrics(tmp_path, capsys, ckpts, fasta):
    work = user_folder(tmp_path / "work")
    before = checksums(work)
    args = [f"ckpt={ckpts['mlm']}", f"data.path={fasta}", f"output_dir={work}", "progress=false", "device=cpu"]
    for bad in ("0", "-0.2", "1.5", "1"):
        assert refused("evaluate", capsys, *args, f"mask_prob={bad}") == \
            f"error: mask_prob must be in (0, 1), got {bad}"
    data_out = work / "metrics.json"
    data_out.write_text(fasta.read_text())  # a FASTA named like an output
    before = checksums(work)
    assert "is the input data.path" in refused("evaluate", capsys, *args[:1], f"data.path={data_out}", *args[2:])
    data_out.unlink()
    before.pop("metrics.json")
    code, err = run("evaluate", capsys, *args)
    assert code == 0, err
    assert_only_added(before, checksums(work), {"metrics.json", "metrics.csv", "metrics.png",
                                                ".protein-performer-written.json"})  # and its journal
    assert json.loads((work / "metrics.json").read_text())["num_sequences"] == len(PROTEINS)


def test_probe_writes_only_its_results(tmp_path, capsys):
    work = user_folder(tmp_path / "work")
    rng = np.random.default_rng(0)
    ids = [f"p{i}" for i in range(40)]
    write_h5(work / "e.h5", ids, rng.normal(size=(40, 4)))
    (work / "labels.csv").write_text("id,label\n" + "".join(f"{i},{k % 2}\n" for k, i in enumerate(ids)))
    before = checksums(work)
    args = [f"embeddings={work / 'e.h5'}", f"labels={work / 'labels.csv'}", "folds=2", "shuffle_control=false"]
    assert refused("probe", capsys, *args, f"output={work / 'labels.csv'}") == \
        f"error: output={work / 'labels.csv'}: is the input labels={work / 'labels.csv'}; choose another output"
    assert_only_added(before, checksums(work), set())
    code, err = run("probe", capsys, *args, f"output={work / 'probe.json'}")
    assert code == 0, err
    assert_only_added(before, checksums(work), {"probe.json"})
    assert json.loads((work / "probe.json").read_text())["n_train"] == 40


def test_evaluate_replaces_its_own_metrics_but_not_a_copy_the_user_changed(tmp_path, capsys, ckpts, fasta):
    """A file evaluate wrote and the user then edited is the user's: the rerun compares contents with
    what it wrote (the journal's SHA-256), not only names, and refuses without overwrite=true."""
    out = tmp_path / "eval"
    args = [f"ckpt={ckpts['mlm']}", f"data.path={fasta}", f"output_dir={out}", "progress=false", "device=cpu"]
    assert run("evaluate", capsys, *args) == (0, "")
    assert run("evaluate", capsys, *args)[0] == 0  # its own, unchanged: replaced without a word
    metrics = out / "metrics.json"
    edited = json.loads(metrics.read_text())
    edited["note"] = "checked by hand"
    metrics.write_text(json.dumps(edited))
    before = checksums(out)
    assert refused("evaluate", capsys, *args) == (
        f"error: output_dir/metrics.json={metrics}: exists; pass overwrite=true to replace it (changed since "
        f"evaluate wrote it) or choose another output_dir/metrics.json")
    assert checksums(out) == before
    code, err = run("evaluate", capsys, *args, "overwrite=true")
    assert code == 0 and err == (f"warning: output_dir/metrics.json: overwrite=true replaces {metrics}, changed "
                                 f"since evaluate wrote it\n")
    assert "note" not in json.loads(metrics.read_text())


def kill_left_overs(outputs: list[Path]) -> tuple[list[Path], list[Path]]:
    """(what a run killed -9 inside its atomic writes leaves beside ``outputs``: hidden temporaries named
    by a dead pid, files a rerun must not keep), (files beside them that no killed run left)."""
    dead = dead_pid()
    left = [o.with_name(f".{o.name}.{dead}.tmp") for o in outputs]
    kept = [outputs[0].with_name(n) for n in (f".{outputs[0].name}.{os.getppid()}.tmp",  # a live writer's
                                              f".notes.txt.{dead}.tmp", f".{outputs[0].name}.mine.tmp")]
    for p in left + kept:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("half\n")
    return left, kept


def test_a_rerun_after_a_kill_removes_the_killed_runs_temporaries(tmp_path, capsys, ckpts, fasta):
    """score, evaluate, probe and generate, rerun after a kill -9 mid-write, remove the hidden temporary
    copies of their outputs that the killed run left (as finetune does), and nothing else."""
    from protein_performer.generate import report_path
    work = tmp_path / "work"
    rng = np.random.default_rng(0)
    ids = [f"p{i}" for i in range(40)]
    write_h5(tmp_path / "e.h5", ids, rng.normal(size=(40, 4)))
    (tmp_path / "labels.csv").write_text("id,label\n" + "".join(f"{i},{k % 2}\n" for k, i in enumerate(ids)))
    (tmp_path / "assay.csv").write_text("mutant,DMS_score\nM1A,0.1\nK2R,0.5\nT3S,0.2\nA4G,0.9\n")
    runs = {"evaluate": ([work / "metrics.json", work / "metrics.csv", work / "metrics.png",
                          work / ".protein-performer-written.json"],
                         [f"ckpt={ckpts['mlm']}", f"data.path={fasta}", f"output_dir={work}", "progress=false",
                          "device=cpu"]),
            "score": ([work / "scored.csv", work / "scored.metrics.json"],
                      [f"ckpt={ckpts['mlm']}", f"input={tmp_path / 'assay.csv'}", f"sequence={PROTEINS['P1']}",
                       f"output={work / 'scored.csv'}", "device=cpu"]),
            "probe": ([work / "probe.json"], [f"embeddings={tmp_path / 'e.h5'}", f"labels={tmp_path / 'labels.csv'}",
                                              "folds=2", "shuffle_control=false", f"output={work / 'probe.json'}"]),
            "generate": ([work / "s.fasta", Path(report_path(work / "s.fasta"))],
                         [f"ckpt={ckpts['clm']}", f"output={work / 's.fasta'}", "num_samples=2", "max_length=8",
                          "device=cpu"])}
    for command, (outputs, args) in runs.items():
        left, kept = kill_left_overs(outputs)
        code, err = run(command, capsys, *args)
        assert code == 0, (command, err)
        assert [p for p in left if p.exists()] == [] and all(p.exists() for p in kept), command
        assert all(p.is_file() for p in outputs), command


def test_prepare_writes_only_into_its_data_folder(tmp_path, capsys):
    work = user_folder(tmp_path / "work")
    (work / "p.fasta").write_text("".join(f">{k}\n{v}\n" for k, v in PROTEINS.items()) * 2)  # duplicates
    (work / "bad.fasta").write_text(">A\nMKV\n>B\nMKL\n>A\nMKW\n")
    before = checksums(work)
    args = ["data=fasta", f"data.data_dir={work / 'cache'}", "data.prepare_workers=0", "data.progress=false",
            "data.valid_fraction=0.4", "data.test_fraction=0"]
    assert refused("prepare", capsys, *args, f"data.path={work / 'bad.fasta'}", "data.on_invalid=error") == \
        f"error: {work / 'bad.fasta'}:5: record 'A': repeats an earlier record's id with a different sequence " \
        f"(rename one, or set data.on_invalid=skip to count and skip such records)"
    assert {k for k in checksums(work) if k not in before} <= {k for k in checksums(work) if k.startswith("cache/")}
    assert not list((work / "cache").rglob("*.tokens"))
    code, err = run("prepare", capsys, *args, f"data.path={work / 'p.fasta'}")
    assert code == 0, err
    after = checksums(work)
    assert {k: after[k] for k in before} == before
    assert all(k.startswith("cache/") for k in set(after) - set(before))


# --- 3. settings checked before any work ----------------------------------------------------
def _probe_case(tmp_path, case):
    rng = np.random.default_rng(1)
    ids = [f"p{i}" for i in range(30)]
    X = rng.normal(size=(30, 4))
    train, test = tmp_path / "train.csv", tmp_path / "test.csv"
    labels = {i: str(k % 2) for k, i in enumerate(ids)}
    e1 = write_h5(tmp_path / "a.h5", ids[:20], X[:20], checkpoint_sha256="aaa", layers=[2])
    e2 = write_h5(tmp_path / "b.h5", ids[20:], X[20:], checkpoint_sha256="aaa", layers=[2])
    extra = []
    if case == "one class":
        labels = dict.fromkeys(ids, "x")
    elif case == "nan labels":
        labels = dict.fromkeys(ids, "NaN")
    elif case == "dimensions":
        write_h5(e2, ids[20:], X[20:, :3], checkpoint_sha256="aaa", layers=[2])
    elif case == "two models":
        write_h5(e2, ids[20:], X[20:], checkpoint_sha256="bbb", layers=[2])
    elif case == "non-finite":
        X[3, 1] = np.nan
        write_h5(e1, ids[:20], X[:20], checkpoint_sha256="aaa", layers=[2])
    train.write_text("id,label\n" + "".join(f"{i},{labels[i]}\n" for i in ids[:20]))
    if case == "contradictory":
        train.write_text(train.read_text() + "p3,1\np3,0\n")  # line 22 repeats line 5, line 23 contradicts it
    test.write_text("id,label\n" + "".join(f"{i},{labels[i]}\n" for i in (ids[:20] if case == "same test" else ids[20:])))
    if case not in ("one class", "nan labels", "contradictory"):
        extra = [f"test_labels={test}"]
    return [f"embeddings=[{e1},{e2}]", f"labels={train}", *extra, "folds=2", f"output={tmp_path / 'r.json'}"]


PROBE_CASES = {
    "one class": r"train\.csv: every training protein has the same label 'x'; a probe needs at least two classes",
    "nan labels": r"train\.csv: no labeled rows",
    "dimensions": r"embeddings .*b\.h5: dimension 3, but .*a\.h5 has 4; embed both with the same model",
    "two models": r"embeddings .*b\.h5: made with another model than .*a\.h5 \(checkpoint_sha256 bbb vs aaa\)",
    "non-finite": r"embeddings .*a\.h5: protein 'p3' has a non-finite embedding",
    "contradictory": r"train\.csv:23: protein 'p3' labeled '0', but '1' on line 5; one label per protein",
    "same test": r"labels .*test\.csv: every test protein is also a training protein",
}


@pytest.mark.parametrize("case", PROBE_CASES)
def test_probe_refuses_what_it_cannot_score_honestly(tmp_path, capsys, case):
    import re
    args = _probe_case(tmp_path, case)
    before = checksums(tmp_path)
    line = refused("probe", capsys, *args)
    assert re.search(PROBE_CASES[case], line), line
    assert checksums(tmp_path) == before


def test_probe_warns_about_missing_labels_and_shared_proteins(tmp_path, capsys, caplog):
    args = _probe_case(tmp_path, "ok")
    train = tmp_path / "train.csv"
    train.write_text(train.read_text() + "p25,NA\np26,\n")  # no label: skipped and counted
    test = tmp_path / "test.csv"
    test.write_text(test.read_text() + "p0,0\n")  # a training protein in the test set
    caplog.set_level("WARNING", logger="protein_performer")
    code, err = run("probe", capsys, *args)
    assert code == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["n_train"] == 20 and r["n_test"] == 11 and r["skipped_rows"]["empty"] == 2
    text = " ".join(m.getMessage() for m in caplog.records)
    assert "skipped 2 rows without a label" in text and "1 of 11 test proteins" in text


# --- 6. kill -9 and rerun: what a clean run gives --------------------------------------------
KILLER = """
import os, signal, sys
import numpy as np, shutil
{imports}
n, calls = int(sys.argv[1]), [0]
def arm(owner, name):
    f = getattr(owner, name)
    def counted(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return f(*a, **k)
    setattr(owner, name, counted)
for owner, name in ((os, "replace"), (os, "fsync"), (os, "mkdir"), (np, "save"), (shutil, "copyfile"),
                    (shutil, "rmtree")):
    arm(owner, name)
{call}
print("calls", calls[0])
"""


def killed_at(job: str, n: int, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``job`` ("imports; call") in a child that, once the imports are done, SIGKILLs itself
    before its n-th write-like call (0: never); the child is forked with torch and the package
    imported (tests/forkserver.py)."""
    imports, call = job.split("; ", 1)
    return forks().run([sys.executable, "-c", KILLER.format(imports=imports, call=call), str(n)],
                       capture_output=True, text=True, cwd=cwd, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})


def kill_points(job: str, cwd: Path, k: int, seed: int) -> list[int]:
    clean = killed_at(job, 0, cwd)
    assert clean.returncode == 0, clean.stderr[-3000:]
    total = int(clean.stdout.split("calls")[-1])
    return sorted(random.Random(seed).sample(range(1, total + 1), min(k, total)))


def test_prepare_killed_at_seeded_points_resumes_to_the_clean_result(tmp_path):
    work = user_folder(tmp_path / "work")
    records = "".join(f">R{i}\n{'MKVLAGQRST'[i % 7:] * (3 + i % 5)}\n" for i in range(120))
    (work / "p.fasta").write_text(records + ">R3\nMWWWW\n" + records[:200])  # a repeated id, duplicates
    job = ("from protein_performer.data.prepare import prepare; "
           "prepare('p.fasta', out_dir='{out}', workers=0, block_size=256, blocks_per_part=2, "
           "on_invalid='skip', valid_fraction=0.2, test_fraction=0.1, progress=False)")
    points = kill_points(job.format(out="clean"), work, k=4, seed=17)
    clean = checksums(work / "clean")
    before = checksums(work)
    for n in points:
        out = f"run{n}"
        r = killed_at(job.format(out=out), n, work)
        assert r.returncode == -9, (n, r.returncode, r.stderr[-2000:])
        r = killed_at(job.format(out=out), 0, work)  # the rerun
        assert r.returncode == 0, r.stderr[-3000:]
        got = checksums(work / out)
        clean_m, got_m = (json.loads((work / d / "manifest.json").read_text()) for d in ("clean", out))
        for m in (clean_m, got_m):
            m.pop("seconds_last_run")
        assert got_m == clean_m, n
        assert {k: v for k, v in got.items() if k != "manifest.json"} == \
            {k: v for k, v in clean.items() if k != "manifest.json"}, n
    after = checksums(work)
    assert {k: after[k] for k in before} == before  # the user's files, the clean run
    assert all(k.split("/")[0] in {f"run{n}{lock}" for n in points for lock in ("", ".lock")}
               for k in set(after) - set(before))  # each run's folder and its lock: nothing else


def test_export_killed_at_seeded_points_leaves_the_old_or_the_new_export(tmp_path, ckpts):
    run_dir = user_folder(tmp_path / "run")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(Path(ckpts["mlm"]).read_bytes())
    job = ("import protein_performer.training.task\nfrom protein_performer.hub.export import export; "
           "export('run/checkpoints/last.ckpt', '{out}', overwrite=True)")
    points = kill_points(job.format(out="clean"), tmp_path, k=4, seed=5)
    clean = checksums(tmp_path / "clean")
    for n in points:
        out = tmp_path / f"out{n}"
        shutil.copytree(tmp_path / "clean", out)  # an earlier export (its journal lists its files) to replace
        (out / "README.md").write_text("the earlier export\n")
        earlier = checksums(out)
        before = checksums(tmp_path)
        r = killed_at(job.format(out=out.name), n, tmp_path)
        assert r.returncode == -9, (n, r.returncode, r.stderr[-2000:])
        assert out.is_dir() or (tmp_path / f".{out.name}.export.old").is_dir()  # never both gone
        r = killed_at(job.format(out=out.name), 0, tmp_path)  # the rerun
        assert r.returncode == 0, r.stderr[-3000:]
        assert checksums(out) == clean != earlier, n
        after = checksums(tmp_path)
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert all(k.startswith(f"{out.name}/") or k == f".{out.name}.export.lock" for k in changed), (n, changed)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")) in \
            ([], [f".{out.name}.export.lock"])  # nothing left of the killed run beside the output (but its lock)

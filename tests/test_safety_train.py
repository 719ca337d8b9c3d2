"""train never runs a file's code, deletes or replaces only what it wrote, answers every
error (Hydra's included) in one line with exit 2 and nothing left behind, and a run killed
with SIGKILL resumes to the result of an uninterrupted one. The commands run as a user runs
them (``python scripts/train.py``, a child process forked with the imports done: tests/forkserver.py)
where the point is what reaches the disk."""
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from protein_performer.errors import UserError
from protein_performer.training.run import train

from conftest import ROOT, TINY_MODEL, save_checkpoint
from forkserver import forks

TINY = ["model.dim=16", "model.depth=1", "model.heads=2", "model.attention.nb_features=8", "model.dropout=0.0",
        "data.max_len=48", "data.batch_size=16", "data.max_tokens=null", "data.crop_schedule=null",
        "data.valid_fraction=0.1", "optim.warmup_steps=2", "trainer.enable_progress_bar=false",
        "+trainer.enable_model_summary=false", "logger=none"]


@pytest.fixture(scope="module")
def fasta(small_fasta):
    return small_fasta


def command(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "train.py"), *args]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return forks().run(command(*args), capture_output=True, text=True, cwd=cwd, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))


def one_line_exit_2(out: subprocess.CompletedProcess) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    return lines[0]


def snapshot(d: Path) -> dict[str, str]:
    """Every file under ``d`` -> its SHA-256."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def train_in(run_dir: Path, fasta: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=TINY + [f"data.path={fasta}", *overrides])
    return train(cfg, run_dir)


def user_folder(d: Path) -> dict[str, str]:
    """A folder of the user's own, with files named like the ones a run writes."""
    (d / ".hydra").mkdir(parents=True)
    for name, data in {"config.yaml": b"lr: 1\n", "train.log": b"my notes\n", ".hydra/config.yaml": b"a: 1\n",
                       "notes.txt": b"keep me\n"}.items():
        (d / name).write_bytes(data)
    torch.save({"w": torch.arange(3)}, d / "x.pt")
    return snapshot(d)


# --- no code from files -------------------------------------------------------------------
class Payload:
    """Unpickling this creates the file ``marker`` (what an attacker's os.system would do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path, fasta):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "loops": {}, "epoch": Payload(marker)}, evil)
    out = run(*TINY, f"data.path={fasta}", f"ckpt_path={evil}", "hydra.run.dir=run", cwd=tmp_path)
    assert one_line_exit_2(out).startswith(f"error: ckpt_path={evil}: refused: it holds Python objects")
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.ckpt"]  # no run folder either
    torch.load(evil, weights_only=False)  # the payload is real: an unsafe load creates the marker
    assert marker.exists()


# --- deleting only what the run wrote -----------------------------------------------------
def test_resuming_another_folders_run_never_deletes_its_files(tmp_path, fasta):
    run_a, run_b = tmp_path / "runA", tmp_path / "runB"
    train_in(run_a, fasta, "trainer.max_steps=3", "trainer.val_check_interval=100")
    before = snapshot(run_a)
    assert {"checkpoints/last.ckpt", "checkpoints/best-3.ckpt"} <= set(before)
    # runB's final state becomes its best: the best path restored from runA's checkpoint was deleted
    train_in(run_b, fasta, "trainer.max_steps=5", "trainer.val_check_interval=100",
             f"ckpt_path={run_a / 'checkpoints' / 'last.ckpt'}")
    assert snapshot(run_a) == before
    assert sorted(p.name for p in (run_b / "checkpoints").iterdir()) == ["best-5.ckpt", "last.ckpt"]


def test_overwrite_replaces_the_old_run_only_once_the_new_one_succeeded(tmp_path, fasta):
    run_dir = tmp_path / "run"
    train_in(run_dir, fasta, "trainer.max_steps=3", "trainer.val_check_interval=100")
    before = snapshot(run_dir)
    with pytest.raises(UserError, match="model.heads=3"):  # refused before any work
        train_in(run_dir, fasta, "overwrite=true", "model.heads=3")
    assert snapshot(run_dir) == before
    # refused once training started (learned positions shorter than the crop): the old run comes back
    with pytest.raises(UserError, match="longer than the model's learned positions"):
        train_in(run_dir, fasta, "overwrite=true", "trainer.max_steps=2", "model.position=learned",
                 "model.max_positions=16")
    assert snapshot(run_dir) == before
    train_in(run_dir, fasta, "overwrite=true", "trainer.max_steps=2", "trainer.val_check_interval=100")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best-2.ckpt", "last.ckpt"]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_an_interrupted_overwrite_is_named_not_guessed(tmp_path, fasta):
    aside = tmp_path / "run" / ".replaced"
    aside.mkdir(parents=True)
    (aside / "last.ckpt").write_bytes(b"the old run")
    with pytest.raises(UserError, match=r"\.replaced: holds the checkpoints and config.yaml an interrupted overwrite=true run"):
        train_in(tmp_path / "run", fasta, "overwrite=true")
    assert (aside / "last.ckpt").read_bytes() == b"the old run"


def test_a_models_folder_is_refused_as_a_run_folder(tmp_path, fasta):
    """train refuses an exported model's folder as its run folder (one line, exit 2, the export as it
    was), as export refuses a run folder for its output."""
    from protein_performer.hub.export import export
    from protein_performer.training.task import ProteinLM
    model = export(save_checkpoint(ProteinLM(model=TINY_MODEL), tmp_path / "m.ckpt"), tmp_path / "my_model")
    before = snapshot(tmp_path)
    out = run(*TINY, f"data.path={fasta}", "hydra.run.dir=my_model", cwd=tmp_path)
    assert one_line_exit_2(out) == (f"error: hydra.run.dir={model}: is a model's folder (export or finetune wrote "
                                    f"it), not a training run's; train into a new folder (hydra.run.dir=...)")
    assert snapshot(tmp_path) == before


def test_a_users_folder_keeps_every_file_through_a_failing_and_a_succeeding_run(tmp_path, fasta):
    # a folder holding files named as a run's own: refused before anything is written
    mine = tmp_path / "project"
    before = user_folder(mine)
    out = run(*TINY, "data.path=nope.fasta", "hydra.run.dir=.", cwd=mine)
    line = one_line_exit_2(out)
    assert f"{mine}: already holds .hydra/config.yaml, train.log, config.yaml, not written by a training run" in line
    assert snapshot(mine) == before

    # a folder of other user files (the input among them): a failing run leaves it exactly as it
    # was; a succeeding one adds its own files and changes none of the others
    work = tmp_path / "work"
    work.mkdir()
    (work / "proteins.fasta").write_bytes(fasta.read_bytes())
    (work / "binary.fasta").write_bytes(bytes(range(256)) * 8)
    (work / "notes.txt").write_text("keep me\n")
    torch.save({"w": torch.arange(3)}, work / "x.pt")
    before = snapshot(work)
    out = run(*TINY, "data.path=binary.fasta", "hydra.run.dir=.", cwd=work)
    assert one_line_exit_2(out) == "error: data.path=binary.fasta: is a binary file, not FASTA or UniProt text"
    assert snapshot(work) == before and sorted(os.listdir(work)) == sorted(before)
    out = run(*TINY, "data.path=proteins.fasta", "trainer.max_steps=2", "trainer.val_check_interval=100",
              "hydra.run.dir=.", cwd=work)
    assert out.returncode == 0, out.stderr[-3000:]
    after = snapshot(work)
    assert {k: after[k] for k in before} == before
    assert sorted(set(after) - set(before)) == [".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml",
                                                ".protein-performer.json", "checkpoints/best-2.ckpt",
                                                "checkpoints/last.ckpt", "config.yaml", "train.log"]


# --- one line, exit 2, nothing left -------------------------------------------------------
ERRORS = {
    "key typo": (["trainer.max_step=3"], "error: trainer.max_step=3: no key trainer.max_step in the train config "
                                         "(did you mean trainer.max_steps?) (add a new key with +trainer.max_step=3)"),
    "group option": (["model=nope"], "error: model=nope: no such option; choose one of base, favorpp, linear, "
                                     "performer, performer_relu, transformer"),
    "bad override": (["model.depth=x=2"], "error: model.depth=x=2: not a valid override (mismatched input '=' "
                                          "expecting <EOF>)"),
    "data setting": (["data.max_tokens=0"], "error: data.max_tokens must be positive or null, got 0"),
    "depth 0": (["model.depth=0"], "error: model.depth must be a positive integer, got 0"),
    "run dir below a file": (["hydra.run.dir=notes.txt/run"],
                             "error: hydra.run.dir=notes.txt/run: notes.txt is a file, not a folder"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_every_error_is_one_line_exit_2_and_leaves_nothing(tmp_path, fasta, case):
    args, expected = ERRORS[case]
    (tmp_path / "notes.txt").write_text("x\n")
    out = run(*TINY, f"data.path={fasta}", "hydra.run.dir=runs/r1", *args, cwd=tmp_path)
    assert one_line_exit_2(out) == expected
    assert "Traceback" not in out.stdout and sorted(os.listdir(tmp_path)) == ["notes.txt"]


SETTINGS = {"model.heads=3": "model.dim=16 is not divisible by model.heads=3",
            "model.dim=18": "model.dim / model.heads = 9 is odd; rotary positions",
            "model.dropout=1.5": r"model.dropout must be a number in \[0, 1\), got 1.5",
            "model.attention.nb_features=0": "model.attention.nb_features must be a positive integer, got 0",
            "model.depth=2.5": "model.depth must be a positive integer, got 2.5",
            "optim.lr=0": "optim.lr must be a positive number, got 0",
            "optim.min_lr_ratio=2": r"optim.min_lr_ratio must be in \[0, 1\], got 2"}


@pytest.mark.parametrize("override", SETTINGS)
def test_settings_are_refused_before_any_work(tmp_path, override):
    # data.path does not exist: the settings are checked before the input is opened
    with pytest.raises(UserError, match=f"^{SETTINGS[override]}"):
        train_in(tmp_path / "run", tmp_path / "nope.fasta", override)
    assert not (tmp_path / "run").exists()


# --- kill -9 and rerun --------------------------------------------------------------------
def _kill_when(args, cwd: Path, ready) -> None:
    """Start the command and SIGKILL it as soon as ``ready()`` holds."""
    p = forks().popen(command(*args), cwd=cwd, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.time() + 240
        while not ready() and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert p.poll() is None, "the run ended before the kill point"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


def _state(ckpt: Path) -> tuple[int, dict]:
    c = torch.load(ckpt, weights_only=True)  # a safe load of what the run left
    return c["global_step"], c["state_dict"]


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_a_killed_run_resumes_to_the_uninterrupted_result(tmp_path, fasta):
    # What makes the resumed run equal to the uninterrupted one: data=fasta (prepared shards, whose
    # batch sampler resumes mid-epoch; data=sample's does not), objective=clm and no crop (mlm masks
    # and random crop windows come from the global RNG, which a checkpoint does not hold)
    model = [a for a in TINY if not a.startswith("data.")]
    args = [*model, "objective=clm", "data=fasta", f"data.path={fasta}", f"data.data_dir={tmp_path / 'cache'}",
            "data.max_len=100000", "data.max_tokens=4096", "data.valid_fraction=0.1", "data.test_fraction=0", "data.prepare_workers=0",
            "data.num_workers=0", "data.progress=false", "trainer.max_steps=9", "trainer.val_check_interval=3"]
    clean = tmp_path / "clean"
    assert run(*args, f"hydra.run.dir={clean}", cwd=tmp_path).returncode == 0
    step, weights = _state(clean / "checkpoints" / "last.ckpt")
    assert step == 9

    first = lambda last: last.is_file()  # noqa: E731  the first checkpoint exists
    inode, killed = {}, []
    second = lambda last: last.is_file() and inode.setdefault("i", last.stat().st_ino) != last.stat().st_ino  # noqa
    for point, ready in {"first checkpoint": first, "second checkpoint": second}.items():
        work = tmp_path / point.replace(" ", "_")
        work.mkdir()
        (work / "notes.txt").write_text("keep me\n")
        last = work / "run" / "checkpoints" / "last.ckpt"
        _kill_when([*args, "hydra.run.dir=run"], work, lambda: ready(last))
        killed_at, _ = _state(last)
        assert 0 < killed_at < 9 and killed_at not in killed, point
        killed.append(killed_at)
        out = run(*args, "hydra.run.dir=run", f"ckpt_path={last}", cwd=work)
        assert out.returncode == 0, out.stderr[-3000:]
        step, resumed = _state(last)
        assert step == 9 and resumed.keys() == weights.keys()
        for k in weights:
            assert same(resumed[k], weights[k]), (point, k)
        assert (work / "notes.txt").read_text() == "keep me\n"
        assert sorted(snapshot(work)) == sorted(["notes.txt", *(f"run/{k}" for k in snapshot(clean))]), point

"""The output guard (protein_performer/output_guard.py): every command of the registry
(cli.COMMANDS) is fed its own inputs as outputs, and an output folder of the user's own files;
each refuses in one line with exit 2 (or, where refusing is not right, succeeds), and no input
or foreign file changes. A command added to the registry without its cases here fails.

Also: what the guard refuses by itself (symlinks, hard links, names leaving the output folder,
two outputs at one path), the warning before overwrite=true replaces a file, embed's lock, a
finetune output cut short by a kill, and a failed training run in an old run's folder leaving
that run's .hydra/ as it was."""
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from protein_performer.cli import COMMANDS
from protein_performer.errors import UserError
from protein_performer.files import WrittenFiles
from protein_performer.output_guard import JOURNAL, OutputGuard
from protein_performer.training.task import ProteinLM

from conftest import ROOT, TINY_MODEL, run_command, save_checkpoint
from forkserver import forks

PROTEINS = {"P1": "MKTAYIAKQRQISFVKSHFSRQ", "P2": "MQIFVKTLTGKTITLEVEPSDT", "P3": "MSDNGPQNQRNAPRITFGGPSD",
            "P4": "MKVLAAGIVGLLLAQPALA", "P5": "MSTNPKPQRKTKRNTNRRPQDVKFPGG"}
WT = PROTEINS["P1"]
TRAIN_SMALL = ["model.dim=16", "model.depth=1", "model.heads=2", "model.attention.nb_features=8", "logger=none",
               "trainer.max_steps=1", "data.max_len=32", "data.max_tokens=null", "data.crop_schedule=null",
               "data.batch_size=4", "trainer.enable_progress_bar=false"]  # if a case were not refused: quick


def checksums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


class World:
    """A user's folder: the inputs every command reads, and folders of the user's own files."""

    def __init__(self, root: Path):
        self.root = root
        i = self.inp = root / "in"
        i.mkdir()
        torch.manual_seed(0)
        freqs = [0.0] * 5 + [1 / 25] * 25
        for obj in ("mlm", "clm"):
            save_checkpoint(ProteinLM(model=TINY_MODEL, objective=obj, aa_frequencies=freqs), i / f"{obj}.ckpt")
        self.mlm, self.clm = i / "mlm.ckpt", i / "clm.ckpt"
        from protein_performer.hub.export import export
        self.export = export(self.mlm, i / "export")
        self.fasta = i / "proteins.fasta"
        self.fasta.write_text("".join(f">{k}\n{v}\n" for k, v in PROTEINS.items()))
        rng = np.random.default_rng(0)
        ids = [f"p{k}" for k in range(40)]
        self.h5 = i / "e.h5"
        with h5py.File(self.h5, "w") as f:
            f.create_dataset("ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
            f["mean"] = rng.normal(size=(40, 4)).astype(np.float32)
        self.labels = i / "labels.csv"
        self.labels.write_text("id,label\n" + "".join(f"{r},{k % 2}\n" for k, r in enumerate(ids)))
        self.named_like_metrics = root / "evdata" / "metrics.json"  # proteins in a file named like an output
        self.named_like_metrics.parent.mkdir()
        shutil.copyfile(self.fasta, self.named_like_metrics)
        self.ft_labels = i / "ft.csv"
        seqs = [s[k:] + s[:k] for k in range(4) for s in PROTEINS.values()]  # 20 proteins
        self.ft_labels.write_text("id,sequence,label\n" + "".join(f"f{n},{s},{n % 2}\n" for n, s in enumerate(seqs)))
        self.assay = i / "assay.csv"
        self.assay.write_text("mutant,DMS_score\nM1A,0.1\nK2R,0.5\nT3S,0.2\nA4G,0.9\n")
        self.esm = self._esm(i)
        # a training run's folder (its journal records what it wrote) whose files a new run must not read
        run = self.run = root / "run"
        (run / "checkpoints").mkdir(parents=True)
        shutil.copyfile(self.mlm, run / "checkpoints" / "last.ckpt")
        shutil.copyfile(self.fasta, run / "config.yaml")  # proteins in a file named like the run's config
        WrittenFiles(run / ".protein-performer.json").record(run / "config.yaml", run / "checkpoints" / "last.ckpt")
        # the user's own files, named like the commands' outputs
        f = self.foreign = root / "mine"
        (f / ".hydra").mkdir(parents=True)
        for name in ("notes.txt", "config.yaml", "train.log", ".hydra/config.yaml", "metrics.json", "scored.csv",
                     "probe.json", "samples.fasta", "samples.json", "comparison.md"):
            (f / name).write_text(f"my own {name}\n")
        self.foreign2 = root / "mine2"
        self.foreign2.mkdir()
        (self.foreign2 / "notes.txt").write_text("keep me\n")

    @staticmethod
    def _esm(d: Path) -> Path:
        """A tiny transformers ESM-2 directory (convert-esm's input), or a stand-in file without transformers."""
        try:
            import transformers
        except ImportError:
            (d / "esm.pt").write_bytes(b"no transformers here")
            return d / "esm.pt"
        torch.manual_seed(1)
        cfg = transformers.EsmConfig(vocab_size=33, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, position_embedding_type="rotary", token_dropout=True,
                                     mask_token_id=32, pad_token_id=1, max_position_embeddings=1026)
        transformers.EsmForMaskedLM(cfg).eval().save_pretrained(d / "esm")
        return d / "esm"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(tmp_path_factory.mktemp("world"))


REFUSED, OK = "refused", "ok"

# command -> the cases: (what, overrides, expected: REFUSED with a part of the line | OK with the new files)
TABLE = {
    "train": lambda w: [
        ("run folder is the data", [f"data.path={w.fasta}", f"hydra.run.dir={w.fasta}"], (REFUSED, "is a file")),
        ("run folder of the user's own", [f"data.path={w.fasta}", f"hydra.run.dir={w.foreign}"],
         (REFUSED, "not written by a training run")),
        ("overwrite replaces checkpoints/ holding init_from",
         [f"data.path={w.fasta}", f"hydra.run.dir={w.run}", f"init_from={w.run / 'checkpoints' / 'last.ckpt'}",
          "overwrite=true"], (REFUSED, "holds the input init_from")),
        ("the run's config.yaml is the data", [f"data.path={w.run / 'config.yaml'}", f"hydra.run.dir={w.run}",
                                               f"ckpt_path={w.run / 'checkpoints' / 'last.ckpt'}"],
         (REFUSED, "is the input data.path")),
    ],
    "prepare": lambda w: [
        ("data_dir is the source", ["data=fasta", f"data.path={w.fasta}", f"data.data_dir={w.fasta}"],
         (REFUSED, "is the input data.path")),
        ("data_dir of the user's own", ["data=fasta", f"data.path={w.fasta}", f"data.data_dir={w.foreign2}",
                                        "data.prepare_workers=0", "data.progress=false", "data.valid_fraction=0.4",
                                        "data.test_fraction=0"], (OK, None)),
    ],
    "evaluate": lambda w: [
        ("output_dir is the checkpoint", [f"ckpt={w.mlm}", f"output_dir={w.mlm}"], (REFUSED, "is the input ckpt[0]")),
        ("output_dir inside the exported model", [f"ckpt={w.export}", f"output_dir={w.export / 'ev'}"],
         (REFUSED, "lies inside the input ckpt[0]")),
        ("data.path named like an output", [f"ckpt={w.mlm}", f"data.path={w.named_like_metrics}",
                                            f"output_dir={w.named_like_metrics.parent}"],
         (REFUSED, "is the input data.path")),
        ("names leaving output_dir", [f"ckpt=[{w.mlm},{w.clm}]", "names=[../../escape,b]",
                                      f"output_dir={w.root / 'ev'}"], (REFUSED, "names[0]='../../escape'")),
        ("an existing file of the user's", [f"ckpt={w.mlm}", f"output_dir={w.foreign}"],
         (REFUSED, "metrics.json: exists; pass overwrite=true")),
        ("a folder of the user's own", [f"ckpt={w.mlm}", f"data.path={w.fasta}", f"output_dir={w.foreign2}",
                                        "progress=false", "device=cpu"],
         (OK, {"metrics.json", "metrics.csv", "metrics.png", JOURNAL})),
    ],
    "embed": lambda w: [
        ("output is the input", [f"ckpt={w.mlm}", f"input={w.fasta}", f"output={w.fasta}"], (REFUSED, "is the input input")),
        ("output is the checkpoint", [f"ckpt={w.mlm}", f"input={w.fasta}", f"output={w.mlm}"], (REFUSED, "is the input ckpt")),
        ("output inside the exported model", [f"ckpt={w.export}", f"input={w.fasta}", f"output={w.export / 'e.h5'}"],
         (REFUSED, "lies inside the input ckpt")),
        ("pt_dir is the exported model", [f"ckpt={w.export}", f"input={w.fasta}", f"pt_dir={w.export}"],
         (REFUSED, "is the input ckpt")),
        ("an existing file of the user's", [f"ckpt={w.mlm}", f"input={w.fasta}", f"output={w.foreign / 'notes.txt'}",
                                            "overwrite=true"], (REFUSED, "not an HDF5 file")),
        ("a new file beside the user's", [f"ckpt={w.mlm}", f"input={w.fasta}", f"output={w.foreign2 / 'e.h5'}",
                                          "progress=false"], (OK, {"e.h5"})),  # and no e.h5.lock left behind
    ],
    "probe": lambda w: [
        ("output is the labels", [f"embeddings={w.h5}", f"labels={w.labels}", f"output={w.labels}"],
         (REFUSED, "is the input labels")),
        ("output is the embeddings", [f"embeddings={w.h5}", f"labels={w.labels}", f"output={w.h5}"],
         (REFUSED, "is the input embeddings[0]")),
        ("an existing file of the user's", [f"embeddings={w.h5}", f"labels={w.labels}", f"output={w.foreign / 'probe.json'}"],
         (REFUSED, "probe.json: exists; pass overwrite=true")),
        ("a new file", [f"embeddings={w.h5}", f"labels={w.labels}", f"output={w.foreign2 / 'probe.json'}", "folds=2",
                        "shuffle_control=false", "baseline=false"], (OK, {"probe.json"})),
    ],
    "generate": lambda w: [
        ("output is the checkpoint", [f"ckpt={w.clm}", f"output={w.clm}"], (REFUSED, "is the input ckpt")),
        ("output inside the exported model", [f"ckpt={w.export}", f"output={w.export / 's.fasta'}"],
         (REFUSED, "lies inside the input ckpt")),
        ("an existing file of the user's", [f"ckpt={w.clm}", f"output={w.foreign / 'samples.fasta'}"],
         (REFUSED, "samples.fasta: exists; pass overwrite=true")),
        ("a new file", [f"ckpt={w.clm}", f"output={w.foreign2 / 's.fasta'}", "num_samples=2", "max_length=8",
                        "device=cpu"], (OK, {"s.fasta", "s.json"})),
    ],
    "compare": lambda w: [
        ("doc is the held-out set", [f"heldout.path={w.fasta}", f"doc={w.fasta}", f"output_dir={w.root / 'cmp'}"],
         (REFUSED, "is the input heldout.path")),
        ("output_dir is the held-out set", [f"heldout.path={w.fasta}", f"output_dir={w.fasta}"],
         (REFUSED, "is the input heldout.path")),
        ("an existing report of the user's", [f"heldout.path={w.fasta}", f"output_dir={w.foreign}"],
         (REFUSED, "comparison.md: exists; pass overwrite=true")),
    ],
    "export": lambda w: [
        ("output is the checkpoint", [f"ckpt={w.mlm}", f"output={w.mlm}", "overwrite=true"], (REFUSED, "is the input ckpt")),
        ("output holds the checkpoint", [f"ckpt={w.mlm}", f"output={w.inp}", "overwrite=true"],
         (REFUSED, "holds the input ckpt")),
        ("output inside the exported model", [f"ckpt={w.export}", f"output={w.export / 'again'}"],
         (REFUSED, "lies inside the input ckpt")),
        ("a folder of the user's own", [f"ckpt={w.mlm}", f"output={w.foreign}", "overwrite=true"],
         (REFUSED, "not a directory written by export")),
    ],
    "score": lambda w: [
        ("output is the checkpoint (finding 1)", [f"ckpt={w.mlm}", f"input={w.assay}", f"sequence={WT}",
                                                  f"output={w.mlm}", "overwrite=true"], (REFUSED, "is the input ckpt")),
        ("output inside the exported model", [f"ckpt={w.export}", f"input={w.assay}", f"sequence={WT}",
                                              f"output={w.export / 'model.safetensors'}", "overwrite=true"],
         (REFUSED, "lies inside the input ckpt")),
        ("output is the assay", [f"ckpt={w.mlm}", f"input={w.assay}", f"sequence={WT}", f"output={w.assay}"],
         (REFUSED, "is the input input")),
        ("an existing file of the user's", [f"ckpt={w.mlm}", f"input={w.assay}", f"sequence={WT}",
                                            f"output={w.foreign / 'scored.csv'}"], (REFUSED, "exists; pass overwrite=true")),
        ("a new file", [f"ckpt={w.mlm}", f"input={w.assay}", f"sequence={WT}", f"output={w.foreign2 / 'scored.csv'}",
                        "device=cpu"], (OK, {"scored.csv", "scored.metrics.json"})),
    ],
    "convert-esm": lambda w: [
        ("output is the input", [f"input={w.esm}", f"output={w.esm}", "overwrite=true"], (REFUSED, "is the input input")),
        ("output holds the input", [f"input={w.esm}", f"output={w.inp}", "overwrite=true"], (REFUSED, "holds the input input")),
        *([("a folder of the user's own", [f"input={w.esm}", f"output={w.foreign}", "overwrite=true"],
            (REFUSED, "not a directory written by export"))] if w.esm.is_dir() else []),
    ],
    "finetune": lambda w: [
        ("output_dir is the checkpoint", [f"ckpt={w.mlm}", f"labels={w.ft_labels}", "task=classification",
                                          f"output_dir={w.mlm}"], (REFUSED, "is the input ckpt")),
        ("output_dir holds the labels", [f"ckpt={w.mlm}", f"labels={w.ft_labels}", "task=classification",
                                         f"output_dir={w.inp}"], (REFUSED, "holds the input")),
        ("output_dir inside the exported model", [f"ckpt={w.export}", f"labels={w.ft_labels}", "task=classification",
                                                  f"output_dir={w.export / 'ft'}"], (REFUSED, "lies inside the input ckpt")),
        ("a folder of the user's own", [f"ckpt={w.mlm}", f"labels={w.ft_labels}", "task=classification",
                                        f"output_dir={w.foreign}", "overwrite=true"],
         (REFUSED, "finetune did not write")),
    ],
}


def test_the_table_covers_every_command_of_the_registry():
    """A new command needs its cases here (and so goes through the guard) before the suite passes."""
    assert set(TABLE) == set(COMMANDS)


def invoke(command: str, args: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """The command as ``protein-performer COMMAND ARGS`` runs it, in this process: (exit status, stderr)."""
    if COMMANDS[command].run_folder:  # the run folder is checked (and the guard runs) before Hydra's app
        from protein_performer import cli
        monkeypatch.setattr(sys, "argv", ["protein-performer", command])
        capsys.readouterr()
        try:
            cli.run(command, [*TRAIN_SMALL, *args])
            code = 0
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err
    code, _, err = run_command(command, capsys, *args)
    return code, err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_command_writes_over_an_input_or_a_foreign_file(command, world, capsys, monkeypatch):
    assert command in TABLE, f"{command}: give it cases in TABLE (its inputs as outputs, a folder of foreign files)"
    for what, args, (expected, detail) in TABLE[command](world):
        before = checksums(world.root)
        code, err = invoke(command, args, capsys, monkeypatch)
        after = checksums(world.root)
        lines = err.strip().splitlines()
        if expected == REFUSED:
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (what, code, err[-2000:])
            assert detail in lines[0], (what, lines[0])
            assert after == before, (what, set(after) ^ set(before))
        else:
            assert code == 0, (what, err[-2000:])
            assert {k: after.get(k) for k in before} == before, what  # every file there before: unchanged
            added = {k for k in after if k not in before}
            if detail is not None:
                assert {Path(k).name for k in added} == detail, (what, added)
            for k in added:  # the new files: in the output's folder only
                assert Path(k).is_relative_to(world.foreign2.relative_to(world.root)), k


# --- the guard by itself -------------------------------------------------------------------------
def test_the_guard_follows_symlinks_and_hard_links(tmp_path):
    (tmp_path / "model").mkdir()
    ckpt = tmp_path / "model" / "m.ckpt"
    ckpt.write_bytes(b"weights")
    (tmp_path / "link.csv").symlink_to(ckpt)
    os.link(ckpt, tmp_path / "hard.csv")
    (tmp_path / "dirlink").symlink_to(tmp_path / "model")
    guard = OutputGuard("score", {"ckpt": ckpt, "export": tmp_path / "model"}, overwrite=True)
    for out, why in ((tmp_path / "link.csv", "is the input ckpt"), (tmp_path / "hard.csv", "is the input ckpt"),
                     (tmp_path / "dirlink" / "new.csv", "lies inside"), (tmp_path, "holds the input ckpt")):
        with pytest.raises(UserError, match=why):
            guard.overlap("output", out)
    guard.overlap("output", tmp_path, holds=True)  # a folder written into may hold the inputs
    assert ckpt.read_bytes() == b"weights"


def test_names_stay_inside_the_output_folder_and_outputs_do_not_collide(tmp_path):
    out = tmp_path / "ev"
    out.mkdir()
    (out / "up").symlink_to(tmp_path)
    guard = OutputGuard("evaluate", {})
    for name in ("../../escape", "..", ".", "", "/etc", "a/b", "up"):
        with pytest.raises(UserError, match="output_dir"):
            guard.child(out, name, "names[0]")
    assert guard.child(out, "run-a", "names[0]") == out / "run-a"
    guard.file("output_dir/metrics.json", out / "metrics.json")
    with pytest.raises(UserError, match="is the output output_dir/metrics.json"):
        guard.file("names[1]", out / "metrics.json")
    with pytest.raises(UserError, match="overlaps the output"):
        guard.file("names[0]", out / "metrics.json" / "metrics.json")


def test_overwrite_replaces_a_foreign_file_only_after_a_warning_naming_it(tmp_path, capsys, world):
    notes = tmp_path / "probe.json"
    notes.write_text("my notes\n")
    args = [f"embeddings={world.h5}", f"labels={world.labels}", f"output={notes}", "folds=2",
            "shuffle_control=false", "baseline=false"]
    code, _, err = run_command("probe", capsys, *args)
    assert code == 2 and notes.read_text() == "my notes\n"  # finding 2: no longer replaced without asking
    code, _, err = run_command("probe", capsys, *args, "overwrite=true")
    assert code == 0, err
    assert f"warning: output: overwrite=true replaces {notes}, a file probe did not record writing" in err
    assert json.loads(notes.read_text())["n_train"] == 40
    # a file the command recorded writing in its folder's journal: replaced again without a word
    ev = tmp_path / "ev"
    for _ in range(2):
        code, _, err = run_command("evaluate", capsys, f"ckpt={world.mlm}", f"data.path={world.fasta}",
                                   f"output_dir={ev}", "progress=false", "device=cpu")
        assert code == 0 and "warning" not in err, err


# --- embed's lock --------------------------------------------------------------------------------
def test_embed_removes_the_lock_it_created_and_only_that(world, tmp_path):
    from protein_performer.embed import embed_file
    out = tmp_path / "e.h5"
    embed_file(world.mlm, world.fasta, out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.h5"]  # no e.h5.lock left behind
    lock = tmp_path / "f.h5.lock"
    lock.write_text("")  # a lock file that was there (a killed run's): not this run's to remove
    embed_file(world.mlm, world.fasta, tmp_path / "f.h5", progress=False)
    assert lock.exists()


def test_a_lock_removed_by_its_holder_is_never_held_twice(tmp_path, monkeypatch):
    """Between opening the lock file and locking it, its holder finished and removed it (and
    a third process made a new one): the lock taken is on the file that is there now."""
    import fcntl

    from protein_performer import files
    lock = tmp_path / "o.lock"
    real, calls = fcntl.flock, []

    def flock(fh, op):
        if op & fcntl.LOCK_EX and not calls:
            calls.append(op)
            lock.unlink()  # the holder's removal ...
            lock.write_text("")  # ... and a newcomer's lock file
        return real(fh, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with files.exclusive_lock(lock, remove=True):
        monkeypatch.setattr(fcntl, "flock", real)
        with open(lock) as other, pytest.raises(BlockingIOError):  # the file there now is held
            real(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert lock.exists()  # the newcomer's file: not this run's to remove


# --- finetune's final writes ---------------------------------------------------------------------
def test_finetune_cut_short_in_its_final_writes_is_completed_by_the_rerun(world, tmp_path, capsys, monkeypatch):
    from protein_performer.finetune import outputs as FT  # the module that writes finetune's files
    out = tmp_path / "ft"
    args = [f"ckpt={world.mlm}", f"labels={world.ft_labels}", "task=classification", f"output_dir={out}",
            "trainer.max_steps=1", "valid_fraction=0.2", "test_fraction=0.4"]
    real = FT.write_text

    def killed(path, text):  # the process dies after the weights, before predictions.csv and metrics.json
        raise KeyboardInterrupt

    monkeypatch.setattr(FT, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        run_command("finetune", capsys, *args)
    assert (out / "model.safetensors").is_file() and not (out / "metrics.json").exists()
    monkeypatch.setattr(FT, "write_text", real)
    code, _, err = run_command("finetune", capsys, *args)  # no overwrite=true needed: the output was unfinished
    assert code == 0, err
    assert {"metrics.json", "predictions.csv", "model.safetensors", "finetune.json"} <= {p.name for p in out.iterdir()}
    code, _, err = run_command("finetune", capsys, *args)  # a whole one is another matter
    assert code == 2 and "holds an earlier finetune output; overwrite=true replaces it" in err


# --- a failed training run in an old run's folder ------------------------------------------------
def test_a_failed_overwrite_run_leaves_the_old_runs_hydra_files(world, tmp_path):
    """Finding 7: Hydra wrote .hydra/ of the failed command over the old run's."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    shutil.copyfile(world.mlm, run / "checkpoints" / "last.ckpt")
    written = WrittenFiles(run / ".protein-performer.json")
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run / ".hydra" / name).write_text(f"the old run's {name}\n")
        written.record(run / ".hydra" / name)
    written.record(run / "checkpoints" / "last.ckpt")
    before = checksums(run)
    r = forks().run([sys.executable, str(ROOT / "scripts" / "train.py"), *TRAIN_SMALL, f"hydra.run.dir={run}",
                     "overwrite=true", f"data.path={tmp_path / 'missing.fasta'}"],
                    capture_output=True, text=True, cwd=tmp_path, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "missing.fasta" in lines[0], r.stderr[-3000:]
    after = checksums(run)
    kept = [k for k in before if k != ".protein-performer.json"]  # (the tool's journal of the folder may change)
    assert {k: after.get(k) for k in kept} == {k: before[k] for k in kept}  # the old run's .hydra/ and checkpoint
    assert not (run / ".hydra.pending").exists()


def test_a_run_folder_promotes_hydras_new_files_only_on_success(tmp_path):
    from protein_performer.training.run_folder import PENDING_HYDRA, open_run_folder
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    written = WrittenFiles(run / ".protein-performer.json")
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run / ".hydra" / name).write_text("old\n")
        written.record(run / ".hydra" / name)

    def hydra_writes():
        (run / PENDING_HYDRA).mkdir(exist_ok=True)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            (run / PENDING_HYDRA / name).write_text("new\n")

    folder = open_run_folder(run, "train", None, False)
    assert folder.hydra_dir == PENDING_HYDRA
    with pytest.raises(UserError):
        with folder.running():
            hydra_writes()
            raise UserError("bad data")
    assert (run / ".hydra" / "config.yaml").read_text() == "old\n" and not (run / PENDING_HYDRA).exists()
    folder = open_run_folder(run, "train", None, False)
    with folder.running():
        hydra_writes()
    assert (run / ".hydra" / "config.yaml").read_text() == "new\n" and not (run / PENDING_HYDRA).exists()

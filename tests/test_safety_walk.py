"""A seeded random walk over the commands (issue 44): 50 invocations of the console entry point, in
this process, with bad paths, outputs that are inputs or the user's own files, and out-of-range
keys. After each: exit status 0 or 2 (one ``error:`` line), no traceback, every input and every
file of a folder of the user's own unchanged, and no ``outputs/`` folder (every ``train`` names
its run folder).

``PP_WALK_SEED=n`` walks another path; a failure names the step and its command line."""
import os
import random
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from protein_performer.training.task import ProteinLM

from conftest import TINY_MODEL, save_checkpoint
from inprocess import checksums, run_main
from test_safety_bounds import fair_esm_file

STEPS = 50
SEED = int(os.environ.get("PP_WALK_SEED", "44"))
WT = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"
TRAIN = ["model.dim=16", "model.depth=1", "model.heads=2", "model.attention.nb_features=8", "model.dropout=0.0",
         "data.max_len=48", "data.batch_size=16", "data.max_tokens=null", "data.crop_schedule=null",
         "data.valid_fraction=0.2", "optim.warmup_steps=1", "trainer.enable_progress_bar=false",
         "+trainer.enable_model_summary=false", "logger=none", "trainer.max_steps=2", "trainer.val_check_interval=2"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, small_fasta):
    """inputs/ (checkpoints, an export, proteins, labels, embeddings, an assay, ESM-2 weights, junk),
    mine/ (the user's own files, named like outputs) and work/ (the current folder)."""
    root = tmp_path_factory.mktemp("walk")
    inputs, mine, work = root / "inputs", root / "mine", root / "work"
    for d in (inputs, mine, work):
        d.mkdir()
    torch.manual_seed(0)
    freqs = [0.0] * 5 + [1 / 25] * 25
    for obj in ("mlm", "clm"):
        save_checkpoint(ProteinLM(model=TINY_MODEL, objective=obj, aa_frequencies=freqs), inputs / f"{obj}.ckpt")
    from protein_performer.hub.export import export
    export(inputs / "mlm.ckpt", inputs / "export")
    from protein_performer.formats.fasta import read_fasta
    recs = [(r.id, r.sequence[:50]) for r in read_fasta(small_fasta)][:40]
    (inputs / "proteins.fasta").write_text("".join(f">{i}\n{s}\n" for i, s in recs))
    (inputs / "empty.fasta").write_text("")
    rng = random.Random(0)
    (inputs / "labels.csv").write_text("id,sequence,label\n" + "".join(f"{i},{s},{'ab'[k % 2]}\n"
                                                                        for k, (i, s) in enumerate(recs)))
    (inputs / "values.csv").write_text("id,sequence,label\n" + "".join(f"{i},{s},{rng.random():.3f}\n"
                                                                        for i, s in recs))
    with h5py.File(inputs / "emb.h5", "w") as f:
        f.create_dataset("ids", data=np.array([i for i, _ in recs], dtype=object), dtype=h5py.string_dtype())
        f["mean"] = np.random.default_rng(0).normal(size=(len(recs), 8)).astype(np.float32)
    (inputs / "assay.csv").write_text("mutant,DMS_score\nM1A,0.1\nK2R,0.3\nT3X,0.2\nA4G,0.5\n")
    fair_esm_file(inputs / "esm.pt")
    (inputs / "junk.ckpt").write_bytes(bytes(range(256)) * 4)
    for name, text in (("notes.txt", "notes\n"), ("config.yaml", "mine: true\n"), ("train.log", "my log\n"),
                       ("metrics.json", '{"mine": 1}\n'), ("scored.csv", "a,b\n"), ("out.h5", "not hdf5\n"),
                       ("model.safetensors", "mine\n"), (".hydra/config.yaml", "mine\n"), ("sub/deep.txt", "x\n")):
        (mine / name).parent.mkdir(parents=True, exist_ok=True)
        (mine / name).write_text(text)
    torch.save({"mine": torch.arange(3)}, mine / "mine.pt")
    return inputs, mine, work


class Walk:
    """Draws one command line at a time from the seeded generator."""

    def __init__(self, rng: random.Random, inputs: Path, mine: Path):
        self.rng, self.i, self.m, self.n = rng, inputs, mine, 0

    def pick(self, *options):
        return self.rng.choice(options)

    def good_or(self, good, *bad):
        """``good`` or, a third of the time, one of ``bad``: about a third of the command lines are whole."""
        return self.pick(*bad) if self.rng.random() < 1 / 3 else good

    def maybe(self, *options) -> list[str]:
        """One out-of-range key a third of the time."""
        return [self.pick(*options)] if self.rng.random() < 1 / 3 else []

    def fresh(self, ext: str = "") -> str:
        self.n += 1
        return f"out/{self.n}{ext}"

    def ckpt(self) -> Path:
        i = self.i
        return self.good_or(self.pick(i / "mlm.ckpt", i / "export"), i / "junk.ckpt", i / "nope.ckpt", i,
                            self.m / "notes.txt", self.m / "mine.pt", i / "clm.ckpt")

    def proteins(self) -> Path:
        i = self.i
        return self.good_or(i / "proteins.fasta", i / "empty.fasta", i / "nope.fasta", i / "labels.csv",
                            i / "junk.ckpt", i)

    def out_file(self, ext: str):
        i, m = self.i, self.m
        return self.good_or(self.fresh(ext), i / "labels.csv", i / "mlm.ckpt", i / "assay.csv",
                            i / "export" / "model.safetensors", m / "notes.txt", m / "metrics.json", m / "out.h5",
                            m / "scored.csv", m, ".", f"{m}/sub/../notes.txt")

    def out_dir(self):
        i, m = self.i, self.m
        return self.good_or(self.fresh(), i, i / "export", m, m / ".hydra", m / "sub", ".", "..",
                            i / "mlm.ckpt", m / "notes.txt")

    # --- one generator per command --------------------------------------------------------
    def evaluate(self):
        return ["evaluate", f"ckpt={self.ckpt()}", f"data.path={self.proteins()}", f"output_dir={self.out_dir()}",
                "progress=false", "data.max_records=8",
                *self.maybe("max_tokens=0", "batch_size=-1", "data.max_records=-1", "mask_prob=2", "window=0",
                            "names=[../../escape]", "device=tpu", "data.unknown=?")]

    def embed(self):
        return ["embed", f"ckpt={self.ckpt()}", f"input={self.proteins()}", f"output={self.out_file('.h5')}",
                "progress=false", *self.maybe("max_tokens=0", "layers=[99]", "pooling=[foo]", "precision=8",
                                              "per_residue=true", f"pt_dir={self.out_dir()}")]

    def probe(self):
        i = self.i
        return ["probe", f"embeddings={self.good_or(i / 'emb.h5', i / 'nope.h5', i / 'labels.csv')}",
                f"labels={self.good_or(self.pick(i / 'labels.csv', i / 'values.csv'), i / 'nope.csv', i / 'emb.h5')}",
                f"output={self.out_file('.json')}", "shuffle_control=false", "folds=2",
                *self.maybe("folds=1", "task=foo", "max_train=0", "task=classification", "folds=abc")]

    def generate(self):
        i = self.i
        return ["generate", f"ckpt={self.good_or(i / 'clm.ckpt', i / 'mlm.ckpt', i / 'junk.ckpt')}",
                "num_samples=2", "max_length=12", f"output={self.out_file('.fasta')}",
                *self.maybe("temperature=-1", "top_p=2", "num_samples=0", "top_k=-3", "max_length=0",
                            "prompt=MK1")]

    def export(self):
        return ["export", f"ckpt={self.ckpt()}", f"output={self.out_dir()}",
                *self.maybe(f"metrics={self.i / 'labels.csv'}", f"metrics={self.m / 'metrics.json'}")]

    def score(self):
        i = self.i
        return ["score", f"ckpt={self.ckpt()}", f"input={self.good_or(i / 'assay.csv', i / 'nope.csv', i / 'proteins.fasta')}",
                f"sequence={WT}", f"output={self.out_file('.csv')}", "on_invalid=skip",
                *self.maybe("offset=abc", "offset=0", "max_tokens=0", "strategies=[foo]", "on_invalid=maybe",
                            "sequence=MK1")]

    def finetune(self):
        i = self.i
        return ["finetune", f"ckpt={self.ckpt()}",
                f"labels={self.good_or(i / 'labels.csv', i / 'values.csv', i / 'nope.csv')}",
                f"task={self.good_or('classification', 'regression', 'foo')}",
                f"output_dir={self.out_dir()}", "trainer.max_epochs=1",
                *self.maybe("window=100000", f"test_labels={i / 'labels.csv'}", "valid_fraction=2", "max_tokens=0",
                            "+trainer.max_epoch=1", "trainer.max_epochs=-5", "freeze=abc")]

    def convert_esm(self):
        i = self.i
        return ["convert-esm", f"input={self.good_or(i / 'esm.pt', i / 'mlm.ckpt', i / 'nope.pt', i / 'export')}",
                f"output={self.out_dir()}",
                *self.maybe("model.attention.kernel=foo", "model.attention.local_window=100000",
                            "model.attention.local_heads=1", "+model.attention.nope=1")]

    def train(self):
        i = self.i
        run = self.good_or(self.fresh(), self.m, self.i, ".", self.m / ".hydra")
        return ["train", *TRAIN, f"data.path={self.proteins()}", f"hydra.run.dir={run}",
                *self.maybe("trainer.max_steps=-5", "+trainer.max_step=3", "model.attention.local_window=100000",
                            "model.depth=0", "optim.lr=-1", f"init_from={i / 'mlm.ckpt'}",
                            f"ckpt_path={i / 'mlm.ckpt'}", f"ckpt_path={self.m / 'mine.pt'}", "trainer=gpu")]

    def prepare(self):
        return ["prepare", "data=fasta", f"data.path={self.proteins()}", f"data.data_dir={self.fresh()}",
                "data.progress=false", "data.prepare_workers=0",
                *self.maybe("data.valid_fraction=2", "data.max_len=0", "data.mode=foo", "data.unknown=?")]

    def compare(self):  # settings refused before any model trains (a whole comparison is minutes)
        return ["compare", f"hydra.run.dir={self.fresh()}", "heldout.max_records=5", "train.data.max_records=50",
                *self.pick(["models=[nope]"], ["trainer.max_steps=-5"], ["models=[nope]", "trainer.max_steps=2"])]

    COMMANDS = ("evaluate", "embed", "probe", "generate", "export", "score", "finetune", "convert_esm", "train",
                "prepare", "compare")

    def next(self) -> list[str]:
        return getattr(self, self.pick(*self.COMMANDS))()


@pytest.mark.timeout(300)
def test_random_walk_over_the_commands(world, capsys, monkeypatch):
    inputs, mine, work = world
    monkeypatch.chdir(work)
    monkeypatch.setenv("PROTEIN_PERFORMER_DATA", str(work / "cache"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    theirs = {"inputs": checksums(inputs), "mine": checksums(mine)}
    walk = Walk(random.Random(SEED), inputs, mine)
    seen = {}
    for step in range(STEPS):
        args = walk.next()
        code, out, err = run_main(capsys, *args)
        where = f"step {step} (PP_WALK_SEED={SEED}): protein-performer {' '.join(map(str, args))}"
        assert code in (0, 2), f"{where}\nexit {code}\n{err[-4000:]}"
        assert "Traceback" not in out + err, f"{where}\n{(out + err)[-4000:]}"
        if code == 2:
            errors = [line for line in err.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1, f"{where}\n{err[-3000:]}"
        for name, folder in (("inputs", inputs), ("mine", mine)):
            now = checksums(folder)
            changed = sorted(k for k, v in theirs[name].items() if now.get(k) != v)
            assert not changed, f"{where}\n{name}/: changed or removed {changed}\n{err[-2000:]}"
        assert not (work / "outputs").exists(), where
        seen.setdefault(args[0], set()).add(code)
    assert len(seen) >= 8, seen  # the walk visits most commands, with errors and successes
    assert any(0 in codes for codes in seen.values()) and any(2 in codes for codes in seen.values()), seen

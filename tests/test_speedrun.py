"""The speedrun's levers and records (issue 64): the training-only masking rate, recipes joined with '+',
and the record tables rendered from known rows."""
import json

import numpy as np
import pytest
import torch

from benchmarks.quality import speedrun
from protein_performer.data.datamodule import ProteinDataModule
from protein_performer.objectives import IGNORE

AA = "ACDEFGHIKLMNPQRSTVWY"


@pytest.fixture(scope="module")
def fasta(tmp_path_factory):
    rng = np.random.default_rng(1)
    seqs = ["".join(rng.choice(list(AA), size=int(n))) for n in rng.integers(200, 400, size=120)]
    path = tmp_path_factory.mktemp("fasta") / "proteins.fasta"
    path.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(seqs)))
    return path


def scored_share(batches, tokenizer) -> float:
    """Scored positions / residue positions over batches (<cls>, <eos> and padding are not residues)."""
    special = torch.tensor([tokenizer.pad_id, tokenizer.cls_id, tokenizer.eos_id])
    scored = residues = 0
    for batch in batches:
        scored += int((batch["labels"] != IGNORE).sum())
        residues += int((~torch.isin(batch["inputs"], special)).sum())
    return scored / residues


def test_train_mask_prob_masks_training_batches_only(fasta):
    """objective.train_mask_prob=0.4: training batches score ~40 % of residues, validation keeps 15 %, so
    perplexities stay comparable across recipes (the same validation masks as without the setting)."""
    def dm(**kw):
        d = ProteinDataModule(str(fasta), max_len=512, batch_size=16, valid_fraction=0.2, mask_prob=0.15, seed=0, **kw)
        d.setup()
        return d
    base, high = dm(), dm(train_mask_prob=0.4)
    tok = base.tokenizer
    train_base, train_high = scored_share(base.train_dataloader(), tok), scored_share(high.train_dataloader(), tok)
    assert 0.12 < train_base < 0.18 and 0.36 < train_high < 0.44
    vb, vh = list(base.val_dataloader()), list(high.val_dataloader())
    assert len(vb) == len(vh) and all(
        (a["labels"] == b["labels"]).all() and (a["inputs"] == b["inputs"]).all() for a, b in zip(vb, vh))
    assert 0.12 < scored_share(vb, tok) < 0.18


def test_recipes_are_levers_on_the_old_default_joined_with_plus():
    assert speedrun.overrides_of("dropout0+muon") == ["model.dropout=0", "optim.optimizer=muon"]
    assert speedrun.overrides_of("old-default") == ["model.dropout=0.1", "optim.optimizer=adamw"]
    assert speedrun.overrides_of("lr3e-3+wsd") == ["model.dropout=0.1", "optim.optimizer=adamw", "optim.lr=3e-3",
                                                   "optim.schedule=wsd"]
    assert speedrun.overrides_of("default") == []
    with pytest.raises(SystemExit, match="unknown recipe 'nope'"):
        speedrun.overrides_of("dropout0+nope")


def test_render_tables_from_known_rows(tmp_path):
    """Means, spreads, differences from the default and wall ratios, computed by hand for these rows."""
    rows = [dict(recipe="old-default", overrides=[], seed=s, minutes=3.0, commit="a", perplexity=p, accuracy=0.19,
                 steps=200, wall_s=200.0) for s, p in enumerate([15.0, 14.8, 15.2])]
    rows += [dict(recipe="dropout0", overrides=["model.dropout=0"], seed=s, minutes=3.0, commit="b", perplexity=p,
                  accuracy=0.2, steps=300, wall_s=200.0) for s, p in enumerate([14.5, 14.7, 14.6])]
    rows += [dict(recipe="old-default", overrides=[], seed=0, minutes=None, commit="c", perplexity=14.4, accuracy=0.195,
                  steps=600, max_steps=600, wall_s=600.0),
             dict(recipe="dropout0", overrides=["model.dropout=0"], seed=0, minutes=None, commit="c", perplexity=14.1,
                  accuracy=0.2, steps=700, max_steps=700, wall_s=540.0)]
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = speedrun.render(raw)
    assert "| 3 | old-default | (as configured) | 3 | 15.000 | 0.400 | | 19.00 | 200 | a |" in text
    assert "| 3 | dropout0 | model.dropout=0 | 3 | 14.600 | 0.200 | -0.400 | 20.00 | 300 | b |" in text
    assert "| dropout0 | model.dropout=0 | 700 | 1 | 14.100 | 0.000 | -0.300 | 20.00 | 540 (540-540) | 0.90 | c |" in text


def test_bad_training_mask_rate_is_one_line(fasta):
    from protein_performer.errors import UserError
    for bad in (0, 1.5):
        with pytest.raises(UserError, match=r"^objective.train_mask_prob must be in \(0, 1\] or null, got"):
            ProteinDataModule(str(fasta), train_mask_prob=bad)


def test_keep_refuses_a_run_folder_that_exists(tmp_path, capsys):
    """--keep never merges a run into a folder that is there (a user's files would be overwritten): exit 2
    before any training, the folder untouched."""
    (tmp_path / "dropout0-seed0").mkdir()
    (tmp_path / "dropout0-seed0" / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as e:
        speedrun.main(["run", "--recipe", "dropout0", "--seeds", "0", "--keep", str(tmp_path), "--raw",
                       str(tmp_path / "raw.jsonl")])
    assert e.value.code == 2 and "exists" in capsys.readouterr().err
    assert (tmp_path / "dropout0-seed0" / "mine.txt").read_text() == "keep me" and not (tmp_path / "raw.jsonl").exists()

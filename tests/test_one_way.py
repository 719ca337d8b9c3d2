"""One split, one masking, one scoring: the in-memory data module (data=sample) and prepared
shards (data=fasta) validate the same proteins with the same numbers, whatever the batching,
and those numbers equal a by-hand reference (each protein alone, NLL summed in float64)."""
import gzip
import math
from collections import Counter

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import xxhash
from Bio import SeqIO

from protein_performer.data.datamodule import ProteinDataModule
from protein_performer.data.datasets import CropDataset
from protein_performer.data.shard_datamodule import ShardDataModule
from protein_performer.data.split import split_of
from protein_performer.objectives import IGNORE, scored_example
from protein_performer.training.task import ProteinLM
from protein_performer.tokenizer import Tokenizer

TOK = Tokenizer()
VALID = 0.2
MAX_LEN = 96
TINY = dict(dim=32, depth=1, heads=2, dropout=0.0, attention=dict(kernel="softmax", nb_features=16))


@pytest.fixture(scope="module")
def heldout(root, tmp_path_factory):
    """300 real UniProtKB records with ``sp|ACC|NAME`` / ``tr|ACC|NAME`` headers, and the split
    and amino-acid frequencies worked out by hand (Biopython reads the file)."""
    recs = []
    with gzip.open(root / "data" / "heldout" / "uniprotkb_mix_heldout_2k.fasta.gz", "rt") as f:
        for r, _ in zip(SeqIO.parse(f, "fasta"), range(300)):
            recs.append((r.id, str(r.seq)))
    path = tmp_path_factory.mktemp("oneway") / "mix.fasta.gz"
    with gzip.open(path, "wt") as f:
        for rid, seq in recs:
            f.write(f">{rid} some description\n{seq}\n")
    # the documented split: u = xxh3_64(accession) / 2^64, validation if u < valid_fraction
    in_valid = [xxhash.xxh3_64_intdigest(rid.split("|")[1].encode()) / 2**64 < VALID for rid, _ in recs]
    valid = [s for (_, s), v in zip(recs, in_valid) if v]
    train = [s for (_, s), v in zip(recs, in_valid) if not v]
    counts = Counter("".join(train))
    freqs = torch.zeros(TOK.vocab_size, dtype=torch.float64)
    for aa, c in counts.items():
        freqs[int(TOK.encode(aa, add_cls=False, add_eos=False)[0])] = c / sum(counts.values())
    return path, recs, valid, freqs


def modules(path, tmp, objective):
    common = dict(objective=objective, max_len=MAX_LEN, valid_fraction=VALID, seed=0)
    return {
        "sample, 32 proteins a batch": ProteinDataModule(str(path), batch_size=32, **common),
        "sample, 7 proteins a batch": ProteinDataModule(str(path), batch_size=7, **common),
        "sample, token budget": ProteinDataModule(str(path), max_tokens=500, **common),
        "shards": ShardDataModule(path=str(path), data_dir=str(tmp), test_fraction=0.0, max_tokens=700, dedup=False,
                                  prepare_workers=0, progress=False, num_workers=0, **common),
    }


def test_split_is_by_accession_whatever_the_header():
    for acc in ("P12345", "A0A023GPI8", "Q9XYZ1"):
        assert {split_of(h, 0.3, 0.3) for h in (acc, f"sp|{acc}|X_HUMAN", f"tr|{acc}|Y_MOUSE")} == \
            {split_of(acc, 0.3, 0.3)}


def test_both_data_paths_validate_the_same_proteins_with_train_only_frequencies(heldout, tmp_path):
    path, recs, valid, freqs = heldout
    assert 30 < len(valid) < 100
    expected = sorted(TOK.encode(s)[:MAX_LEN].tobytes() for s in valid)  # first window, <cls> included
    for name, dm in modules(path, tmp_path, "mlm").items():
        dm.setup("fit")
        ds = dm.val_dataloader().dataset
        items = ds.items if hasattr(ds, "items") else ds
        got = sorted(np.asarray(items[i], dtype=np.uint8).tobytes() for i in range(len(items)))
        assert got == expected, name
        torch.testing.assert_close(dm.aa_frequencies, freqs, rtol=0, atol=1e-12, msg=name)


def reference(task, valid, objective, freqs):
    """Each validation protein alone: its first MAX_LEN tokens, its own masks, NLL in float64."""
    nll = base = correct = count = 0.0
    with torch.no_grad():
        for s in valid:
            inputs, labels = scored_example(TOK.encode(s)[:MAX_LEN], objective, TOK, seed=0, mask_prob=0.15)
            logp = torch.log_softmax(task(inputs[None]).double()[0], -1)
            keep = labels != IGNORE
            nll -= logp[keep].gather(-1, labels[keep][:, None]).sum().item()
            base -= freqs[labels[keep]].log().sum().item()
            correct += (logp[keep].argmax(-1) == labels[keep]).sum().item()
            count += int(keep.sum())
    return {"val/perplexity": math.exp(nll / count), "val/baseline_perplexity": math.exp(base / count),
            "val/accuracy": correct / count}


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_validation_numbers_do_not_depend_on_batching_and_match_a_reference(heldout, tmp_path, objective):
    path, recs, valid, freqs = heldout
    torch.manual_seed(0)
    task = ProteinLM(model=TINY, objective=objective, aa_frequencies=freqs.tolist()).eval()
    ref = reference(task, valid, objective, freqs)
    for name, dm in modules(path, tmp_path, objective).items():
        t = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        got = t.validate(task, datamodule=dm, verbose=False)[0]
        for k, v in ref.items():
            assert got[k] == pytest.approx(v, rel=1e-6), (name, k)


def test_random_crop_draws_every_window():
    ds = CropDataset([np.arange(10, dtype=np.uint8)], max_len=4, random_crop=True)
    torch.manual_seed(0)
    starts = Counter(int(ds[0][0]) for _ in range(700))
    assert sorted(starts) == list(range(7))  # the 10 - 4 + 1 windows, the last one included
    assert min(starts.values()) > 60  # about 100 each


class StepCounter(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, i):
        return (self.w ** 2).sum() + 0 * batch["inputs"].float().mean()

    def validation_step(self, batch, i):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_validation_batches_are_not_counted_as_consumed_training_batches(heldout, tmp_path):
    """Resume skips the training batches already consumed: validation in between must not count."""
    path, *_ = heldout
    for name, dm in modules(path, tmp_path, "mlm").items():
        if "token budget" not in name and name != "shards":
            continue  # fixed-size batches restart the epoch on resume
        t = pl.Trainer(max_steps=5, val_check_interval=2, limit_val_batches=3, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")
        t.fit(StepCounter(), datamodule=dm)
        assert dm.state_dict()["consumed"] == 5, name

"""Long crops for the in-memory data module: token-budget training batches and a length
curriculum (``data.max_tokens``, ``data.crop_schedule``), checked against plain references:
the FASTA's own sequences, a step -> crop function written out here, and the fixed-batch
loader as it was before these keys existed."""

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import hydra
from hydra import compose, initialize_config_dir
from torch.utils.data import DataLoader

from protein_performer.data.collate import Collator
from protein_performer.data.datamodule import ProteinDataModule
from protein_performer.data.datasets import CropDataset
from protein_performer.data.sampler import TokenBudgetBatchSampler
from protein_performer.tokenizer import Tokenizer

from conftest import ROOT

AA = "ACDEFGHIKLMNPQRSTVWY"
TK = Tokenizer()
K = 8  # random sequences: every 8-mer names its protein


def ref_crop(schedule, step):
    """The crop in force at ``step``: the last entry whose step is <= step."""
    return [c for s, c in schedule if s <= step][-1]


@pytest.fixture(scope="module")
def fasta(tmp_path_factory):
    rng = np.random.default_rng(0)
    lengths = list(rng.integers(20, 400, size=150)) + [900, 1500, 2500]
    seqs = ["".join(rng.choice(list(AA), size=int(n))) for n in lengths]
    path = tmp_path_factory.mktemp("fasta") / "proteins.fasta"
    path.write_text("".join(f">prot{i}\n{s}\n" for i, s in enumerate(seqs)))
    return path, seqs


def make_dm(path, **kw):
    args = dict(path=str(path), max_len=256, batch_size=8, valid_fraction=0.2, mask_prob=0.0, seed=0)
    args.update(kw)
    dm = ProteinDataModule(**args)
    dm.setup()
    return dm


class Index:
    """Maps a window of tokens back to its training protein (by a k-mer), checking that the
    window is a contiguous piece of that protein's ``<cls> residues <eos>``."""

    def __init__(self, seqs):
        self.seqs = [np.asarray(s, dtype=np.int64) for s in seqs]
        self.kmer = {}
        for p, s in enumerate(self.seqs):
            for a in range(len(s) - K + 1):
                key = s[a:a + K].tobytes()
                assert key not in self.kmer or self.kmer[key][0] == p, "test sequences share a k-mer"
                self.kmer[key] = (p, a)

    def locate(self, window: np.ndarray) -> tuple[int, int]:
        """(protein, start) of a window; asserts the window is that protein's slice."""
        p, a = self.kmer[window[:K].tobytes()]
        s = self.seqs[p]
        assert np.array_equal(s[a:a + len(window)], window), "crop is not a contiguous window"
        return p, a


def rows(batch):
    """The unpadded token rows of a collated batch (mask_prob=0: inputs are the tokens)."""
    assert (batch["labels"] == -100).all()
    return [r[r != TK.pad_id].numpy() for r in batch["inputs"]]


def test_token_budget_batches_cover_the_epoch_within_budget(fasta):
    path, _ = fasta
    dm = make_dm(path, max_len=256, max_tokens=1024)
    idx = Index(dm.train_seqs)
    seen = []
    for batch in dm.train_dataloader():
        assert batch["inputs"].numel() <= 1024  # padded size: batch_len x longest
        for w in rows(batch):
            p, _ = idx.locate(w)
            assert len(w) == min(len(dm.train_seqs[p]), 256)
            seen.append(p)
    assert sorted(seen) == list(range(len(dm.train_seqs)))  # every training protein once
    assert len(dm.train_seqs) > 100 and len(dm.valid_seqs) > 10


def test_crops_follow_the_schedule_across_epochs(fasta):
    path, _ = fasta
    schedule = [[0, 32], [5, 128], [12, 512]]
    dm = make_dm(path, max_len=512, max_tokens=1024, crop_schedule=schedule)
    idx = Index(dm.train_seqs)
    loader = dm.train_dataloader()
    sampler = loader.sampler
    step, sizes = 0, {}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        n = len(loader)  # what Lightning reads before the epoch
        seen, batches = [], 0
        for batch in loader:
            crop = ref_crop(schedule, step)
            assert batch["inputs"].numel() <= 1024
            for w in rows(batch):
                p, _ = idx.locate(w)
                assert len(w) == min(len(dm.train_seqs[p]), crop)  # never longer than the crop in force
                seen.append(p)
            sizes.setdefault(crop, []).append(batch["inputs"].shape[0])
            step += 1
            batches += 1
        assert sorted(seen) == list(range(len(dm.train_seqs)))  # the epoch still covers everything once
        assert n == batches
    assert set(sizes) == {32, 128, 512}
    # the same budget holds fewer proteins per batch once crops grow
    assert np.mean(sizes[32]) > np.mean(sizes[128]) > np.mean(sizes[512])


def test_crop_schedule_is_capped_by_max_len_and_needs_a_budget(fasta):
    path, _ = fasta
    dm = make_dm(path, max_len=64, max_tokens=1024, crop_schedule=[[0, 32], [3, 1024]])
    assert dm.crop_schedule == [(0, 32), (3, 64)]
    with pytest.raises(ValueError, match="max_tokens"):
        ProteinDataModule(path=str(path), crop_schedule=[[0, 32]])
    for bad in ([[5, 32]], [[0, 32], [0, 64]], [[0, 0]], [[0]]):
        with pytest.raises(ValueError, match="crop_schedule"):
            ProteinDataModule(path=str(path), max_tokens=1024, crop_schedule=bad)


def test_random_crop_hits_the_first_and_the_last_window():
    seq = np.concatenate(([TK.cls_id], np.arange(300) % 20 + TK.aa_offset, [TK.eos_id])).astype(np.uint8)
    n, crop = len(seq), 50
    torch.manual_seed(0)
    for ds, item in ((CropDataset([seq], crop, random_crop=True), 0),
                     (CropDataset([seq], 1000, random_crop=True), (0, crop))):  # (index, crop) items
        starts = set()
        for _ in range(4000):  # P(a given window never drawn) = (1 - 1/253)^4000 ~ 1e-7
            w = ds[item].numpy()
            assert len(w) == crop
            a = next(a for a in range(n - crop + 1) if np.array_equal(seq[a:a + crop], w))
            starts.add(a)
        assert 0 in starts and n - crop in starts
        assert starts <= set(range(n - crop + 1))


def test_same_seed_same_batches(fasta):
    path, _ = fasta
    kw = dict(max_len=512, max_tokens=1024, crop_schedule=[[0, 64], [4, 512]])

    def batches(seed):
        dm = make_dm(path, seed=seed, **kw)
        torch.manual_seed(123)  # the crop windows (num_workers=0: the main process's RNG)
        return [b["inputs"] for b in dm.train_dataloader()]

    a, b, c = batches(0), batches(0), batches(1)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(a) != len(c) or any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(a, c))


def test_without_max_tokens_the_fixed_batches_are_unchanged(fasta):
    path, _ = fasta
    dm = make_dm(path, max_len=128, batch_size=8, max_tokens=None, crop_schedule=None)
    # the loader as ProteinDataModule built it before max_tokens existed
    old = DataLoader(CropDataset(dm.train_seqs, 128, random_crop=True), batch_size=8, shuffle=True,
                     collate_fn=Collator(TK, "mlm", 0.0), generator=torch.Generator().manual_seed(0), drop_last=True)
    torch.manual_seed(5)
    new_b = [b["inputs"] for b in dm.train_dataloader()]
    torch.manual_seed(5)
    old_b = [b["inputs"] for b in old]
    assert len(new_b) == len(dm.train_seqs) // 8
    assert all(x.shape[0] == 8 and x.shape[1] <= 128 for x in new_b)
    assert all(torch.equal(x, y) for x, y in zip(new_b, old_b))
    assert dm.state_dict() == {}


def test_validation_uses_the_final_crop_length_in_budget_batches(fasta):
    path, _ = fasta
    dm = make_dm(path, max_len=512, batch_size=4, max_tokens=1024, crop_schedule=[[0, 32], [100, 512]])
    got = [w for b in dm.val_dataloader() for w in [r[r != TK.pad_id].numpy() for r in b["inputs"]]]
    shapes = [tuple(b["inputs"].shape) for b in dm.val_dataloader()]
    assert all(rows * length <= 1024 for rows, length in shapes)  # padded tokens within the budget
    assert any(rows > 1 for rows, _ in shapes)
    assert len(got) == len(dm.valid_seqs)
    for w, s in zip(got, dm.valid_seqs):
        np.testing.assert_array_equal(w, np.asarray(s[:512], dtype=np.int64))  # first max_len tokens, in order


# --- the sampler on its own ------------------------------------------------------------------
LENGTHS = np.random.default_rng(1).integers(10, 3000, size=2000)


def test_one_entry_schedule_is_the_plain_sampler():
    a = TokenBudgetBatchSampler(LENGTHS, 4096, seed=2, pool_size=300, crop_schedule=[[0, 700]])
    b = TokenBudgetBatchSampler(np.minimum(LENGTHS, 700), 4096, seed=2, pool_size=300)
    got = list(a)
    assert [[i for i, _ in x] for x in got] == list(b)
    assert {c for x in got for _, c in x} == {700}


def test_schedule_with_ranks_and_a_given_step():
    schedule = [[0, 128], [10, 512], [25, 2048]]
    ranks = [TokenBudgetBatchSampler(LENGTHS, 8192, seed=0, num_replicas=3, rank=r, crop_schedule=schedule,
                                     step_fn=lambda: 7) for r in range(3)]
    out = [list(s) for s in ranks]
    assert len({len(o) for o in out}) == 1 and len(out[0]) == len(ranks[0])
    seen = [i for o in out for b in o for i, _ in b]
    assert len(seen) == len(set(seen))
    for o in out:
        for j, b in enumerate(o):  # all ranks crop alike at each step; the epoch started at step 7
            assert {c for _, c in b} == {ref_crop(schedule, 7 + j)}
            assert len(b) * max(min(LENGTHS[i], c) for i, c in b) <= 8192
    # resume mid-epoch: the trainer's step has moved on by the consumed batches
    r = TokenBudgetBatchSampler(LENGTHS, 8192, seed=0, num_replicas=3, rank=1, crop_schedule=schedule,
                                step_fn=lambda: 7 + 12)
    r.load_state_dict(ranks[1].state_dict(consumed=12))
    assert list(r) == out[1][12:]


# --- through Lightning: the curriculum follows global_step, and resumes ------------------------
class Recorder(pl.LightningModule):
    def __init__(self, index):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.index, self.seen = index, []

    def training_step(self, batch, i):
        items = sorted((self.index.locate(w)[0], len(w)) for w in rows(batch))
        self.seen.append((self.current_epoch, self.global_step, items))
        return (self.w ** 2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_curriculum_follows_global_step_whole_epochs_and_resumes(fasta, tmp_path, fit_recording):
    path, _ = fasta
    schedule = [[0, 32], [4, 128], [20, 512]]
    kw = dict(max_len=512, max_tokens=512, crop_schedule=schedule)

    def _fit(*args, **kwargs):
        dm = make_dm(path, **kw)
        return fit_recording(Recorder(Index(dm.train_seqs)), dm, *args, **kwargs)

    probe = make_dm(path, **kw)
    n0 = len(probe.train_dataloader())  # short first epoch: small crops, many proteins a batch
    assert 10 < n0 < 30
    total = n0 + 80  # into the third epoch
    full = _fit(total, tmp_path / "a")
    assert [s for _, s, _ in full] == list(range(total))
    lens = {p: len(s) for p, s in enumerate(probe.train_seqs)}
    for _, step, items in full:
        assert all(n == min(lens[p], ref_crop(schedule, step)) for p, n in items)
    # the second epoch (long crops: more batches than the first) is not cut at the first's length
    assert full[-1][0] == 2
    second = sorted(p for e, _, items in full if e == 1 for p, _ in items)
    assert second == list(range(len(lens)))
    # stop in the second epoch, resume: the same batches and crops as the uninterrupted run
    first = _fit(n0 + 4, tmp_path / "b", save_every=n0 + 4)
    ckpt = next((tmp_path / "b").glob("*.ckpt"))
    rest = _fit(total, tmp_path / "c", ckpt=str(ckpt))
    assert first + rest == full


def test_default_config_trains_on_long_crops_with_a_budget_and_a_curriculum(fasta):
    path, _ = fasta
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"data.path={path}"])
    d = cfg.data
    assert d._target_.endswith("ProteinDataModule")
    assert d.max_tokens >= d.max_len and d.batch_size > 0
    schedule = [list(e) for e in d.crop_schedule]
    assert schedule[0][0] == 0 and schedule[-1][1] == d.max_len
    dm = hydra.utils.instantiate(d)  # the yaml's keys are the module's arguments
    assert dm.max_tokens == d.max_tokens and dm.crop_schedule == [tuple(e) for e in schedule]

"""Token-budget batching, shard datasets (crop / concat) and the shard data module,
against plain references: set arithmetic over indices, the tokenizer, uninterrupted runs."""
import gzip

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_dir

from protein_performer.data.sampler import TokenBudgetBatchSampler
from protein_performer.data.shard_datamodule import ShardDataModule
from protein_performer.formats.fasta import read_fasta
from protein_performer.objectives import IGNORE
from protein_performer.tokenizer import Tokenizer

from conftest import ROOT, SAMPLE

LENGTHS = np.array([len(r.sequence) + 2 for _, r in zip(range(3000), read_fasta(SAMPLE))])


def test_each_item_once_per_epoch_within_budget():
    s = TokenBudgetBatchSampler(np.minimum(LENGTHS, 512), 4096, seed=1, drop_last=False)
    batches = list(s)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(len(LENGTHS)))
    lens = np.minimum(LENGTHS, 512)
    for b in batches:
        assert len(b) * lens[b].max() <= 4096
    # bucketing: far less padding than the same batch sizes drawn at random
    pad = sum(len(b) * lens[b].max() for b in batches) / lens.sum()
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(lens))
    cuts = np.cumsum([len(b) for b in batches])[:-1]
    rand = sum(len(b) * lens[b].max() for b in np.split(perm, cuts)) / lens.sum()
    assert pad < 1.1 < rand


def test_reproducible_from_seed_and_epoch():
    a, b = TokenBudgetBatchSampler(LENGTHS, 8192, seed=3), TokenBudgetBatchSampler(LENGTHS, 8192, seed=3)
    assert [x for x in a] == [x for x in b]
    b.set_epoch(1)
    assert [x for x in a] != [x for x in b]
    c = TokenBudgetBatchSampler(LENGTHS, 8192, seed=4)
    assert [x for x in a] != [x for x in c]


def test_ranks_are_disjoint_and_take_equal_steps():
    full = TokenBudgetBatchSampler(LENGTHS, 8192, seed=0).epoch_batches(0)
    ranks = [list(TokenBudgetBatchSampler(LENGTHS, 8192, seed=0, num_replicas=3, rank=r)) for r in range(3)]
    assert len({len(r) for r in ranks}) == 1
    seen = [i for r in ranks for b in r for i in b]
    assert len(seen) == len(set(seen))
    kept = len(ranks[0]) * 3
    assert len(full) - kept < 3
    assert sorted(seen) == sorted(np.concatenate(full[:kept]).tolist())


def test_resume_mid_epoch_neither_repeats_nor_skips():
    s = TokenBudgetBatchSampler(LENGTHS, 8192, seed=0, num_replicas=2, rank=1)
    s.set_epoch(2)
    full = list(s)
    r = TokenBudgetBatchSampler(LENGTHS, 8192, seed=0, num_replicas=2, rank=1)
    r.load_state_dict(s.state_dict(consumed=7))
    assert list(r) == full[7:]
    assert list(r) == full  # the skip applies to the resumed epoch only
    with pytest.raises(ValueError, match="seed 0 and 2 ranks"):
        TokenBudgetBatchSampler(LENGTHS, 8192, seed=0, num_replicas=4).load_state_dict(s.state_dict(3))


def test_evaluation_batches_keep_file_order():
    s = TokenBudgetBatchSampler(LENGTHS, 4096, shuffle=False)
    assert np.concatenate(list(s)).tolist() == list(range(len(LENGTHS)))


# --- datasets over shards ----------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    path = d / "small.fasta.gz"
    recs = [r for _, r in zip(range(600), read_fasta(SAMPLE))]
    with gzip.open(path, "wt") as f:
        for r in recs:
            f.write(f">{r.id}\n{r.sequence}\n")
    return path, d / "cache", recs


def test_crop_mode_items_are_the_tokenized_proteins(small):
    path, cache, recs = small
    dm = ShardDataModule(path=str(path), data_dir=str(cache), max_len=100, valid_fraction=0.2,
                         test_fraction=0.0, prepare_workers=0, progress=False, max_tokens=2000)
    dm.setup()
    tk = Tokenizer()
    by_acc = {r.accession: tk.encode(r.sequence) for r in recs}
    valid, lengths = dm.dataset("valid", train=False)
    expected = [v for v in by_acc.values()]
    got = [valid[i].numpy() for i in range(len(valid))]
    assert len(got) == dm.prepared.manifest["splits"]["valid"]["kept"] > 50
    pool = {tuple(v[:100]) for v in expected}
    assert all(tuple(g) in pool for g in got)  # evaluation: the first 100 tokens
    assert all(int(l) == len(g) for l, g in zip(lengths, got))
    train, _ = dm.dataset("train", train=True)
    long = [i for i in range(len(train)) if len(dm.prepared.split("train")[i]) + 1 > 100][:5]
    torch.manual_seed(0)
    for i in long:  # a random window of the protein
        full = np.concatenate(([tk.cls_id], dm.prepared.split("train")[i]))
        w = train[i].numpy()
        assert len(w) == 100 and any((full[a:a + 100] == w).all() for a in range(len(full) - 99))
    assert abs(dm.aa_frequencies.sum().item() - 1) < 1e-9


def test_concat_mode_windows_cover_the_eos_joined_stream(small):
    path, cache, _ = small
    dm = ShardDataModule(path=str(path), data_dir=str(cache), mode="concat", concat_len=512, valid_fraction=0.2,
                         test_fraction=0.0, prepare_workers=0, progress=False, max_tokens=2048)
    dm.setup()
    ds, lengths = dm.dataset("train", train=True)
    shards = dm.prepared.split("train")
    stream = np.concatenate([shards[i] for i in range(len(shards))])
    windows = [ds[i].numpy() for i in range(len(ds))]
    np.testing.assert_array_equal(np.concatenate(windows), stream)
    assert all(len(w) == 512 for w in windows[:-1]) and 0 < len(windows[-1]) <= 512
    assert (stream == Tokenizer().eos_id).sum() == len(shards)
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape[1] <= 512 and batch["inputs"].numel() <= 2048


class Recorder(pl.LightningModule):
    """Minimal module that records which proteins each training step saw."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, i):
        tokens = torch.where(batch["labels"] != IGNORE, batch["labels"], batch["inputs"])
        self.seen.append(sorted(hash(tuple(t[t != 0].tolist())) for t in tokens))
        return (self.w ** 2).sum() + 0 * tokens.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_resume_mid_epoch_continues_the_same_batches(small, tmp_path, fit_recording):
    path, cache, _ = small
    kw = dict(path=str(path), data_dir=str(cache), max_len=50_000, valid_fraction=0.2, test_fraction=0.0,  # no crops
              prepare_workers=0, progress=False, max_tokens=3000, mask_prob=0.0)
    dm = ShardDataModule(**kw)
    dm.setup()
    n = len(dm.train_dataloader())
    total = n + n // 2  # into the second epoch
    full = fit_recording(Recorder(), ShardDataModule(**kw), total, tmp_path / "a")
    first = fit_recording(Recorder(), ShardDataModule(**kw), n + 3, tmp_path / "b", save_every=n + 3)
    ckpt = next((tmp_path / "b").glob("*.ckpt"))
    rest = fit_recording(Recorder(), ShardDataModule(**kw), total, tmp_path / "c", ckpt=str(ckpt))
    assert len(full) == total
    assert first + rest == full


def test_fasta_config_trains_on_a_local_file(small, tmp_path):
    path, cache, _ = small
    from protein_performer.training.run import train
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[
            "data=fasta", f"data.path={path}", f"data.data_dir={cache}", "data.max_len=128", "data.max_tokens=2048",
            "data.valid_fraction=0.1", "data.num_workers=0", "data.prepare_workers=0", "data.progress=false",
            "model.dim=32", "model.depth=1", "model.heads=2", "model.attention.nb_features=16",
            "trainer.max_steps=4", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
            "trainer.enable_progress_bar=false", "logger=none"])
        metrics, task = train(cfg, tmp_path)
    assert metrics["val/perplexity"] > 1
    assert abs(sum(task.hparams.aa_frequencies) - 1) < 1e-9
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_trembl_configs_point_at_uniprot(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        t = compose("train", overrides=["data=trembl", f"data.data_dir={tmp_path}"])
        c = compose("train", overrides=["data=trembl_concat"])
        p = compose("prepare_data", overrides=["data=uniprot", "data.path=x.dat.gz"])
    assert t.data.url == ("https://ftp.uniprot.org/pub/databases/uniprot/current_release/knowledgebase/"
                          "complete/uniprot_trembl.fasta.gz")
    assert t.data.download is True and t.data.max_len == 1024 and t.data.path is None
    assert c.data.mode == "concat" and c.data.concat_len == 8192 and c.data.url == t.data.url
    assert p.data.format == "uniprot"
    dm = ShardDataModule(url=t.data.url, data_dir=str(tmp_path), download=False)
    with pytest.raises(FileNotFoundError, match="data.download=true"):
        dm.source_file()


def test_concat_window_lengths_by_hand_with_an_empty_shard():
    from types import SimpleNamespace

    from protein_performer.data.concat import ConcatWindows
    streams = [np.arange(10, dtype=np.uint8), np.zeros(0, np.uint8), np.arange(5, dtype=np.uint8)]
    fake = SimpleNamespace(shards=[{"tokens": len(s)} for s in streams], tokens=lambda j: streams[j])
    ds = ConcatWindows(fake, concat_len=4)
    assert ds.lengths.tolist() == [4, 4, 2, 4, 1]  # 10 = 4+4+2, empty shard: none, 5 = 4+1
    assert [len(ds[i]) for i in range(len(ds))] == ds.lengths.tolist()
    from protein_performer.errors import UserError
    with pytest.raises(UserError, match=r"^data\.concat_len must be at least 2 tokens, got 1$"):
        ConcatWindows(fake, concat_len=1)  # the key a user sets, not the argument's name


def test_a_budget_smaller_than_a_protein_is_said_once(caplog, monkeypatch):
    """A protein longer than max_tokens is a batch of its own over the budget: one warning per run
    (process and budget) naming the budget, the count and the longest, none when every protein fits."""
    from protein_performer.data import budget
    monkeypatch.setattr(budget, "_said", set())
    caplog.set_level("WARNING", logger="protein_performer.data.budget")
    assert not budget.warn_over_budget([10, 100, 64], 100) and not budget.warn_over_budget([10], None)
    assert caplog.messages == []
    assert budget.warn_over_budget([10, 300, 101, 50], 100)
    assert budget.warn_over_budget([300], 100)  # the validation split's sampler, a later epoch: said already
    assert budget.warn_over_budget([90], 80, key="max_tokens")
    assert caplog.messages == [
        "data.max_tokens=100 is smaller than 2 proteins (the longest: 300 tokens): each forms a batch of its own "
        "that exceeds the budget (a protein is never split); raise data.max_tokens if memory allows",
        "max_tokens=80 is smaller than 1 protein (the longest: 90 tokens): each forms a batch of its own that "
        "exceeds the budget (a protein is never split); raise max_tokens if memory allows"]


def test_the_samplers_say_a_protein_over_the_budget_once(caplog, monkeypatch):
    """Where batches are cut (training's sampler, inference's batches), the over-budget notice is said,
    once per process and budget, with the key of the command that set it."""
    from protein_performer.data import budget
    from protein_performer.data.sampler import TokenBudgetBatchSampler, token_budget_batches
    monkeypatch.setattr(budget, "_said", set())
    caplog.set_level("WARNING", logger="protein_performer.data.budget")
    TokenBudgetBatchSampler(np.array([50, 200, 60]), 128, shuffle=True)
    TokenBudgetBatchSampler(np.array([50, 200, 60]), 128, shuffle=True)  # the next epoch's loader: said already
    assert token_budget_batches([150, 20], 128) == [[0], [1]]
    TokenBudgetBatchSampler(np.array([50, 60]), 64, shuffle=True, buckets=[80])  # 60 fits, its bucket does not
    assert [m.split(" is smaller")[0] for m in caplog.messages] == ["data.max_tokens=128", "max_tokens=128",
                                                                    "data.max_tokens=64"]

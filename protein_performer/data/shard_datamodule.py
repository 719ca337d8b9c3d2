"""LightningDataModule over prepared shards: TrEMBL (downloaded), or any FASTA / .dat file.

    source file or URL -> (download) -> prepare (cached by content) -> shards
      crop mode:   one protein per item, <cls> residues <eos>, cropped to max_len
                   (random window in training, the first max_len tokens in evaluation)
      concat mode: eos-joined proteins cut into non-overlapping windows of `concat_len` tokens
    -> token-budget batches (TokenBudgetBatchSampler, DDP-aware) -> Collator

Mid-epoch resume: the module counts the training batches the loop has actually started
(``on_before_batch_transfer``, so prefetched batches are not counted) and saves that in
the checkpoint; a resumed run skips exactly those.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from ..objectives import MASK_PROB, train_mask_rate
from ..tokenizer import Tokenizer
from .buckets import check_buckets, log_buckets, log_padding
from .collate import Collator
from .concat import ConcatWindows
from .datasets import CropDataset
from .prepare import check_splits, default_data_dir, prepare, source_file
from .sampler import MAX_TOKENS, TokenBudgetBatchSampler
from .shards import PreparedData, SplitShards
from ..errors import UserError

log = logging.getLogger(__name__)


class WithCls:
    """Shard records (``residues <eos>``) seen as ``<cls> residues <eos>``."""

    def __init__(self, shards: SplitShards, cls_id: int):
        self.shards, self.cls = shards, np.array([cls_id], dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.concatenate((self.cls, self.shards[i]))


class Batches(Dataset):
    """Indexed by a whole batch (a list of indices, as the batch sampler yields)."""

    def __init__(self, items: Dataset):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, indices: list[int]) -> list[torch.Tensor]:
        return [self.items[i] for i in indices]


class CountsTrainingBatches:
    """LightningDataModule mixin: counts the training batches of the current epoch that reached
    the model (``self._progress``), so ``state_dict`` can resume the batch sampler
    (``self._train_sampler``) mid-epoch; and this process's (world size, rank)."""

    def _ranks(self) -> tuple[int, int]:
        t = self.trainer
        return (t.world_size, t.global_rank) if t is not None else (1, 0)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if self.trainer is not None and self.trainer.training and self._train_sampler is not None:
            epoch = self._train_sampler.epoch
            if epoch != self._progress["epoch"]:
                self._progress = {"epoch": epoch, "consumed": 0}
            self._progress["consumed"] += 1
        return batch


class ShardDataModule(CountsTrainingBatches, pl.LightningDataModule):
    def __init__(self, path: str | None = None, url: str | None = None, download: bool = False,
                 metalink: str | None = None, md5: str | None = None, data_dir: str | None = None,
                 format: str | None = None, mode: str = "crop", max_len: int = 1024, concat_len: int = 8192,
                 max_tokens: int = MAX_TOKENS, objective: str = "mlm", mask_prob: float = MASK_PROB,
                 valid_fraction: float = 0.01, test_fraction: float = 0.01, unknown: str = "error",
                 on_invalid: str = "skip", dedup: bool = True, prepare_workers: int | None = None,
                 num_workers: int = 0, seed: int = 0, pool_size: int | None = None, progress: bool = True,
                 download_retries: int = 5, download_backoff: float = 1.0, buckets=None,
                 train_mask_prob: float | None = None):
        super().__init__()
        if mode not in ("crop", "concat"):
            raise UserError(f"data.mode must be 'crop' or 'concat', got {mode!r}")
        if (path is None) == (url is None):
            raise UserError("give exactly one of data.path (a local FASTA/.dat file) and data.url")
        self.path, self.url, self.download, self.metalink, self.md5 = path, url, download, metalink, md5
        self.download_retries, self.download_backoff = download_retries, download_backoff
        self.data_dir = Path(data_dir).expanduser() if data_dir else default_data_dir()
        self.format, self.mode, self.max_len, self.concat_len = format, mode, max_len, concat_len
        self.max_tokens, self.objective, self.mask_prob = max_tokens, objective, mask_prob
        self.train_mask_prob = train_mask_rate(mask_prob, train_mask_prob)  # validation keeps mask_prob
        self.prep_kw = dict(valid_fraction=valid_fraction, test_fraction=test_fraction, unknown=unknown,
                            on_invalid=on_invalid, dedup=dedup, workers=prepare_workers, progress=progress)
        self.num_workers, self.seed, self.pool_size = num_workers, seed, pool_size
        self.tokenizer = Tokenizer(unknown=unknown)
        # static length buckets (buckets.py; auto: up to the longest item): one shape per bucket
        self.buckets = check_buckets(buckets, concat_len if mode == "concat" else max_len)
        log_buckets(self.buckets)
        self.prepared: PreparedData | None = None
        self._train_sampler: TokenBudgetBatchSampler | None = None
        self._progress = {"epoch": 0, "consumed": 0}
        self._resume: dict | None = None

    # --- download + prepare (once; rank 0 via prepare_data, others wait on the lock) ---
    def source_file(self) -> Path:
        return source_file(self.path, self.url, self.data_dir, download=self.download, md5=self.md5,
                           metalink=self.metalink, progress=self.prep_kw["progress"],
                           retries=self.download_retries, backoff=self.download_backoff)

    def prepare_data(self) -> None:
        self._prepared_dir = prepare(self.source_file(), data_dir=self.data_dir, format=self.format,
                                     need=("train", "valid"), **self.prep_kw)

    def setup(self, stage: str | None = None) -> None:
        if self.prepared is not None:
            return
        if getattr(self, "_prepared_dir", None) is None:
            self.prepare_data()
        self.prepared = PreparedData(self._prepared_dir)
        m = self.prepared.manifest
        check_splits(m["source"]["path"], m, ("train", "valid"), self.prep_kw["valid_fraction"])
        self.aa_frequencies = torch.tensor(self.prepared.aa_frequencies(), dtype=torch.float64)
        log.info("prepared data %s: %s", self._prepared_dir,
                 ", ".join(f"{s} {m['splits'][s]['kept']:,}" for s in ("train", "valid", "test")))

    # --- datasets and loaders -----------------------------------------------------------
    def dataset(self, split: str, train: bool) -> tuple[Dataset, np.ndarray]:
        """(items, their token lengths) of a split in the configured mode."""
        shards = self.prepared.split(split)
        if self.mode == "concat":
            ds = ConcatWindows(shards, self.concat_len)
            return ds, ds.lengths
        lengths = np.minimum(shards.lengths + 1, self.max_len)  # + <cls>
        return CropDataset(WithCls(shards, self.tokenizer.cls_id), self.max_len, random_crop=train), lengths

    def _loader(self, split: str, train: bool) -> DataLoader:
        ds, lengths = self.dataset(split, train)
        world, rank = self._ranks()
        sampler = TokenBudgetBatchSampler(lengths, self.max_tokens, shuffle=train, seed=self.seed, num_replicas=world,
                                          rank=rank, pool_size=self.pool_size, buckets=self.buckets)
        collate = Collator(self.tokenizer, self.objective, self.train_mask_prob if train else self.mask_prob,
                           fixed_seed=None if train else self.seed,
                           buckets=self.buckets, max_tokens=self.max_tokens)
        if train and self.buckets:
            log_padding(sampler)
        if train:
            if self._resume is not None:
                sampler.load_state_dict(self._resume)
                self._progress = {"epoch": self._resume["epoch"], "consumed": self._resume["consumed"]}
                self._resume = None
            self._train_sampler = sampler
        return DataLoader(Batches(ds), sampler=sampler, batch_size=None, collate_fn=collate,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)

    # --- mid-epoch resume ---------------------------------------------------------------
    def state_dict(self) -> dict:
        world, _ = self._ranks()
        return {**self._progress, "seed": self.seed, "num_replicas": world}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state)
        if self._train_sampler is not None:  # loader already built: apply now
            self._train_sampler.load_state_dict(self._resume)
            self._progress = {"epoch": state["epoch"], "consumed": state["consumed"]}
            self._resume = None

"""LightningDataModule for a FASTA or UniProt file small enough to tokenize in memory
(the bundled sample, a proteome). TrEMBL-scale data goes through prepared shards."""
from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from ..formats import check_source
from ..objectives import MASK_PROB, train_mask_rate
from ..sequences import read_sequences, skipped_text
from ..tokenizer import Tokenizer
from .buckets import bucketed, check_buckets, log_buckets, log_padding
from .collate import Collator
from .datasets import CropDataset
from .sampler import TokenBudgetBatchSampler, check_crop_schedule
from .shard_datamodule import Batches, CountsTrainingBatches
from .split import split_of
from ..errors import UserError

log = logging.getLogger(__name__)


def amino_acid_frequencies(sequences, tokenizer: Tokenizer) -> torch.Tensor:
    """Frequency of every vocabulary entry among residue tokens (specials get 0)."""
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for s in sequences:
        counts += np.bincount(s, minlength=tokenizer.vocab_size)
    counts[: tokenizer.aa_offset] = 0
    return torch.tensor(counts / max(counts.sum(), 1), dtype=torch.float64)


class ProteinDataModule(CountsTrainingBatches, pl.LightningDataModule):
    """Reads ``path`` once, splits by accession (:mod:`.split`, as prepared shards do), crops to ``max_len``
    (random window in training, first window in validation) and pads per batch.

    Training batches: ``batch_size`` proteins, or with ``max_tokens`` length-bucketed
    batches of at most ``max_tokens`` padded tokens (``TokenBudgetBatchSampler`` over the
    cropped lengths, resumable mid-epoch). ``crop_schedule`` ``[[step, crop_len], ...]``
    (needs ``max_tokens``): from training step ``step`` on, training crops are at most
    ``min(crop_len, max_len)`` tokens, ``<cls>``/``<eos>`` included, under the same token
    budget; steps count training batches (the trainer's ``global_step`` times
    ``accumulate_grad_batches``). Validation always uses the first ``max_len`` tokens
    (the final crop length), in file order, in batches under the token budget (or of
    ``batch_size`` proteins without one), so its numbers stay comparable.  ``buckets`` (a list of
    lengths, auto or null; buckets.py): every batch, training and validation, padded to a bucket's
    length and rows, one shape per bucket (what compiled steps need).
    """

    def __init__(self, path: str, format: str | None = None, objective: str = "mlm", max_len: int = 512,
                 batch_size: int = 16, valid_fraction: float = 0.05, test_fraction: float = 0.0, num_workers: int = 0, seed: int = 0,
                 mask_prob: float = MASK_PROB, unknown: str = "error", on_invalid: str = "error",
                 max_records: int | None = None, max_tokens: int | None = None,
                 crop_schedule: list | None = None, buckets=None,
                 train_mask_prob: float | None = None):
        super().__init__()
        self.path, self.format = Path(path), format
        self.objective, self.max_len, self.batch_size = objective, max_len, batch_size
        self.valid_fraction, self.test_fraction = valid_fraction, test_fraction
        self.num_workers, self.seed = num_workers, seed
        self.mask_prob, self.on_invalid, self.max_records = mask_prob, on_invalid, max_records
        self.train_mask_prob = train_mask_rate(mask_prob, train_mask_prob)  # validation keeps mask_prob
        if max_tokens is not None and max_tokens < 1:
            raise UserError(f"data.max_tokens must be positive or null, got {max_tokens}")
        schedule = check_crop_schedule(crop_schedule)
        if schedule is not None and max_tokens is None:
            raise UserError("data.crop_schedule needs data.max_tokens (a token budget per batch); "
                             "set data.crop_schedule=null for fixed-size batches")
        if schedule is not None and max_len is not None:
            if schedule[-1][1] < max_len:
                log.warning("data.crop_schedule ends at %d tokens, below data.max_len=%d (validation crop)",
                            schedule[-1][1], max_len)
            schedule = [(s, min(c, max_len)) for s, c in schedule]  # max_len caps every crop
        self.max_tokens, self.crop_schedule = max_tokens, schedule
        self.buckets = buckets  # resolved in setup (auto needs the longest crop)
        self.tokenizer = Tokenizer(unknown=unknown)
        self.train_seqs: list[np.ndarray] | None = None
        self.stats: dict = {}
        self._train_sampler: TokenBudgetBatchSampler | None = None
        self._progress = {"epoch": 0, "consumed": 0}
        self._resume: dict | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_seqs is not None:
            return
        check_source(self.path, "data.path")
        train, valid = [], []
        records = read_sequences(self.path, self.format, tokenizer=self.tokenizer, on_invalid=self.on_invalid,
                                 stats=self.stats)
        for rec in itertools.islice(records, self.max_records):
            ids = rec.tokens
            split = split_of(rec.id, self.valid_fraction, self.test_fraction)
            if split != "test":  # held out from training and validation alike
                (valid if split == "valid" else train).append(ids)
        if not train or not valid:
            raise UserError(f"{self.path}: split gave {len(train)} training and {len(valid)} validation records; "
                             f"need both (data.valid_fraction={self.valid_fraction})")
        self.train_seqs, self.valid_seqs = train, valid
        log.info("%s: %d train / %d valid records; skipped: %s", self.path, len(train), len(valid),
                 skipped_text(self.stats))
        self.aa_frequencies = amino_acid_frequencies(train, self.tokenizer)
        longest = max(len(s) for s in itertools.chain(train, valid))
        self.buckets = check_buckets(self.buckets, longest if self.max_len is None else min(self.max_len, longest))
        log_buckets(self.buckets)

    def train_dataloader(self) -> DataLoader:
        ds = CropDataset(self.train_seqs, self.max_len, random_crop=True)
        if self.max_tokens is not None:
            return self._token_budget_loader(ds)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
                          collate_fn=Collator(self.tokenizer, self.objective, self.train_mask_prob, buckets=self.buckets),
                          generator=torch.Generator().manual_seed(self.seed), drop_last=True,
                          persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        ds = CropDataset(self.valid_seqs, self.max_len, random_crop=False)
        if self.max_tokens is not None:  # file order, cut under the token budget: a long protein does not pad 31 others
            lengths = np.array([len(s) for s in self.valid_seqs], dtype=np.int64)
            if self.max_len is not None:
                lengths = np.minimum(lengths, self.max_len)
            world, rank = self._ranks()
            budget = max(self.max_tokens, int(bucketed(self.buckets, lengths).max()))
            sampler = TokenBudgetBatchSampler(lengths, budget, shuffle=False, seed=self.seed, num_replicas=world,
                                              rank=rank, buckets=self.buckets)
            return DataLoader(Batches(ds), sampler=sampler, batch_size=None, num_workers=self.num_workers,
                              collate_fn=Collator(self.tokenizer, self.objective, self.mask_prob, fixed_seed=self.seed,
                                                  buckets=self.buckets, max_tokens=budget))
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=Collator(self.tokenizer, self.objective, self.mask_prob, fixed_seed=self.seed,
                                              buckets=self.buckets))

    # --- token-budget training batches, length curriculum, mid-epoch resume ---------------
    def _batches_trained(self) -> int:
        t = self.trainer
        return t.global_step * t.accumulate_grad_batches

    def _token_budget_loader(self, ds: CropDataset) -> DataLoader:
        lengths = np.array([len(s) for s in self.train_seqs], dtype=np.int64)
        if self.max_len is not None:
            lengths = np.minimum(lengths, self.max_len)
        world, rank = self._ranks()
        sampler = TokenBudgetBatchSampler(lengths, self.max_tokens, shuffle=True, seed=self.seed,
                                          num_replicas=world, rank=rank, crop_schedule=self.crop_schedule,
                                          step_fn=self._batches_trained if self.trainer is not None else None,
                                          buckets=self.buckets)
        t = self.trainer
        if t is not None:
            sampler.set_epoch(t.current_epoch)  # Lightning reads len() before it calls set_epoch
            if not t.reload_dataloaders_every_n_epochs:
                # token-budget epochs differ in length (a curriculum's a lot): Lightning keeps the first
                # epoch's len() as every epoch's length and would cut longer epochs short, so it
                # rebuilds this loader (and so reads its length) at every epoch
                t.reload_dataloaders_every_n_epochs = 1
        if self._resume is not None:
            self._apply_resume(sampler)
        self._train_sampler = sampler
        if self.buckets:
            log_padding(sampler)
        return DataLoader(Batches(ds), sampler=sampler, batch_size=None, num_workers=self.num_workers,
                          collate_fn=Collator(self.tokenizer, self.objective, self.train_mask_prob, buckets=self.buckets,
                                              max_tokens=self.max_tokens),
                          persistent_workers=self.num_workers > 0)

    def _batching(self) -> dict:
        return {"max_tokens": self.max_tokens, "max_len": self.max_len, "buckets": self.buckets,
                "crop_schedule": None if self.crop_schedule is None else [list(e) for e in self.crop_schedule]}

    def _apply_resume(self, sampler: TokenBudgetBatchSampler) -> None:
        state, self._resume = self._resume, None
        if {k: state.get(k) for k in self._batching()} != self._batching():
            log.warning("resuming with other batching (%s, the checkpoint has %s): epoch %d starts over",
                        self._batching(), {k: state.get(k) for k in self._batching()}, state["epoch"])
            state = {**state, "consumed": 0}
        sampler.load_state_dict(state)
        self._progress = {"epoch": state["epoch"], "consumed": state["consumed"]}

    def state_dict(self) -> dict:
        if self.max_tokens is None:  # fixed-size batches: an interrupted epoch starts over
            return {}
        world, _ = self._ranks()
        return {**self._progress, "seed": self.seed, "num_replicas": world, **self._batching()}

    def load_state_dict(self, state: dict) -> None:
        if self.max_tokens is None or "consumed" not in state:
            return
        self._resume = dict(state)
        if self._train_sampler is not None:  # loader already built: apply now
            self._apply_resume(self._train_sampler)

"""LightningDataModule for a FASTA or UniProt file small enough to tokenize in memory
(the bundled sample, a proteome). TrEMBL-scale data goes through prepared shards."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from ..io import read_records
from ..tokenizer import InvalidSequenceError, Tokenizer
from .collate import Collator
from .datasets import CropDataset
from .split import split_of

log = logging.getLogger(__name__)


def amino_acid_frequencies(sequences, tokenizer: Tokenizer) -> torch.Tensor:
    """Frequency of every vocabulary entry among residue tokens (specials get 0)."""
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for s in sequences:
        counts += np.bincount(s, minlength=tokenizer.vocab_size)
    counts[: tokenizer.aa_offset] = 0
    return torch.tensor(counts / max(counts.sum(), 1), dtype=torch.float64)


def tokenize_file(path: str | Path, tokenizer: Tokenizer, fmt: str | None = None, max_records: int | None = None,
                  skip_invalid: bool = False, stats: dict | None = None):
    """Yield (record, uint8 tokens). Invalid records raise (file, record, line) or, with
    ``skip_invalid``, are counted in ``stats['invalid']``."""
    stats = stats if stats is not None else {}
    for n, rec in enumerate(read_records(path, fmt, skip_empty=skip_invalid, stats=stats)):
        if max_records is not None and n >= max_records:
            break
        try:
            yield rec, tokenizer.encode(rec.sequence, source=f"{path}:{rec.line}", record=rec.id)
        except InvalidSequenceError:
            if not skip_invalid:
                raise
            stats["invalid"] = stats.get("invalid", 0) + 1


class ProteinDataModule(pl.LightningDataModule):
    """Reads ``path`` once, splits by a hash of the record id, crops to ``max_len``
    (random window in training, first window in validation) and pads per batch."""

    def __init__(self, path: str, format: str | None = None, objective: str = "mlm", max_len: int = 512,
                 batch_size: int = 16, valid_fraction: float = 0.05, num_workers: int = 0, seed: int = 0,
                 mask_prob: float = 0.15, unknown: str = "error", skip_invalid: bool = False,
                 max_records: int | None = None):
        super().__init__()
        self.path, self.format = Path(path), format
        self.objective, self.max_len, self.batch_size = objective, max_len, batch_size
        self.valid_fraction, self.num_workers, self.seed = valid_fraction, num_workers, seed
        self.mask_prob, self.skip_invalid, self.max_records = mask_prob, skip_invalid, max_records
        self.tokenizer = Tokenizer(unknown=unknown)
        self.train_seqs: list[np.ndarray] | None = None
        self.stats: dict = {}

    def setup(self, stage: str | None = None) -> None:
        if self.train_seqs is not None:
            return
        train, valid = [], []
        for rec, ids in tokenize_file(self.path, self.tokenizer, self.format, self.max_records,
                                      self.skip_invalid, self.stats):
            (valid if split_of(rec.id, self.valid_fraction) == "valid" else train).append(ids)
        if not train or not valid:
            raise ValueError(f"{self.path}: split gave {len(train)} training and {len(valid)} validation records; "
                             f"need both (data.valid_fraction={self.valid_fraction})")
        self.train_seqs, self.valid_seqs = train, valid
        skipped = {k: v for k, v in self.stats.items() if v}
        log.info("%s: %d train / %d valid records%s", self.path, len(train), len(valid),
                 f", skipped {skipped}" if skipped else "")
        self.aa_frequencies = amino_acid_frequencies(train, self.tokenizer)

    def train_dataloader(self) -> DataLoader:
        ds = CropDataset(self.train_seqs, self.max_len, random_crop=True)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
                          collate_fn=Collator(self.tokenizer, self.objective, self.mask_prob),
                          generator=torch.Generator().manual_seed(self.seed), drop_last=True,
                          persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        ds = CropDataset(self.valid_seqs, self.max_len, random_crop=False)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=Collator(self.tokenizer, self.objective, self.mask_prob, fixed_seed=self.seed))

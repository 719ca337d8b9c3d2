"""Map-style datasets over tokenized proteins (each a uint8 array ``<cls> residues <eos>``)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset


class CropDataset(Dataset):
    """One protein per item, cropped to ``max_len`` tokens: a random window in training
    (drawn from torch's RNG, which Lightning seeds per worker), the first ``max_len``
    tokens otherwise (``max_len=None``: the whole protein)."""

    def __init__(self, sequences: Sequence[np.ndarray], max_len: int | None, random_crop: bool):
        self.sequences = sequences
        self.max_len = max_len
        self.random_crop = random_crop

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> torch.Tensor:
        seq = self.sequences[i]
        n = len(seq)
        if self.max_len is None or n <= self.max_len:
            return torch.from_numpy(np.asarray(seq, dtype=np.int64))
        start = 0
        if self.random_crop:
            start = int(torch.randint(0, n - self.max_len + 1, ()))
        return torch.from_numpy(np.asarray(seq[start:start + self.max_len], dtype=np.int64))

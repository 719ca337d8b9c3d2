"""Map-style datasets over tokenized proteins (each a uint8 array ``<cls> residues <eos>``)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset


class CropDataset(Dataset):
    """One protein per item, cropped to ``max_len`` tokens: a random window in training
    (drawn from torch's RNG, which Lightning seeds per worker), the first ``max_len``
    tokens otherwise (``max_len=None``: the whole protein). Lengths count every token,
    ``<cls>`` and ``<eos>`` included. An item may also be asked for as ``(i, crop_len)``
    (a length curriculum's batch sampler does): cropped to ``min(crop_len, max_len)``."""

    def __init__(self, sequences: Sequence[np.ndarray], max_len: int | None, random_crop: bool):
        self.sequences = sequences
        self.max_len = max_len
        self.random_crop = random_crop

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i) -> torch.Tensor:
        max_len = self.max_len
        if isinstance(i, (tuple, list)):
            i, crop = i
            max_len = int(crop) if max_len is None else min(int(crop), max_len)
        seq = self.sequences[i]
        n = len(seq)
        if max_len is None or n <= max_len:
            return torch.from_numpy(np.asarray(seq, dtype=np.int64))
        start = 0
        if self.random_crop:  # uniform over the n - max_len + 1 windows (upper bound exclusive)
            start = int(torch.randint(0, n - max_len + 1, ()))
        return torch.from_numpy(np.asarray(seq[start:start + max_len], dtype=np.int64))

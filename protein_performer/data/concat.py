"""Concatenated mode (the Performer paper's TrEMBL-concat): proteins joined by <eos>
(as the shards store them) and cut into non-overlapping windows of ``concat_len`` tokens
(the ``data.concat_len`` setting).

Windows never cross a shard boundary; a shard's last, shorter window is kept (and
padded in its batch) so no protein is dropped. Items are plain slices of the mapped
token stream, so reading one costs a copy of ``concat_len`` bytes.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .shards import SplitShards
from ..errors import UserError


class ConcatWindows(Dataset):
    def __init__(self, shards: SplitShards, concat_len: int):
        if concat_len < 2:
            raise UserError(f"data.concat_len must be at least 2 tokens, got {concat_len}")
        self.shards, self.concat_len = shards, concat_len
        totals = np.array([s["tokens"] for s in shards.shards], dtype=np.int64)
        counts = -(-totals // concat_len)
        self.starts = np.concatenate(([0], np.cumsum(counts)))
        self.lengths = np.full(int(self.starts[-1]), concat_len, dtype=np.int64)
        tails = totals - (counts - 1) * concat_len
        nonempty = counts > 0  # an empty shard has no window (and must not overwrite its neighbour's tail)
        self.lengths[self.starts[1:][nonempty] - 1] = tails[nonempty]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> torch.Tensor:
        j = int(np.searchsorted(self.starts, i, side="right")) - 1
        a = (i - int(self.starts[j])) * self.concat_len
        return torch.from_numpy(self.shards.tokens(j)[a:a + self.concat_len].astype(np.int64))

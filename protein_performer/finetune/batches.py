"""Batches: the encoded examples of one split, padded into token-budget batches (per-residue targets
aligned with the tokens, :data:`~protein_performer.objectives.IGNORE` at ``<cls>``, ``<eos>`` and padding)."""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ..data.collate import pad_batch
from ..data.sampler import TokenBudgetBatchSampler, token_budget_batches
from ..objectives import IGNORE


class Encoded(torch.utils.data.Dataset):
    def __init__(self, tokens: list[np.ndarray], targets: list):
        self.tokens, self.targets = tokens, targets

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i], self.targets[i]


def collate(items, pad_id: int) -> dict:
    tokens, padding = pad_batch([t for t, _ in items], pad_id)
    targets = [y for _, y in items]
    if isinstance(targets[0], np.ndarray):  # per residue: aligned with the tokens after <cls>
        y = torch.full(tokens.shape, IGNORE, dtype=torch.long)
        for i, t in enumerate(targets):
            y[i, 1:1 + len(t)] = torch.as_tensor(t)
    else:
        y = torch.tensor(targets, dtype=torch.float32 if isinstance(targets[0], float) else torch.long)
    return {"tokens": tokens, "padding_mask": padding, "targets": y}


def batches(data: Encoded, max_tokens: int, pad_id: int):
    """``data`` in token-budget batches, in order, each collated: (the batch's indices into data, the batch)."""
    for batch in token_budget_batches([len(t) for t in data.tokens], max_tokens):
        yield batch, collate([data[i] for i in batch], pad_id)


def _loader(data: Encoded, pad_id: int, max_tokens: int, train: bool = False, seed: int = 0):
    lengths = [len(t) for t in data.tokens]
    sampler = (TokenBudgetBatchSampler(np.array(lengths), max_tokens, shuffle=True, seed=seed,
                                       budget_key="max_tokens") if train
               else token_budget_batches(lengths, max_tokens))
    return torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=partial(collate, pad_id=pad_id))

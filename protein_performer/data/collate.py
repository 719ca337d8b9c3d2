"""Batch assembly: dynamic padding, then the objective's inputs and labels."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from ..objectives import IGNORE, MASK_PROB, check_objective, clm_labels, mask_tokens, scored_example
from ..tokenizer import Tokenizer
from .buckets import bucket_of, bucket_shape


class Collator:
    """Pads a list of token tensors to the longest and builds ``inputs``/``labels``.

    Training (``fixed_seed=None``): mlm 80/10/10 corruption from the global RNG; clm
    next-token labels (``<eos>`` included). Padding is never scored.
    Validation (``fixed_seed`` set): each protein is scored as ``evaluate`` scores it
    (:func:`protein_performer.objectives.scored_example`): masks seeded from (seed, the
    protein's tokens), residue targets only, so the numbers do not depend on the batch.
    With ``buckets`` (buckets.py) the batch is then padded to its bucket's length and to
    ``max_tokens // bucket`` rows: one shape per bucket, the same masks and labels as without.
    """

    def __init__(self, tokenizer: Tokenizer, objective: str = "mlm", mask_prob: float = MASK_PROB,
                 fixed_seed: int | None = None, buckets=None, max_tokens: int | None = None):
        self.tokenizer, self.objective = tokenizer, check_objective(objective)
        self.mask_prob, self.fixed_seed = mask_prob, fixed_seed
        self.buckets, self.max_tokens = buckets, max_tokens

    def __call__(self, batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        pad = self.tokenizer.pad_id
        if self.fixed_seed is not None:
            pairs = [scored_example(t.numpy(), self.objective, self.tokenizer, self.fixed_seed, self.mask_prob)
                     for t in batch]
            inputs = pad_sequence([i for i, _ in pairs], batch_first=True, padding_value=pad)
            labels = pad_sequence([lab for _, lab in pairs], batch_first=True, padding_value=IGNORE)
        else:
            tokens = pad_sequence(batch, batch_first=True, padding_value=pad)
            if self.objective == "clm":
                inputs, labels = clm_labels(tokens, pad)
            else:
                inputs, labels = mask_tokens(tokens, self.tokenizer, None, self.mask_prob)
        if self.buckets:
            rows, length = bucket_shape(self.buckets, inputs.shape[1], inputs.shape[0], self.max_tokens)
            grow = lambda x, v: F.pad(x, (0, length - x.shape[1], 0, rows - x.shape[0]), value=v)  # noqa: E731
            inputs, labels = grow(inputs, pad), grow(labels, IGNORE)
        return {"inputs": inputs, "labels": labels, "padding_mask": inputs == pad}


def pad_batch(tokens: Iterable[np.ndarray], pad_id: int, buckets=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token arrays -> (B, L) LongTensor padded with ``pad_id`` on the right (to the longest's bucket
    with ``buckets``), and the padding mask (True at padding), or None when no row is padded: exact
    attention then needs no L x L mask and SDPA can use its flash kernel."""
    rows = [torch.as_tensor(np.asarray(t, dtype=np.int64)) for t in tokens]
    lengths = torch.tensor([len(r) for r in rows])
    out = torch.full((len(rows), bucket_of(buckets, int(lengths.max()))), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    if bool((lengths == out.shape[1]).all()):
        return out, None
    return out, torch.arange(out.shape[1])[None, :] >= lengths[:, None]

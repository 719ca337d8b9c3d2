"""Batch assembly: dynamic padding, then the objective's inputs and labels."""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from ..objectives import clm_labels, mask_tokens
from ..tokenizer import Tokenizer
from ..errors import UserError


class Collator:
    """Pads a list of token tensors to the longest and builds ``inputs``/``labels``.

    mlm: 80/10/10 corruption. With ``fixed_seed`` (validation, evaluation) the masks of a
    batch depend only on the seed and the batch's contents, so scores are reproducible.
    clm: next-token labels. Padding is never scored.
    """

    def __init__(self, tokenizer: Tokenizer, objective: str = "mlm", mask_prob: float = 0.15,
                 fixed_seed: int | None = None):
        if objective not in ("mlm", "clm"):
            raise UserError(f"objective must be 'mlm' or 'clm', got {objective!r}")
        self.tokenizer, self.objective, self.mask_prob, self.fixed_seed = tokenizer, objective, mask_prob, fixed_seed

    def __call__(self, batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        tokens = pad_sequence(batch, batch_first=True, padding_value=self.tokenizer.pad_id)
        if self.objective == "clm":
            inputs, labels = clm_labels(tokens, self.tokenizer.pad_id)
        else:
            gen = None
            if self.fixed_seed is not None:
                content = int(tokens.sum()) * 1_000_003 + tokens.numel()
                gen = torch.Generator().manual_seed((self.fixed_seed * 7919 + content) % 2**63)
            inputs, labels = mask_tokens(tokens, self.tokenizer, gen, self.mask_prob)
        return {"inputs": inputs, "labels": labels, "padding_mask": inputs == self.tokenizer.pad_id}

"""Which positions of a batch are residues, and the mean over them: the one rule for every
pooled vector (``embed``'s mean, the fine-tuned heads, a probe's features).

A protein is ``<cls> residues <eos>`` (:meth:`~protein_performer.tokenizer.Tokenizer.encode`),
padded with ``<pad>``; <mask> and <unk> stand for residues. The transformers code an export
ships (``hub/hf_code/modeling_protein_performer.py``: ``_residues``, ``PoolingHead``) keeps a
standalone copy of the same two rules, since it runs without this package."""
from __future__ import annotations

import torch

from ..tokenizer import Tokenizer


def residue_mask(tokens: torch.Tensor, tokenizer: Tokenizer = Tokenizer()) -> torch.Tensor:
    """(B, L) True at residues: every token but padding, <cls> and <eos> (<mask> and <unk>
    stand for residues), the positions mean pooling averages."""
    return (tokens != tokenizer.pad_id) & (tokens != tokenizer.cls_id) & (tokens != tokenizer.eos_id)


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of hidden (B, L, D) over the positions where mask (B, L) is True -> (B, D); a row
    without any such position gives zeros."""
    if mask is None:
        return hidden.mean(1)
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1)


def end_masks(mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) residue mask -> the masks of each protein's first ``k`` and last ``k`` residues (a protein
    of ``k`` residues or fewer: all of them, in both), wherever its padding lies."""
    seen = mask.long().cumsum(-1)                      # residues up to and including each position
    total = seen[..., -1:]
    return mask & (seen <= k), mask & (seen > total - k)

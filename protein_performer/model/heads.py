"""Heads over :class:`~protein_performer.model.PerformerEncoder`'s hidden states (B, L, dim).

The language model's head is tied to the token embedding; the task heads (a value per
protein, a label per residue) are what fine-tuning adds on top of a pretrained encoder.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..tokenizer import Tokenizer


class LMHead(nn.Module):
    """Logits ``hidden @ E^T + bias``: E is the token embedding, passed in at the call rather
    than held, so that the matrix exists (and is stored) once."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, embedding_weight, self.bias)


class EsmLMHead(LMHead):
    """ESM's LM head (fair-esm's RobertaLMHead, transformers' EsmLMHead): dense -> GELU (erf) ->
    LayerNorm, then the tied projection ``@ E^T + bias``: what a model converted from ESM-2 needs."""

    def __init__(self, dim: int, vocab_size: int, eps: float = 1e-5):
        super().__init__(vocab_size)  # bias first: still the model's first parameter
        self.dense, self.norm = nn.Linear(dim, dim), nn.LayerNorm(dim, eps=eps)

    def forward(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(F.gelu(self.dense(hidden))), embedding_weight)


def residue_mask(tokens: torch.Tensor, tokenizer: Tokenizer = Tokenizer()) -> torch.Tensor:
    """(B, L) True at residues: every token but padding, <cls> and <eos> (<mask> and <unk>
    stand for residues), the positions ``embed``'s mean pooling averages."""
    return (tokens != tokenizer.pad_id) & (tokens != tokenizer.cls_id) & (tokens != tokenizer.eos_id)


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of hidden (B, L, D) over the positions where mask (B, L) is True -> (B, D)."""
    if mask is None:
        return hidden.mean(1)
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1)


class SequenceClassificationHead(nn.Module):
    """One output vector per protein: the mean of the hidden states over its residues, then
    dropout and a linear layer. ``num_outputs`` classes (logits), or 1 for a regression."""

    def __init__(self, dim: int, num_outputs: int, dropout: float = 0.0):
        super().__init__()
        self.drop, self.out = nn.Dropout(dropout), nn.Linear(dim, num_outputs)

    def forward(self, hidden: torch.Tensor, residues: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, L, dim), residues (B, L) True where to pool (:func:`residue_mask`; None:
        every position) -> (B, num_outputs)."""
        return self.out(self.drop(masked_mean(hidden, residues)))


class TokenClassificationHead(nn.Module):
    """One output vector per position (e.g. secondary structure per residue): dropout and a
    linear layer. Padding, <cls> and <eos> get outputs too; the loss leaves them out."""

    def __init__(self, dim: int, num_outputs: int, dropout: float = 0.0):
        super().__init__()
        self.drop, self.out = nn.Dropout(dropout), nn.Linear(dim, num_outputs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, L, dim) -> (B, L, num_outputs)."""
        return self.out(self.drop(hidden))


class AttentionPoolingHead(nn.Module):
    """One output vector per protein, pooled by learned weights instead of a plain mean: a
    linear score per residue, softmax over the protein's residues, the weighted sum of the
    hidden states, then dropout and a linear layer (a motif can outweigh the composition)."""

    def __init__(self, dim: int, num_outputs: int, dropout: float = 0.0):
        super().__init__()
        self.score = nn.Linear(dim, 1)
        self.drop, self.out = nn.Dropout(dropout), nn.Linear(dim, num_outputs)

    def forward(self, hidden: torch.Tensor, residues: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, L, dim), residues (B, L) True where to pool (None: every position) ->
        (B, num_outputs)."""
        s = self.score(hidden).squeeze(-1).float()
        if residues is not None:
            s = s.masked_fill(~residues, float("-inf"))
        w = torch.softmax(s, -1).nan_to_num(0.0).to(hidden.dtype)  # a row without residues pools to 0
        return self.out(self.drop(torch.einsum("bl,bld->bd", w, hidden)))

"""The pieces of a block: pre-norm attention and feed-forward with residuals, and ESM-2's token dropout."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import Attention
from .config import ModelConfig


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ff(norm(x))."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        super().__init__()
        c = config
        self.norm1 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.attn = Attention(c.dim, c.heads, causal=c.causal, dropout=c.dropout, seed=seed,
                              rotary=c.position == "rotary", rotary_base=float(c.rotary_base), bias=c.qkv_bias,
                              **asdict(c.attention))
        if c.rotary_inv_freq == "float32" and self.attn.rotary is not None:
            # ESM's frequencies differ from the float64 ones by an ulp: 1e-4 rad at position 2,000
            r = self.attn.rotary
            r.inv_freq = 1.0 / (float(c.rotary_base) ** (torch.arange(0, r.dim, 2, dtype=torch.float32) / r.dim))
        self.norm2 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.ff = FeedForward(c.dim, c.ff_mult * c.dim, c.dropout)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), padding_mask))
        return x + self.drop(self.ff(self.norm2(x)))

    def step(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        a, state = self.attn.step(self.norm1(x), state)
        x = x + a
        return x + self.ff(self.norm2(x)), state


def token_dropout(x: torch.Tensor, tokens: torch.Tensor, padding_mask: torch.Tensor | None,
                  mask_id: int) -> torch.Tensor:
    """ESM-2's token dropout, as fair-esm and transformers compute it: ESM-2 was trained with the
    embeddings of <mask> (12 % of the tokens, 15 % x 80 %) zeroed, so <mask> embeddings are zeroed
    and all are scaled by (1 - 0.12) / (1 - the fraction of <mask> among the protein's tokens)."""
    masked = tokens == mask_id
    lengths = tokens.shape[1] if padding_mask is None else (~padding_mask.bool()).sum(-1)
    observed = masked.sum(-1).float() / lengths
    x = x.masked_fill(masked.unsqueeze(-1), 0.0)
    return (x * (1 - 0.15 * 0.8) / (1 - observed)[:, None, None]).to(x.dtype)

"""Rotary position embedding (RoFormer, Su et al. 2021), "rotate half" layout.

Applied to queries and keys *before* the feature map, so the kernel sees rotated vectors
and q.k depends on positions only through their difference. Positions start at
``offset`` so the recurrent ``step`` can rotate one token at position t.
"""
from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary embedding needs an even head dimension, got {dim}")
        self.dim = dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, length: int, offset: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(offset, offset + length, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x: (..., L, dim) -> rotated x, position of row i is offset + i."""
        cos, sin = self.cos_sin(x.shape[-2], offset, x.device, x.dtype)
        return x * cos + rotate_half(x) * sin

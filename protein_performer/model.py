"""The Performer protein language model, top to bottom.

tokens -> embedding (+ learned positions, or rotary inside attention)
       -> depth x [pre-norm attention, pre-norm feed-forward], residual
       -> final norm -> output head tied to the embedding -> logits

Which attention (FAVOR+ softmax, FAVOR++, ReLU, trig, elu+1 or exact softmax) is a
config choice passed straight to :class:`protein_performer.attention.Attention`; the
model does not know or care. A causal model can also run as an RNN: ``init_state`` and
``step`` decode one token at a time with a constant-size state per layer.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Attention
from .errors import UserError


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ff(norm(x))."""

    def __init__(self, dim: int, heads: int, ff_mult: int, dropout: float, causal: bool, attention: dict,
                 seed: int = 0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal=causal, dropout=dropout, seed=seed, **attention)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, ff_mult * dim, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), padding_mask))
        return x + self.drop(self.ff(self.norm2(x)))

    def step(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        a, state = self.attn.step(self.norm1(x), state)
        x = x + a
        return x + self.ff(self.norm2(x)), state


class PerformerLM(nn.Module):
    """Encoder over amino-acid tokens with a tied language-model head.

    ``attention`` holds the keyword arguments of :class:`Attention` (kernel, nb_features,
    chunk_size, redraw_interval, ...). ``position`` is "rotary" (default; any length) or
    "learned" (up to ``max_len`` positions).
    """

    def __init__(self, vocab_size: int, dim: int = 256, depth: int = 4, heads: int = 8, ff_mult: int = 4,
                 dropout: float = 0.1, causal: bool = False, position: str = "rotary", max_len: int = 1024,
                 attention: dict | None = None):
        super().__init__()
        if position not in ("rotary", "learned"):
            raise UserError(f"model.position must be 'rotary' or 'learned', got {position!r}")
        attention = dict(attention or {})
        attention["rotary"] = position == "rotary"
        self.causal, self.position, self.max_len = causal, position, max_len
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(max_len, dim) if position == "learned" else None
        self.drop = nn.Dropout(dropout)
        # each layer draws its own random-feature projections (seed = layer index)
        self.blocks = nn.ModuleList(Block(dim, heads, ff_mult, dropout, causal, attention, seed=i)
                                    for i in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head_bias = nn.Parameter(torch.zeros(vocab_size))
        nn.init.normal_(self.embed.weight, std=0.02)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed.weight, std=0.02)

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def _positions(self, x: torch.Tensor, start: int, length: int) -> torch.Tensor:
        if self.pos_embed is None:
            return x
        if start + length > self.max_len:
            raise UserError(f"sequence of {start + length} tokens exceeds the learned positions "
                             f"(model.max_len={self.max_len}); use model.position=rotary for longer proteins")
        return x + self.pos_embed(torch.arange(start, start + length, device=x.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed.weight, self.head_bias)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None,
                return_layers: bool = False):
        """tokens (B, L) -> logits (B, L, V). ``padding_mask`` is True at padding.
        With ``return_layers``, also the hidden states: [embedding, block 1, ..., final norm]."""
        x = self.drop(self._positions(self.embed(tokens), 0, tokens.size(1)))
        layers = [x]
        for block in self.blocks:
            x = block(x, padding_mask)
            layers.append(x)
        h = self.norm(x)
        if return_layers:
            layers[-1] = h
            return self.logits(h), layers
        return self.logits(h)

    # --- RNN-mode decoding (causal models) -------------------------------------------
    def init_state(self, batch_size: int, device=None) -> dict:
        if not self.causal:
            raise UserError("RNN-mode decoding needs a causal model (objective=clm)")
        return {"pos": 0, "layers": [b.attn.init_state(batch_size, device) for b in self.blocks]}

    @torch.no_grad()
    def step(self, token: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """One token per sequence (B,) -> next-token logits (B, V) and the new state; cost
        and memory do not grow with position for linear kernels."""
        x = self._positions(self.embed(token), state["pos"], 1) if self.pos_embed is not None else self.embed(token)
        new_layers = []
        for block, s in zip(self.blocks, state["layers"]):
            x, s = block.step(x, s)
            new_layers.append(s)
        return self.logits(self.norm(x)), {"pos": state["pos"] + 1, "layers": new_layers}

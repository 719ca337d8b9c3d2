"""Quadratic reference implementations, used only by tests and the benchmark's accuracy study.

Everything here materializes the full L x L matrix on purpose: these functions are written
to be obviously correct, not fast, and share no code with the fast paths in ``linear.py``.
"""
from __future__ import annotations

import torch


def _allowed(L_q: int, L_k: int, causal: bool, key_padding_mask: torch.Tensor | None, device) -> torch.Tensor:
    """Boolean (B or 1, 1, L_q, L_k) matrix: True where query i may see key j."""
    allowed = torch.ones(L_q, L_k, dtype=torch.bool, device=device)
    if causal:
        allowed = torch.tril(allowed)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :].bool()
    return allowed


def naive_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                           key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """D^-1 (A V) with the kernel matrix A = Q' K'^T materialized and masked.

    q, k: feature-mapped (B, H, L, r); v: (B, H, L, d); key_padding_mask (B, L), True = padding.
    """
    A = q @ k.transpose(-1, -2)
    A = A.masked_fill(~_allowed(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device), 0.0)
    return (A @ v) / A.sum(-1, keepdim=True)


def naive_recurrent_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal linear attention as an RNN: S_i = S_{i-1} + k'_i v_i^T, Z_i = Z_{i-1} + k'_i,
    out_i = q'_i S_i / q'_i Z_i, one position at a time (a second, loop-based reference)."""
    B, H, L, r = q.shape
    S = q.new_zeros(B, H, r, v.shape[-1])
    Z = q.new_zeros(B, H, r)
    outs = []
    for i in range(L):
        S = S + k[:, :, i, :, None] * v[:, :, i, None, :]
        Z = Z + k[:, :, i]
        num = torch.einsum("bhr,bhrd->bhd", q[:, :, i], S)
        den = torch.einsum("bhr,bhr->bh", q[:, :, i], Z)
        outs.append(num / den[..., None])
    return torch.stack(outs, dim=2)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      key_padding_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Exact softmax attention softmax(Q K^T * scale) V, written out by hand (no SDPA)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~_allowed(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device),
                                float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def softmax_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The kernel FAVOR+ estimates on data-scaled inputs: exp(x . y), all pairs."""
    return torch.exp(x @ y.transpose(-1, -2))

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


def local_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, causal: bool = False,
                            key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax attention restricted to the band |i - j| < window (causal: 0 <= i - j < window),
    the full L x L matrix masked; a query always sees itself."""
    L = q.shape[-2]
    i = torch.arange(L, device=q.device)
    diff = i[:, None] - i[None, :]
    band = ((diff >= 0) & (diff < window)) if causal else (diff.abs() < window)
    allowed = band[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :].bool()
    allowed = allowed | torch.eye(L, dtype=torch.bool, device=q.device)
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _visible(rows: torch.Tensor, L: int, causal: bool) -> torch.Tensor:
    """(n, L) bool: key j visible to query position rows[i]."""
    j = torch.arange(L, device=rows.device)
    return j[None, :] <= rows[:, None] if causal else torch.ones(len(rows), L, dtype=torch.bool, device=rows.device)


def softmax_rows(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, causal: bool = False,
                 logits: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax attention weights (B, H, n, L) of the query positions ``rows`` only (memory n x L,
    so a reference at L = 16,384 stays linear in L); q, k raw (B, H, L, d), scale d^-1/2 (``logits``:
    those rows' q k^T / sqrt(d), when already computed)."""
    if logits is None:
        logits = (q[:, :, rows] @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(logits.masked_fill(~_visible(rows, k.shape[-2], causal), float("-inf")), -1)


def kernel_scores(qf: torch.Tensor, kf: torch.Tensor, k_log_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalized kernel values q'_i . k'_j exp(s_j - max s) (B, H, n, L) of query features qf
    (B, H, n, r) against all key features kf (B, H, L, r) (k_log_scale (B, H, L, 1) or None); the
    common factor exp(-max s) cancels in every row."""
    a = qf @ kf.transpose(-1, -2)
    if k_log_scale is not None:
        s = k_log_scale[..., 0]
        a = a * torch.exp(s - s.amax(-1, keepdim=True))[:, :, None, :]
    return a


def kernel_rows(scores: torch.Tensor, rows: torch.Tensor, causal: bool = False,
                floor: torch.Tensor | float | None = None):
    """A feature map's attention weights of the query positions ``rows``, from the formula
    a_ij = s_ij / max(sum_{visible j} s_ij, floor_i) with s = :func:`kernel_scores`.

    floor: the map's normalizer floor (B, H, L or 1, 1) (maps with a floor, trig, have no key
    log-scale, so it is in the units of s), a float, or None (smallest normal float).  Returns
    (weights (B, H, n, L), unfloored normalizer (B, H, n)); signed features (trig) give signed weights."""
    a = scores.masked_fill(~_visible(rows, scores.shape[-1], causal), 0.0)
    den = a.sum(-1)
    if isinstance(floor, torch.Tensor):
        floored = torch.maximum(den, floor[:, :, rows if floor.shape[-2] > 1 else [0], 0])
    else:
        floored = den.clamp_min(torch.finfo(den.dtype).tiny if floor is None else floor)
    return a / floored[..., None], den


def mean_rows(v: torch.Tensor, rows: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """The floor every kernel must beat: the plain mean of the values visible to each of ``rows``."""
    if not causal:
        return v.mean(-2, keepdim=True).expand(*v.shape[:-2], len(rows), v.shape[-1])
    return v.cumsum(-2)[:, :, rows] / (rows + 1).to(v.dtype)[:, None]

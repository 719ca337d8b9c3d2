"""Exact softmax attention inside a sliding window, in O(L x window) time and memory.

Why: a linear kernel summarizes every key into one fixed-size state, so it cannot look up one
earlier position exactly; proteins are full of short repeats, and copying from them is where
FAVOR+ loses to exact attention on long proteins (docs/long_proteins.md). A few heads of exact
attention over a local window (performer-pytorch's ``local_attn_heads``) give the model that
lookup and stay linear in L.

Query i sees key j when |i - j| < window (bidirectional) or 0 <= i - j < window (causal), and j is
not padding; a query always sees itself, so no row is empty. The sequence is cut into blocks of
``window`` positions; each block of queries attends to its own block and its neighbours (the one
before; and after, when bidirectional), masked to the band. ``naive.local_softmax_attention`` is
the quadratic reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def local_band(L: int, window: int, causal: bool = False, key_padding_mask: torch.Tensor | None = None,
               device=None) -> torch.Tensor:
    """Which key slot each query of a block may see: bool (B or 1, 1, N, w, n_off * w) for N blocks of
    w = min(window, L) positions (a window past the sequence sees what the whole sequence shows, at
    L x L cost rather than window^2).  It depends on the padding and the length, not on the layer:
    masks.AttentionMasks builds it once per forward for all layers."""
    w = max(1, min(int(window), L))
    N = -(-L // w)
    pad = N * w - L
    offsets = (-1, 0) if causal else (-1, 0, 1)
    # key slot c of block n is position (n + offsets[0]) * w + c; query a of block n is n * w + a
    n = torch.arange(N, device=device)[:, None, None]
    a = torch.arange(w, device=device)[None, :, None]
    c = torch.arange(len(offsets) * w, device=device)[None, None, :]
    key_pos = (n + offsets[0]) * w + c                   # (N, 1, n_off * w)
    diff = n * w + a - key_pos                            # query position - key position
    band = (diff >= 0) & (diff < window) if causal else diff.abs() < window
    allowed = (band & (key_pos >= 0) & (key_pos < L))[None]     # (1, N, w, n_off * w)
    if key_padding_mask is not None:
        kp = F.pad(key_padding_mask.bool(), (w, pad + w), value=True).view(-1, N + 2, w)
        kp = torch.cat([kp[:, 1 + o:1 + o + N] for o in offsets], dim=2)     # (B, N, n_off * w)
        allowed = allowed & ~kp[:, :, None, :]
    return (allowed | (diff == 0)[None])[:, None]         # itself: no empty row


def local_bias(band: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`local_band` as SDPA's additive mask for :func:`local_attention`'s 4-D layout: (B x heads or 1,
    N, w, n_off * w), 0 where a key is seen and -inf elsewhere (a float mask: no conversion per layer)."""
    bias = torch.zeros(band.shape, dtype=dtype, device=band.device).masked_fill_(~band, float("-inf"))[:, 0]
    return bias.repeat_interleave(heads, 0) if bias.shape[0] > 1 else bias


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, causal: bool = False,
                    key_padding_mask: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """q, k, v (B, H, L, d); key_padding_mask (B, L) True = padding -> (B, H, L, d).  ``bias``: this
    length's :func:`local_bias` (with the padding in it), when the caller keeps one for all layers.

    4-D for SDPA ((B x H, N blocks, w, d): its fused kernel takes a mask in 4-D, a 5-D call falls back
    to a dozen ops), and each block's keys are a strided window over the padded keys (``unfold``: no
    copies, one op in the backward)."""
    B, H, L, d = q.shape
    w = max(1, min(int(window), L))
    N = -(-L // w)
    pad = N * w - L
    n_off = 2 if causal else 3
    right = pad + (n_off - 2) * w                          # keys of block n: padded positions n w .. (n + n_off) w

    if bias is None:
        bias = local_bias(local_band(L, window, causal, key_padding_mask, q.device), H, q.dtype)
    queries = (F.pad(q, (0, 0, 0, pad)) if pad else q).reshape(B * H, N, w, d)
    # keys and values together (one pad and one window view for both, one fold in the backward):
    # (2, B, H, L, d) -> (2, B H, N, n_off w, d), overlapping views
    kv = F.pad(torch.stack([k, v]), (0, 0, w, right)).view(2, B * H, -1, d).unfold(2, n_off * w, w).transpose(-1, -2)
    out = F.scaled_dot_product_attention(queries, *kv.unbind(0), attn_mask=bias.to(q.dtype))
    return out.view(B, H, N * w, d)[:, :, :L] if pad else out.view(B, H, L, d)


def local_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                 cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Causal decoding: T new positions (B, H, T, d) after the cached keys and values of the
    window - 1 positions before them -> (out (B, H, T, d), the new cache, at most window - 1 long:
    a state whose size does not grow with the position)."""
    K, V = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
    T, c = q.shape[2], cache[0].shape[2]
    if T <= window:  # a token or a short prompt: its (T, c + T) band directly
        diff = torch.arange(c, c + T, device=q.device)[:, None] - torch.arange(c + T, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(q, K, V, attn_mask=(diff >= 0) & (diff < window))
    else:            # a long prompt: blockwise, the cached rows computed and dropped
        Q = torch.cat([q.new_zeros(*q.shape[:2], c, q.shape[-1]), q], dim=2)
        out = local_attention(Q, K, V, window, causal=True)[:, :, c:]
    start = max(K.shape[2] - (int(window) - 1), 0)
    return out, (K[:, :, start:], V[:, :, start:])

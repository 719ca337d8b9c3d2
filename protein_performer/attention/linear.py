r"""Linear attention D^-1 (Q' (K'^T V)) on feature-mapped queries and keys.

Three paths behind :func:`linear_attention`:

* bidirectional: S = K'^T V (r x d), Z = K'^T 1, out = Q'S / Q'Z;
* causal, chunked: the sequence is cut into chunks of C positions.  Inside a chunk the
  masked (Q'K'^T)V is a small dense product; across chunks a running state
  S = sum_j k'_j v_j^T, Z = sum_j k'_j is carried.  Chunks are processed in groups with
  one batched matmul per group (no Python loop over single chunks).  It is wrapped in
  :class:`CausalLinearProduct`, a ``torch.autograd.Function`` whose backward recomputes
  the states chunk by chunk instead of storing them ("Transformers are RNNs",
  Katharopoulos et al. 2020, eqs. 8-10): with G the output gradient,
      dQ_i = G_i S_i^T                    (S_i = sum_{j<=i} k_j v_j^T, forward prefix sums)
      dK_j = R_j V_j,  dV_j = R_j^T K_j   (R_j = sum_{i>=j} q_i g_i^T, reverse prefix sums)
  so training memory per head is O(L (r + d) + L C), never O(L r d);
* recurrent (:func:`linear_attention_step`): one token's q', k', v and the state (S, Z).

The normalizer is computed by the same causal product, on a column of ones appended to V.
All state arithmetic runs in float32 with autocast disabled (float64 inputs stay float64);
the output is returned in V's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: default chunk length of the causal path
DEFAULT_CHUNK_SIZE = 128
#: positions handled per batched group of chunks (bounds temporaries independent of L)
GROUP_POSITIONS = 4096


def _chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """(G, L, f) -> (G, N, C, f), zero-padded at the end."""
    pad = (-x.shape[1]) % C
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(x.shape[0], -1, C, x.shape[-1])


def _exclusive_cumsum(x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """start + sum of x[:, :n] for each n along dim 1 (x: (G, n, ...), start: (G, 1, ...))."""
    if x.shape[1] == 1:
        return start.expand_as(x)
    return torch.cat([start, start + x[:, :-1].cumsum(1)], dim=1)


def _reverse_exclusive_cumsum(x: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """end + sum of x[:, n+1:] for each n along dim 1."""
    if x.shape[1] == 1:
        return end.expand_as(x)
    rev = x[:, 1:].flip(1).cumsum(1).flip(1)
    return torch.cat([end + rev, end], dim=1)


def _tril_mask(C: int, device) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril()


def causal_product_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                           return_boundaries: bool = False):
    """out_i = sum_{j<=i} (q_i . k_j) v_j for q, k: (G, L, r), v: (G, L, e).

    With ``return_boundaries`` also the states at the start of every group of chunks
    (G, n_groups, r, e): all the backward needs besides q, k, v."""
    G, L, r = q.shape
    e = v.shape[-1]
    C = max(1, min(chunk_size, L))
    qc, kc, vc = _chunks(q, C), _chunks(k, C), _chunks(v, C)
    N = qc.shape[1]
    n = max(1, GROUP_POSITIONS // C)
    keep = _tril_mask(C, q.device)
    out = q.new_empty(G, N, C, e)
    S = q.new_zeros(G, 1, r, e)
    boundaries = []
    for s in range(0, N, n):
        sl = slice(s, min(s + n, N))
        qg, kg, vg = qc[:, sl], kc[:, sl], vc[:, sl]
        if return_boundaries:
            boundaries.append(S)
        kv = kg.transpose(-1, -2) @ vg                        # (G, n, r, e)
        S_before = _exclusive_cumsum(kv, S)
        A = (qg @ kg.transpose(-1, -2)).masked_fill_(~keep, 0)  # (G, n, C, C)
        o = qg @ S_before
        o += A @ vg
        out[:, sl] = o
        S = S_before[:, -1:] + kv[:, -1:]
    out = out.reshape(G, N * C, e)[:, :L]
    if return_boundaries:
        return out, torch.cat(boundaries, dim=1)
    return out


def causal_product_backward(q, k, v, g, boundaries, chunk_size: int):
    """Gradients of causal_product_forward w.r.t. q, k, v, recomputing states chunk by chunk.

    One pass over the groups in reverse order: forward states S inside the group are
    rebuilt from the saved group boundary, reverse states R from the running suffix sum."""
    G, L, r = q.shape
    e = v.shape[-1]
    C = max(1, min(chunk_size, L))
    qc, kc, vc, gc = _chunks(q, C), _chunks(k, C), _chunks(v, C), _chunks(g, C)
    N = qc.shape[1]
    n = max(1, GROUP_POSITIONS // C)
    keep = _tril_mask(C, q.device)
    dq, dk, dv = q.new_empty(G, N, C, r), q.new_empty(G, N, C, r), q.new_empty(G, N, C, e)
    R = q.new_zeros(G, 1, r, e)  # sum over later groups of q_i g_i^T
    starts = list(range(0, N, n))
    for gi in reversed(range(len(starts))):
        s = starts[gi]
        sl = slice(s, min(s + n, N))
        qg, kg, vg, gg = qc[:, sl], kc[:, sl], vc[:, sl], gc[:, sl]
        S_before = _exclusive_cumsum(kg.transpose(-1, -2) @ vg, boundaries[:, gi:gi + 1])
        qg_T = qg.transpose(-1, -2) @ gg                      # (G, n, r, e)
        R_after = _reverse_exclusive_cumsum(qg_T, R)
        R = R_after[:, :1] + qg_T[:, :1]
        A = (qg @ kg.transpose(-1, -2)).masked_fill_(~keep, 0)   # A_ij = q_i.k_j, j <= i
        M = (gg @ vg.transpose(-1, -2)).masked_fill_(~keep, 0)   # M_ij = g_i.v_j, j <= i
        t = gg @ S_before.transpose(-1, -2)
        t += M @ kg
        dq[:, sl] = t
        t = vg @ R_after.transpose(-1, -2)
        t += M.transpose(-1, -2) @ qg
        dk[:, sl] = t
        t = kg @ R_after
        t += A.transpose(-1, -2) @ gg
        dv[:, sl] = t
    return (dq.reshape(G, N * C, r)[:, :L], dk.reshape(G, N * C, r)[:, :L],
            dv.reshape(G, N * C, e)[:, :L])


class CausalLinearProduct(torch.autograd.Function):
    """out_i = sum_{j<=i} (q_i . k_j) v_j with a memory-light, recomputing backward.

    Inputs (G, L, r), (G, L, r), (G, L, e); saves only q, k, v and one state per group of
    chunks (O(L/4096 * r * e))."""

    @staticmethod
    def forward(ctx, q, k, v, chunk_size):
        out, boundaries = causal_product_forward(q, k, v, chunk_size, return_boundaries=True)
        ctx.save_for_backward(q, k, v, boundaries)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        q, k, v, boundaries = ctx.saved_tensors
        dq, dk, dv = causal_product_backward(q, k, v, g.contiguous(), boundaries, ctx.chunk_size)
        return dq, dk, dv, None


def causal_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Unnormalized causal linear attention sum_{j<=i} (q_i.k_j) v_j for (..., L, r/e) tensors."""
    lead = q.shape[:-2]
    L = q.shape[-2]
    q3, k3, v3 = (t.reshape(-1, L, t.shape[-1]).contiguous() for t in (q, k, v))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = CausalLinearProduct.apply(q3, k3, v3, int(chunk_size))
    else:
        out = causal_product_forward(q3, k3, v3, int(chunk_size))
    return out.reshape(*lead, L, v.shape[-1])


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     key_padding_mask: torch.Tensor | None = None, chunk_size: int | None = None,
                     eps: float | None = None) -> torch.Tensor:
    """Linear attention with feature-mapped q, k (B, H, L, r) and v (B, H, L, d) -> (B, H, L, d).

    key_padding_mask: bool (B, L), True = padding (as in ``nn.MultiheadAttention``); padded
    keys are removed from the numerator and the normalizer.  Outputs at padded query
    positions are meaningless (but finite).  chunk_size: chunk length of the causal path
    (default 128).  eps: lower clamp of the normalizer (default: smallest normal float).
    """
    out_dtype = v.dtype
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if key_padding_mask is not None:
            k = k.masked_fill(key_padding_mask.bool()[:, None, :, None], 0.0)
        eps = torch.finfo(dtype).tiny if eps is None else eps
        if causal:
            ones = v.new_ones(*v.shape[:-1], 1)
            nd = causal_product(q, k, torch.cat([v, ones], dim=-1), chunk_size or DEFAULT_CHUNK_SIZE)
            num, den = nd[..., :-1], nd[..., -1:]
        else:
            kv = k.transpose(-1, -2) @ v                       # (B, H, r, d)
            z = k.sum(dim=-2)                                  # (B, H, r)
            num = q @ kv
            den = (q @ z.unsqueeze(-1))
        out = num / den.clamp_min(eps)
    return out.to(out_dtype)


def init_linear_state(batch: int, heads: int, r: int, d: int, device=None, dtype=torch.float32):
    """Zero recurrent state (S (B, H, r, d), Z (B, H, r))."""
    return (torch.zeros(batch, heads, r, d, device=device, dtype=dtype),
            torch.zeros(batch, heads, r, device=device, dtype=dtype))


def linear_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          state: tuple[torch.Tensor, torch.Tensor], eps: float | None = None):
    """Recurrent causal linear attention for one position.

    q, k: (B, H, r) feature-mapped; v: (B, H, d); state (S, Z) in float32 (or float64).
    Returns (out (B, H, d) in v's dtype, new state).  Cost and memory do not grow with position.
    """
    S, Z = state
    dtype = S.dtype
    with torch.autocast(q.device.type, enabled=False):
        qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
        S = S + kf.unsqueeze(-1) * vf.unsqueeze(-2)
        Z = Z + kf
        num = (qf.unsqueeze(-2) @ S).squeeze(-2)
        den = (qf * Z).sum(-1, keepdim=True)
        out = num / den.clamp_min(torch.finfo(dtype).tiny if eps is None else eps)
    return out.to(v.dtype), (S, Z)

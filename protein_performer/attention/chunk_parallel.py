r"""Causal linear attention with every chunk at once: a fixed number of batched products per call.

Why: the chunked path of linear.py walks the chunks in a Python loop, which suits a CPU (each step
stays in cache) but costs a GPU a few kernel launches per chunk: at protein lengths its steps are
launch-bound (issue 42: 3,748 aten ops per layer at L = 1,024, 43,828 at 16,384).  Here the same
arithmetic is laid out over a chunk axis, so the number of ops does not grow with L:

    intra-chunk   A = tril(Q'_n K'_n^T * decay_n)           (B, H, N, C, C), one batched matmul
                  intra_n = A [V_n, 1]
    chunk states  U_n = K'_n^T ([V_n, 1] exp(s - m_n))       (B, H, N, r, d + 1)
    prefix        P_n = sum_{p<n} exp(m_p - m_{n-1}) U_p      one (N x N) product over the chunks
    inter-chunk   inter_n = (Q'_n P_n) exp(m_{n-1} - M_i)
    out           [num | den] = intra + inter,  out = num / max(den, eps)

Stabilizer (as in linear.py, in log space): key j carries its log-scale s_j, query i divides by the
running maximum M_i = max(m0, max_{j<=i} s_j), and m_n is M at the end of chunk n.  Every exponent
above is <= 0 (s_j <= M_i for j <= i; m_p <= m_{n-1} for p < n; m_{n-1} <= M_i in chunk n), and M_i
uses positions <= i only, so earlier outputs never depend on later keys.  The prefix is a product
with the lower-triangular matrix W[n, p] = exp(m_p - m_{n-1}) rather than a cumulative sum of
exp(m_p) U_p, which would need one reference scale for the whole sequence and underflow when the
scales span more than ~80 (float32).  Without key scales (elu+1, ReLU) the prefix is a cumulative sum.

Cost: O(L C (r + d)) for the chunks and O(N^2 r d) for the prefix (N = L / C): the chunk is doubled
from ``chunk_size`` while N > :data:`MAX_CHUNKS`, so the prefix stays below the chunk products at
protein lengths.  The backward is autograd's through these products (the transposed products are
the reverse sums of "Transformers are RNNs"); M is a constant there (the output does not depend on
it, so that gradient is the whole one).  Memory: O(L (C + r + d)) per head, never O(L r d).

All arithmetic in float32 with autocast off (float64 stays float64); output in v's dtype.  Same
signature and state as :func:`~protein_performer.attention.linear.chunk_linear_attention`, held to
the float64 quadratic reference (tests/test_chunk_parallel.py).  A non-finite value poisons its own
and later positions only, as in linear.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import DEFAULT_CHUNK_SIZE, LinearState, clamp_normalizer, prepare_inputs, with_ones

#: most chunks before the chunk length is doubled (the N x N prefix product stays small)
MAX_CHUNKS = 1024


def parallel_chunk_length(L: int, chunk_size: int | None = None) -> int:
    """``chunk_size`` (default 64), doubled while more than :data:`MAX_CHUNKS` chunks would cover L."""
    C = max(1, int(chunk_size or DEFAULT_CHUNK_SIZE))
    while -(-L // C) > MAX_CHUNKS:
        C *= 2
    return min(C, max(L, 1))


def chunk_parallel_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                    k_log_scale: torch.Tensor | None = None, eps: float | torch.Tensor | None = None,
                                    key_padding_mask: torch.Tensor | None = None, chunk_size: int | None = None,
                                    initial_state: LinearState | None = None, output_final_state: bool = False):
    """Causal linear attention, all chunks at once: q, k (B, H, L, r) features, v (B, H, L, d) ->
    (out (B, H, L, d) in v's dtype, final state (S, Z, m) or None); arguments as
    :func:`~protein_performer.attention.linear.chunk_linear_attention`.  Products are 3-D (bmm): rows
    (B x H x N) of one chunk each, or (B x H) of N chunks for the prefix."""
    out_dtype = v.dtype
    B, H, L, r = q.shape
    d = v.shape[-1]
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, s, eps, dtype = prepare_inputs(q, k, v, k_log_scale, eps, key_padding_mask, initial_state)
        C = parallel_chunk_length(L, chunk_size)
        N = -(-L // C)
        extra = N * C - L
        v1 = with_ones(v)
        bad = ~torch.isfinite(v1.sum(-1))                                   # (B, H, L)
        v1 = v1.masked_fill(bad.unsqueeze(-1), 0.0)
        chunks = lambda x: (F.pad(x, (0, 0, 0, extra)) if extra else x).reshape(B * H * N, C, x.shape[-1])  # noqa: E731
        qc, kc, vc = chunks(q), chunks(k), chunks(v1)
        S0 = m0 = None
        if initial_state is not None:
            S0 = torch.cat([initial_state[0], initial_state[1].unsqueeze(-1)], dim=-1).to(dtype).view(B * H, r, d + 1)
            m0 = initial_state[2].to(dtype).reshape(B * H)
        scores = torch.bmm(qc, kc.transpose(1, 2))                          # (B H N, C, C)
        upper = _upper(C, q.device)
        if s is None:
            nd, SZ = _unscaled(qc, kc, vc, scores.masked_fill(upper, 0.0), S0, N)
            m = m0.view(B, H, 1) if m0 is not None else torch.full((B, H, 1), torch.finfo(dtype).min,
                                                                  device=q.device, dtype=dtype)
        else:
            s = (F.pad(s, (0, extra), value=torch.finfo(dtype).min) if extra else s).reshape(B * H, N, C)
            nd, SZ, m = _scaled(qc, kc, vc, scores, upper, s, S0, m0)
            m = m.view(B, H, 1)
        nd = nd.view(B, H, N * C, d + 1)[:, :, :L]
        out = nd[..., :d] / clamp_normalizer(nd[..., d:], eps)
        out = out.masked_fill((bad.cumsum(-1) > 0).unsqueeze(-1), float("nan")).to(out_dtype)  # after the division: no 0 * nan
    if not output_final_state:
        return out, None
    SZ = SZ.view(B, H, r, d + 1)
    return out, (SZ[..., :d], SZ[..., d], m)


_MASKS: dict = {}


def _upper(C: int, device) -> torch.Tensor:
    """(C, C) bool, True above the diagonal (a later key), made once per length and device (in a
    compiled graph, made in it: a cache filled while tracing is a guard that fails on the next call)."""
    if torch.compiler.is_compiling():
        return torch.ones(C, C, dtype=torch.bool, device=device).triu_(1)
    key = (C, str(device))
    if key not in _MASKS:
        _MASKS[key] = torch.ones(C, C, dtype=torch.bool, device=device).triu_(1)
    return _MASKS[key]


def _unscaled(qc, kc, vc, A, S0, N):
    """Maps without key scales: the prefix of the chunk states is an exclusive cumulative sum."""
    U = torch.bmm(kc.transpose(1, 2), vc)                                   # (G N, r, e)
    G = U.shape[0] // N
    U = U.view(G, N, *U.shape[1:])
    P = torch.cat([torch.zeros_like(U[:, :1]), U[:, :-1].cumsum(1)], dim=1)
    if S0 is not None:
        P = P + S0.unsqueeze(1)
    nd = torch.baddbmm(torch.bmm(qc, P.view(G * N, *P.shape[2:])), A, vc)
    return nd, P[:, -1] + U[:, -1]


def _scaled(qc, kc, vc, scores, upper, s, S0, m0):
    """Maps with key log-scales s (G, N, C): the running-maximum stabilizer in log space."""
    G, N, C = s.shape
    with torch.no_grad():
        M = torch.cummax(s.view(G, N * C) if m0 is None else torch.maximum(s.view(G, N * C), m0[:, None]),
                         dim=-1).values.view(G, N, C)
        m_end = M[..., -1]                                                  # (G, N)
        m_prev = torch.cat([M[:, :1, 0] if m0 is None else m0[:, None], m_end[:, :-1]], dim=-1)  # chunk n's units
        later = torch.ones(N, N, dtype=torch.bool, device=s.device).triu_()   # p >= n: not an earlier chunk
        W = (m_end.unsqueeze(1) - m_prev.unsqueeze(2)).masked_fill_(later, float("-inf")).exp_()
        q_scale = torch.exp(m_prev.unsqueeze(-1) - M).view(G * N, C, 1)
        m_final = m_end[:, -1:]                                             # (G, 1)
        end_scale = torch.exp(m_end - m_final)[..., None, None]             # (G, N, 1, 1)
    decay = (s.unsqueeze(-2) - M.unsqueeze(-1)).view(G * N, C, C).masked_fill(upper, float("-inf")).exp()
    U = torch.bmm(kc.transpose(1, 2), vc * torch.exp(s - m_end.unsqueeze(-1)).view(G * N, C, 1))  # (G N, r, e)
    r, e = U.shape[1:]
    P = torch.bmm(W, U.view(G, N, r * e)).view(G * N, r, e)
    SZ = (U.view(G, N, r, e) * end_scale).sum(1)
    if S0 is not None:
        P = P + (S0.unsqueeze(1) * torch.exp(m0[:, None] - m_prev)[..., None, None]).view(G * N, r, e)
        SZ = SZ + S0 * torch.exp(m0 - m_final[:, 0])[:, None, None]
    nd = torch.baddbmm(torch.bmm(qc, P).mul_(q_scale), scores * decay, vc)
    return nd, SZ, m_final

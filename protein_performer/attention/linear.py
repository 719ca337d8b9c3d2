r"""Linear attention D^-1 (Q' (K'^T V)) on feature-mapped queries and keys.

Three paths behind :func:`linear_attention`:

* bidirectional: S = K'^T V (r x d), Z = K'^T 1, out = Q'S / Q'Z;
* causal, chunked: the sequence is cut into chunks of C positions.  Inside a chunk the
  masked (Q'K'^T)V is a small dense product; across chunks a running state
  S = sum_j k'_j v_j^T, Z = sum_j k'_j is carried (prefix sums over chunks).  Chunks are processed with
  one batched matmul for all chunks (no Python loop over chunks).  It is wrapped in
  :class:`CausalLinearProduct`, a ``torch.autograd.Function`` whose backward recomputes
  the states chunk by chunk instead of storing them ("Transformers are RNNs",
  Katharopoulos et al. 2020, eqs. 8-10): with G the output gradient,
      dQ_i = G_i S_i^T                    (S_i = sum_{j<=i} k_j v_j^T, forward prefix sums)
      dK_j = R_j V_j,  dV_j = R_j^T K_j   (R_j = sum_{i>=j} q_i g_i^T, reverse prefix sums)
  so training memory per head is O(L (r + d + C) + (L / C) r d) (inputs, one C x C block
  per chunk, one r x d state per chunk as a temporary), never O(L r d);
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


def _chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """(G, L, f) -> (G, N, C, f), zero-padded at the end."""
    pad = (-x.shape[1]) % C
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(x.shape[0], -1, C, x.shape[-1])


#: block length of the matmul-based prefix sums over chunks
_SCAN_BLOCK = 32


def _exclusive_cumsum(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """out[:, n] = sum_{m<n} x[:, m] (reverse: sum_{m>n}) along dim 1 of x (G, N, ...).

    Computed as matmuls with a strictly triangular 0/1 matrix inside blocks of 32 chunks, plus
    a small scan over block totals: on CPU this is several times faster than ``torch.cumsum``
    along a non-innermost dim, and far faster than a Python loop of small adds (each a
    multithreaded op whose barrier stalls when the cores are shared).  Cost 2*32 flops per
    state entry; sums stay in x's dtype (float32 or float64)."""
    G, N = x.shape[:2]
    flat = x.reshape(G, N, -1)
    nb = min(N, _SCAN_BLOCK)
    pad = (-N) % nb
    if pad:
        flat = F.pad(flat, (0, 0, pad, 0) if reverse else (0, 0, 0, pad))
    Nb = flat.shape[1] // nb
    blocks = flat.view(G * Nb, nb, -1)
    T = torch.ones(nb, nb, dtype=x.dtype, device=x.device)
    T = T.triu(1) if reverse else T.tril(-1)
    out = torch.matmul(T, blocks).view(G, Nb, nb, -1)
    if Nb > 1:
        totals = blocks.sum(1).view(G, Nb, -1)
        offs = torch.zeros_like(totals)
        if reverse:
            offs[:, :-1] = totals.flip(1).cumsum(1).flip(1)[:, 1:]
        else:
            offs[:, 1:] = totals.cumsum(1)[:, :-1]
        out += offs.unsqueeze(2)
    out = out.view(G, Nb * nb, -1)
    out = out[:, pad:] if (pad and reverse) else out[:, :N]
    return out.reshape(x.shape)


def _reverse_exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """out[:, n] = sum_{m>n} x[:, m] along dim 1."""
    return _exclusive_cumsum(x, reverse=True)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched product of (G, N, i, j) @ (G, N, j, k) through 3-D bmm (no broadcasting copies)."""
    G, N = a.shape[:2]
    return torch.bmm(a.reshape(G * N, *a.shape[2:]), b.reshape(G * N, *b.shape[2:])).view(G, N, a.shape[2], b.shape[3])


def _addbmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out += a @ b for (G, N, ., .) tensors, in place."""
    G, N = a.shape[:2]
    out.view(G * N, *out.shape[2:]).baddbmm_(a.reshape(G * N, *a.shape[2:]), b.reshape(G * N, *b.shape[2:]))
    return out


def _masked_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """tril(a b^T) per chunk: entry (i, j) = a_i . b_j for j <= i, else 0."""
    return _bmm(a, b.transpose(-1, -2)).tril_()


def causal_product_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                           return_scores: bool = False):
    """out_i = sum_{j<=i} (q_i . k_j) v_j for q, k: (G, L, r), v: (G, L, e).

    All chunks at once: per-chunk states k_c^T v_c, their exclusive prefix sum over chunks,
    then out_c = q_c S_{<c} + tril(q_c k_c^T) v_c, each a single batched matmul.
    With ``return_scores`` also the per-chunk tril(q_c k_c^T) (G, N, C, C), which the backward
    reuses (L * C floats per head, no more than the inputs for C <= r)."""
    G, L, _ = q.shape
    e = v.shape[-1]
    C = max(1, min(int(chunk_size), L))
    qc, kc, vc = _chunks(q, C), _chunks(k, C), _chunks(v, C)
    S = _exclusive_cumsum(_bmm(kc.transpose(-1, -2), vc))            # (G, N, r, e) states before chunk
    out = _bmm(qc, S)
    del S
    A = _masked_scores(qc, kc)
    _addbmm_(out, A, vc)
    out = out.reshape(G, -1, e)[:, :L]
    return (out, A) if return_scores else out


def causal_product_backward(q, k, v, g, chunk_size: int, A: torch.Tensor | None = None):
    """Gradients of causal_product_forward w.r.t. q, k, v, recomputing the states.

        dQ_c = G_c S_{<c}^T + tril(G_c V_c^T) K_c          S = sum k v^T  (forward prefix sums)
        dK_c = V_c R_{>c}^T + tril(G_c V_c^T)^T Q_c        R = sum q g^T  (reverse prefix sums)
        dV_c = K_c R_{>c}   + tril(Q_c K_c^T)^T G_c
    """
    G, L, r = q.shape
    e = v.shape[-1]
    C = max(1, min(int(chunk_size), L))
    qc, kc, vc, gc = _chunks(q, C), _chunks(k, C), _chunks(v, C), _chunks(g, C)
    M = _masked_scores(gc, vc)                                        # M_ij = g_i . v_j, j <= i
    S = _exclusive_cumsum(_bmm(kc.transpose(-1, -2), vc))
    dq = _bmm(gc, S.transpose(-1, -2))
    del S
    _addbmm_(dq, M, kc)
    R = _reverse_exclusive_cumsum(_bmm(qc.transpose(-1, -2), gc))      # (G, N, r, e) states after chunk
    dk = _bmm(vc, R.transpose(-1, -2))
    _addbmm_(dk, M.transpose(-1, -2), qc)
    del M
    dv = _bmm(kc, R)
    del R
    _addbmm_(dv, (_masked_scores(qc, kc) if A is None else A).transpose(-1, -2), gc)
    return dq.reshape(G, -1, r)[:, :L], dk.reshape(G, -1, r)[:, :L], dv.reshape(G, -1, e)[:, :L]


class CausalLinearProduct(torch.autograd.Function):
    """out_i = sum_{j<=i} (q_i . k_j) v_j with a memory-light, recomputing backward.

    Inputs (G, L, r), (G, L, r), (G, L, e); saves q, k, v and the per-chunk masked scores
    tril(q_c k_c^T) (O(L (r + e + C)) per head), never a state per position."""

    @staticmethod
    def forward(ctx, q, k, v, chunk_size):
        with torch.autocast(q.device.type, enabled=False):
            out, A = causal_product_forward(q, k, v, chunk_size, return_scores=True)
        ctx.save_for_backward(q, k, v, A)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        q, k, v, A = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):  # backward may run inside an autocast region
            dq, dk, dv = causal_product_backward(q, k, v, g.to(q.dtype).contiguous(), ctx.chunk_size, A)
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
                     eps: float | torch.Tensor | None = None) -> torch.Tensor:
    """Linear attention with feature-mapped q, k (B, H, L, r) and v (B, H, L, d) -> (B, H, L, d).

    key_padding_mask: bool (B, L), True = padding (as in ``nn.MultiheadAttention``); padded
    keys are removed from the numerator and the normalizer.  Outputs at padded query
    positions are meaningless (but finite).  chunk_size: chunk length of the causal path
    (default 128).  eps: lower clamp of the normalizer, a float or a tensor broadcastable
    to (B, H, L, 1) (default: smallest normal float).
    """
    out_dtype = v.dtype
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if key_padding_mask is not None:
            k = k.masked_fill(key_padding_mask.bool()[:, None, :, None], 0.0)
        eps = torch.finfo(dtype).tiny if eps is None else eps
        # the normalizer is the product with a column of ones appended to v
        v1 = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
        if causal:
            nd = causal_product(q, k, v1, chunk_size or DEFAULT_CHUNK_SIZE)
        else:
            nd = q @ (k.transpose(-1, -2) @ v1)                # (B, H, L, r) @ (B, H, r, d + 1)
        num, den = nd.split([v.shape[-1], 1], dim=-1)
        if isinstance(eps, torch.Tensor):
            den = torch.maximum(den, eps.to(dtype))
        else:
            den = den.clamp_min(eps)
        out = num / den
    return out.to(out_dtype)


def init_linear_state(batch: int, heads: int, r: int, d: int, device=None, dtype=torch.float32):
    """Zero recurrent state (S (B, H, r, d), Z (B, H, r))."""
    return (torch.zeros(batch, heads, r, d, device=device, dtype=dtype),
            torch.zeros(batch, heads, r, device=device, dtype=dtype))


def linear_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          state: tuple[torch.Tensor, torch.Tensor], eps: float | torch.Tensor | None = None):
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
        eps = torch.finfo(dtype).tiny if eps is None else eps
        den = torch.maximum(den, eps.to(dtype)) if isinstance(eps, torch.Tensor) else den.clamp_min(eps)
        out = num / den
    return out.to(v.dtype), (S, Z)

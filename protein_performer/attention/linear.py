r"""Linear attention D^-1 (Q' (K'^T V)) on feature-mapped queries and keys.

Three paths behind :func:`linear_attention`:

* bidirectional: S = K'^T V (r x d), Z = K'^T 1, out = Q'S / Q'Z;
* causal, chunked (:class:`CausalLinearAttention`): the sequence is cut into chunks of C
  positions.  Inside a chunk the masked (Q'K'^T)V is a small dense product; across chunks a
  running state S = sum_j k'_j v_j^T, Z = sum_j k'_j is carried (prefix sums over chunks,
  one batched matmul for all chunks, no Python loop over chunks).  The backward recomputes
  the states instead of storing one per position ("Transformers are RNNs", Katharopoulos et
  al. 2020, eqs. 8-10): with G the gradient of the unnormalized product,
      dQ_i = sum_{j<=i} (g_i . v_j) k_j      (forward prefix sums of k v^T)
      dK_j = sum_{i>=j} (v_j . g_i) q_i      (reverse prefix sums of q g^T)
      dV_j = sum_{i>=j} (q_i . k_j) g_i      (the same reverse prefix sums)
  with the intra-chunk scores reused from the forward and the reverse sums taken over chunk
  states, so training memory per head is O(L (r + d + C) + (L / C) r d), never O(L r d);
* recurrent (:func:`linear_attention_step`): one token's q', k', v and the state (S, Z, m).

Key scales (why exponential features cannot underflow)
-------------------------------------------------------
Exponential feature maps (FAVOR+, FAVOR++) hand over each key as ``k'_j exp(s_j)`` with
max_r k'_jr = 1 and the log-scale s_j (see feature_maps.py).  Attention is invariant to
one common factor on all keys a query sees, so

* bidirectional: every key is rescaled by exp(s_j - max_j s_j) (max over real keys);
* causal: query i sees keys j <= i through the running maximum M_i = max_{j<=i} s_j:
  out_i = sum_{j<=i} exp(s_j - M_i) (q'_i.k'_j) v_j / (same with v = 1).
  All factors exp(s_j - M_i) are <= 1 and the largest visible key has weight 1, so nothing
  overflows and the dominant terms never underflow; M_i uses positions <= i only, so past
  outputs do not depend on future keys.  Per chunk the state is kept in units of the chunk's
  last M and rescaled when carried (online softmax's running-max trick, with a
  monotone M no factor ever exceeds 1).  The recurrent state carries m = M_t.

All state arithmetic runs in float32 with autocast disabled (float64 inputs stay float64);
the output is returned in V's dtype.  A non-finite value at a padded position is zeroed; one
at a future position never reaches past outputs (masks select, they do not multiply).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: default chunk length of the causal path
DEFAULT_CHUNK_SIZE = 128

#: block length (in chunks) of the matmul-based prefix sums over chunks
_SCAN_BLOCK = 32


def _chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """(G, L, f) -> (G, N, C, f), zero-padded at the end."""
    pad = (-x.shape[1]) % C
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(x.shape[0], -1, C, x.shape[-1])


def _chunks_of_scale(M: torch.Tensor, C: int) -> torch.Tensor:
    """(G, L) running maxima -> (G, N, C), padded at the end with the last value (stays monotone)."""
    pad = (-M.shape[1]) % C
    if pad:
        M = torch.cat([M, M[:, -1:].expand(-1, pad)], dim=1)
    return M.reshape(M.shape[0], -1, C)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """out[:, n] = sum_{m<n} x[:, m] along dim 1 of x (G, N, ...).

    Computed as matmuls with a strictly lower-triangular 0/1 matrix inside blocks of 32
    chunks, plus a small scan over block totals: on CPU this is several times faster than
    ``torch.cumsum`` along a non-innermost dim, and far faster than a Python loop of small adds."""
    G, N = x.shape[:2]
    flat = x.reshape(G, N, -1)
    nb = min(N, _SCAN_BLOCK)
    pad = (-N) % nb
    if pad:
        flat = F.pad(flat, (0, 0, 0, pad))
    Nb = flat.shape[1] // nb
    blocks = flat.view(G * Nb, nb, -1)
    T = torch.ones(nb, nb, dtype=x.dtype, device=x.device).tril(-1)
    out = torch.matmul(T, blocks).view(G, Nb, nb, -1)
    if Nb > 1:
        totals = blocks.sum(1).view(G, Nb, -1)
        offs = torch.zeros_like(totals)
        offs[:, 1:] = totals.cumsum(1)[:, :-1]
        out += offs.unsqueeze(2)
    return out.view(G, Nb * nb, -1)[:, :N].reshape(x.shape)


def _scaled_exclusive_cumsum(U: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """out[:, n] = sum_{p<n} U[:, p] exp(e_p - e_{n-1}) for U (G, N, ...) held in units exp(e_p),
    e (G, N) non-decreasing; out[:, n] is in units exp(e_{n-1}) (out[:, 0] = 0).  Every factor
    is <= 1.  Blocks of 32 chunks are one matmul with a masked decay matrix; a short loop over
    blocks carries the running total."""
    G, N = U.shape[:2]
    flat = U.reshape(G, N, -1)
    out = torch.empty_like(flat)
    nb = min(N, _SCAN_BLOCK)
    strict = torch.ones(nb, nb, dtype=torch.bool, device=U.device).tril(-1)
    carry = carry_e = None
    for s in range(0, N, nb):
        t = min(nb, N - s)
        eb = e[:, s:s + t]                                                 # (G, t)
        first = eb[:, :1] if carry_e is None else carry_e
        ref = torch.cat([first, eb[:, :-1]], dim=1)                        # e_{n-1} per row n
        diff = (eb[:, None, :] - ref[:, :, None]).masked_fill(~strict[:t, :t], float("-inf"))
        o = torch.bmm(diff.exp_(), flat[:, s:s + t])
        if carry is not None:
            o += carry[:, None] * torch.exp(carry_e - ref)[..., None]
        out[:, s:s + t] = o
        last = eb[:, -1:]
        total = torch.bmm(torch.exp(eb - last)[:, None, :], flat[:, s:s + t])[:, 0]
        carry = total if carry is None else carry * torch.exp(carry_e - last) + total
        carry_e = last
    return out.reshape(U.shape)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched product of (G, N, i, j) @ (G, N, j, k) through 3-D bmm (no broadcasting copies)."""
    G, N = a.shape[:2]
    return torch.bmm(a.reshape(G * N, *a.shape[2:]), b.reshape(G * N, *b.shape[2:])).view(G, N, a.shape[2], b.shape[3])


def _past_states(U: torch.Tensor, exclusive_scan) -> torch.Tensor:
    """exclusive_scan(U) over chunk states U (G, N, r, f; overwritten), where a chunk with a non-finite entry
    poisons (NaN) the states of later chunks only: the scan's masked matmuls would otherwise
    meet its inf/NaN with zeros and carry NaN into earlier chunks.  (A sum per chunk detects
    non-finite entries in one cheap pass.)"""
    bad = ~torch.isfinite(U.sum(dim=(2, 3)))                           # (G, N)
    S = exclusive_scan(U.masked_fill_(bad[..., None, None], 0.0))      # U is a temporary: in place
    after_bad = (bad.cumsum(1) - bad.long()) > 0
    return S.masked_fill_(after_bad[..., None, None], float("nan"))


def _reverse(scan, x: torch.Tensor, *args) -> torch.Tensor:
    """The reverse (sum over later chunks) of an exclusive scan, on the flipped chunk order."""
    return scan(x.flip(1), *(a.flip(1) for a in args)).flip(1)


class _Chunked:
    """q, k (G, L, r) cut into chunks, with the key-scale factors of the causal path.

    Key j's features are k_j exp(s_j); M_i = max_{j<=i} s_j.  Chunk n's state is kept in units
    of e_end[n] (its last M) and read in units of e_prev[n] (the previous chunk's last M): key
    rows carry k_factor = exp(s - e_end) and query rows q_factor = exp(e_prev - M), both <= 1,
    and inside a chunk the scores carry decay[i, j] = exp(s_j - M_i) (j <= i, <= 1).  The
    factors are per position, so they are applied to the narrow side of each product (v, g,
    outputs: width e) rather than to the r-wide features.  Without s every factor is 1."""

    def __init__(self, q, k, chunk_size: int, s):
        L = q.shape[1]
        self.C = C = max(1, min(int(chunk_size), L))
        self.qc, self.kc = _chunks(q, C), _chunks(k, C)
        self.causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        self.scaled = s is not None
        if s is None:
            return
        Mc = _chunks_of_scale(torch.cummax(s, dim=1).values, C)         # (G, N, C)
        sc = _chunks(s.unsqueeze(-1), C)[..., 0]                        # padding: k = 0 there anyway
        self.e_end = Mc[..., -1]
        self.e_prev = torch.cat([Mc[:, :1, 0], self.e_end[:, :-1]], dim=1)  # <= every M of chunk n
        self.decay = (sc[..., None, :] - Mc[..., :, None]).masked_fill_(~self.causal, float("-inf")).exp_()
        self.k_factor = torch.exp(sc - self.e_end[..., None]).unsqueeze(-1)
        self.q_factor = torch.exp(self.e_prev[..., None] - Mc).unsqueeze(-1)

    def key_rows(self, x):
        """x (G, N, C, f) with key rows scaled by k_factor."""
        return x * self.k_factor if self.scaled else x

    def query_rows(self, x):
        """x (G, N, C, f) with query rows scaled by q_factor."""
        return x * self.q_factor if self.scaled else x

    def scores(self, a, b):
        """Intra-chunk tril((a b^T) * decay), masked by selection (0 * inf never happens)."""
        s = _bmm(a, b.transpose(-1, -2))
        if self.scaled:
            s = s.mul_(self.decay)
        return s.masked_fill_(~self.causal, 0.0)

    def past(self, U, guard: bool = False):
        """Exclusive (rescaled) prefix sum over chunks of per-chunk states U (G, N, r, f)."""
        scan = _exclusive_cumsum if not self.scaled else (lambda x: _scaled_exclusive_cumsum(x, self.e_end))
        return _past_states(U, scan) if guard else scan(U)

    def future(self, W):
        """Reverse exclusive (rescaled) sum over chunks of W (G, N, r, f) held in units exp(-e_prev):
        R[n] = sum_{p>n} W[p] exp(e_end[n] - e_prev[p]), in units exp(-e_end[n])."""
        if not self.scaled:
            return _reverse(_exclusive_cumsum, W)
        return _reverse(_scaled_exclusive_cumsum, W, -self.e_prev)


def _with_ones(x: torch.Tensor) -> torch.Tensor:
    """[x, 1] along the last dim (the normalizer's column; width e + 1, not r)."""
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


def causal_product_forward(q, k, v, chunk_size: int, scale: torch.Tensor | None = None):
    """num_i = sum_{j<=i} exp(s_j - M_i) (q_i . k_j) v_j and den_i (the same with v = 1) for
    q, k (G, L, r), v (G, L, e), key log-scales s = ``scale`` (G, L) or None (factors 1) and
    their running maximum M_i = max_{j<=i} s_j.

    All chunks at once: per-chunk states k^T [v, 1], their exclusive (rescaled) prefix sum
    over chunks, then out_c = q_c S_{<c} + A_c v_c with the masked intra-chunk scores A_c, each
    a single batched matmul.  Returns num (G, L, e), den (G, L, 1) and the scores A
    (G, N, C, C), which the backward reuses."""
    G, L, _ = q.shape
    e = v.shape[-1]
    ch = _Chunked(q, k, chunk_size, scale)
    vc = _chunks(v, ch.C)
    A = ch.scores(ch.qc, ch.kc)
    U = _bmm(ch.kc.transpose(-1, -2), ch.key_rows(_with_ones(vc)))      # (G, N, r, e + 1)
    inter = ch.query_rows(_bmm(ch.qc, ch.past(U, guard=True)))
    # a non-finite value must not meet the zeros of the mask in the product: set it aside and
    # poison the rows at and after it instead
    bad = ~torch.isfinite(vc.sum(-1, keepdim=True))                     # (G, N, C, 1)
    num = inter[..., :e] + _bmm(A, vc.masked_fill(bad, 0.0))
    num = num.masked_fill(bad.cumsum(2) > 0, float("nan"))
    den = inter[..., e:] + A.sum(-1, keepdim=True)
    return num.reshape(G, -1, e)[:, :L], den.reshape(G, -1, 1)[:, :L], A


def causal_product_backward(q, k, v, g_num, g_den, chunk_size: int, scale=None, A=None):
    """Gradients w.r.t. q, k, v of (num, den) = causal_product_forward(q, k, v) given g_num
    (G, L, e) and g_den (G, L, 1).  With v1 = [v, 1], g1 = [g_num, g_den], D the decays:

        dQ_i = sum_{j<=i} D_ij (g1_i . v1_j) k_j    forward prefix sums of k v1^T
        dK_j = sum_{i>=j} D_ij (g1_i . v1_j) q_i    reverse prefix sums of q g1^T
        dV_j = sum_{i>=j} D_ij (q_i . k_j) g_i      the same reverse sums
    """
    G, L, r = q.shape
    e = v.shape[-1]
    ch = _Chunked(q, k, chunk_size, scale)
    v1c = _chunks(_with_ones(v), ch.C)
    g1c = _chunks(torch.cat([g_num, g_den], dim=-1), ch.C)
    Mx = ch.scores(g1c, v1c)                                            # D_ij (g1_i . v1_j)
    v1k, g1q = ch.key_rows(v1c), ch.query_rows(g1c)
    S = ch.past(_bmm(ch.kc.transpose(-1, -2), v1k))                     # (G, N, r, e + 1)
    dq = _bmm(g1q, S.transpose(-1, -2)).add_(_bmm(Mx, ch.kc))
    del S
    R = ch.future(_bmm(ch.qc.transpose(-1, -2), g1q))                   # (G, N, r, e + 1)
    dk = _bmm(v1k, R.transpose(-1, -2)).add_(_bmm(Mx.transpose(-1, -2), ch.qc))
    del Mx
    A = ch.scores(ch.qc, ch.kc) if A is None else A
    dv = ch.key_rows(_bmm(ch.kc, R[..., :e])).add_(_bmm(A.transpose(-1, -2), g1c[..., :e]))
    return dq.reshape(G, -1, r)[:, :L], dk.reshape(G, -1, r)[:, :L], dv.reshape(G, -1, e)[:, :L]


class CausalLinearAttention(torch.autograd.Function):
    """out_i = num_i / max(den_i, eps), the causal linear attention above, with a backward that
    recomputes the states.  Inputs q, k (G, L, r), v (G, L, e), key log-scales (G, L) or None, eps a
    float or a (G, L, 1) tensor (treated as a constant).  Saves q, k, v, s, the intra-chunk
    scores, the output and the normalizer: O(L (r + e + C)) per head, never a state per position."""

    @staticmethod
    def forward(ctx, q, k, v, scale, eps, chunk_size):
        with torch.autocast(q.device.type, enabled=False):
            num, den, A = causal_product_forward(q, k, v, chunk_size, scale)
            den_c = torch.maximum(den, eps) if isinstance(eps, torch.Tensor) else den.clamp_min(eps)
            out = num / den_c
        ctx.save_for_backward(q, k, v, scale, A, out, den_c, den_c > den)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        q, k, v, scale, A, out, den_c, clamped = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):  # backward may run inside an autocast region
            g = g.to(q.dtype)
            g_num = g / den_c
            g_den = (-(g * out).sum(-1, keepdim=True) / den_c).masked_fill_(clamped, 0.0)
            dq, dk, dv = causal_product_backward(q, k, v, g_num, g_den, ctx.chunk_size, scale, A)
            # key j enters as k_j exp(s_j) (the running maxima cancel): dL/ds_j = sum_r dL/dk_jr k_jr
            ds = (dk * k).sum(-1) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, ds, None, None


def causal_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Unnormalized causal linear attention sum_{j<=i} (q_i.k_j) v_j for (..., L, r/e) tensors
    (forward only; training goes through :func:`linear_attention`)."""
    lead, L = q.shape[:-2], q.shape[-2]
    q3, k3, v3 = (t.reshape(-1, L, t.shape[-1]) for t in (q, k, v))
    return causal_product_forward(q3, k3, v3, int(chunk_size))[0].reshape(*lead, L, v.shape[-1])


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     key_padding_mask: torch.Tensor | None = None, chunk_size: int | None = None,
                     eps: float | torch.Tensor | None = None,
                     k_log_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Linear attention with feature-mapped q, k (B, H, L, r) and v (B, H, L, d) -> (B, H, L, d).

    key_padding_mask: bool (B, L), True = padding (as in ``nn.MultiheadAttention``); padded
    keys and values are removed from the numerator and the normalizer.  Outputs at padded
    query positions are meaningless.  chunk_size: chunk length of the causal path (default
    128).  eps: lower clamp of the normalizer, a float or a tensor broadcastable to
    (B, H, L, 1) (default: smallest normal float).  k_log_scale (B, H, L, 1) or (B, H, L):
    key j's features are k[j] * exp(k_log_scale[j]) (see the module docstring).
    """
    out_dtype = v.dtype
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    B, H, L, _ = q.shape
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        s = None if k_log_scale is None else k_log_scale.to(dtype).reshape(B, H, L)
        if key_padding_mask is not None:
            pad = key_padding_mask.bool()[:, None, :]
            k = k.masked_fill(pad[..., None], 0.0)
            v = v.masked_fill(pad[..., None], 0.0)
            if s is not None:
                s = s.masked_fill(pad, torch.finfo(dtype).min)
        eps = torch.finfo(dtype).tiny if eps is None else eps
        if isinstance(eps, torch.Tensor):
            eps = eps.to(dtype)
        if causal:
            if isinstance(eps, torch.Tensor):
                eps = eps.expand(B, H, L, 1).reshape(B * H, L, 1)
            out = CausalLinearAttention.apply(q.reshape(B * H, L, -1), k.reshape(B * H, L, -1),
                                              v.reshape(B * H, L, -1), None if s is None else s.reshape(B * H, L),
                                              eps, int(chunk_size or DEFAULT_CHUNK_SIZE))
            out = out.view(B, H, L, -1)
        else:  # [S | Z] = K'^T [v, 1], the key scales applied to the narrow [v, 1] rows
            v1 = _with_ones(v)
            if s is not None:
                v1 = v1 * torch.exp(s - s.detach().amax(-1, keepdim=True)).unsqueeze(-1)
            nd = q @ (k.transpose(-1, -2) @ v1)                         # (B, H, L, r) @ (B, H, r, d + 1)
            num, den = nd[..., :-1], nd[..., -1:]
            den = torch.maximum(den, eps) if isinstance(eps, torch.Tensor) else den.clamp_min(eps)
            out = num / den
    return out.to(out_dtype)


def init_linear_state(batch: int, heads: int, r: int, d: int, device=None, dtype=torch.float32):
    """Empty recurrent state: S (B, H, r, d), Z (B, H, r) and the running key log-scale m (B, H, 1)."""
    return (torch.zeros(batch, heads, r, d, device=device, dtype=dtype),
            torch.zeros(batch, heads, r, device=device, dtype=dtype),
            torch.full((batch, heads, 1), torch.finfo(dtype).min, device=device, dtype=dtype))


def linear_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: tuple,
                          eps: float | torch.Tensor | None = None, k_log_scale: torch.Tensor | None = None):
    """Recurrent causal linear attention for one position.

    q, k: (B, H, r) feature-mapped; v: (B, H, d); state (S, Z, m) in float32 (or float64);
    k_log_scale (B, H, 1): the key's features are k exp(k_log_scale) (S and Z are kept in units
    of exp(m), m the running maximum, as the parallel path does).  Returns (out (B, H, d) in v's
    dtype, new state).  Cost and memory do not grow with position.
    """
    S, Z, m = state
    dtype = S.dtype
    with torch.autocast(q.device.type, enabled=False):
        qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
        if k_log_scale is not None:
            s = k_log_scale.to(dtype)
            new_m = torch.maximum(m, s)
            decay = torch.exp(m - new_m)
            S, Z, m = S * decay.unsqueeze(-1), Z * decay, new_m
            kf = kf * torch.exp(s - new_m)
        S = S + kf.unsqueeze(-1) * vf.unsqueeze(-2)
        Z = Z + kf
        num = (qf.unsqueeze(-2) @ S).squeeze(-2)
        den = (qf * Z).sum(-1, keepdim=True)
        eps = torch.finfo(dtype).tiny if eps is None else eps
        den = torch.maximum(den, eps.to(dtype)) if isinstance(eps, torch.Tensor) else den.clamp_min(eps)
        out = num / den
    return out.to(v.dtype), (S, Z, m)

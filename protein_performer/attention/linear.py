r"""Linear attention D^-1 (Q' (K'^T V)) on feature-mapped queries and keys.

Three paths, one signature (as flash-linear-attention's ops have it)::

    o, final_state = path(q, k, v, ..., initial_state=None, output_final_state=False)

* :func:`bidirectional_linear_attention`: S = K'^T V (r x d), Z = K'^T 1, out = Q'S / Q'Z (the
  model's FAVOR+ / FAVOR++ take fused_favor.py instead: the same product fused with the feature maps);
* :func:`chunk_linear_attention` (causal; :class:`CausalLinearAttention`; the model's FAVOR+ / FAVOR++
  run its :func:`causal_forward` / :func:`causal_backward` through fused_favor.py): the sequence is cut
  into chunks of C positions.  Inside a chunk the masked (Q'K'^T)V is a small dense product;
  across chunks the running state S = sum_j k'_j v_j^T, Z = sum_j k'_j is carried by a loop over
  chunks that works on all (batch x head) rows at once: each step touches C x r values per row,
  which stay in cache (a prefix sum over all chunks at once, as this module did before, streams
  every chunk state through memory and ran ~2x slower on CPU).  The backward recomputes the states
  instead of storing one per position ("Transformers are RNNs", Katharopoulos et al. 2020, eqs.
  8-10): with G the gradient of the unnormalized product,
      dQ_i = sum_{j<=i} (g_i . v_j) k_j      (a forward loop carrying S = sum k v^T)
      dK_j = sum_{i>=j} (v_j . g_i) q_i      (a reverse loop carrying R = sum q g^T)
      dV_j = sum_{i>=j} (q_i . k_j) g_i      (the same R)
  with the intra-chunk scores reused from the forward, so training memory per head is
  O(L (r + d + C) + r d), never O(L r d).  Both loops are sequential, so nothing from a later
  chunk can reach an earlier one (no 0 * inf of a masked scan);
* :func:`recurrent_linear_attention`: position by position from a state (decoding).

A state is ``(S (B, H, r, d), Z (B, H, r), m (B, H, 1))`` (:func:`init_linear_state`), S and Z in
units of exp(m).  ``initial_state`` stands for keys before the first position (causal) or extra
keys every query sees (bidirectional); ``final_state`` continues after the last one, so running
a sequence in pieces, each from the previous piece's final state, equals running it at once
(outputs and gradients: the chunked path back-propagates into ``initial_state`` and from
``final_state``; m is a gauge and gets no gradient).  :func:`linear_attention` is the
convenience front (``causal=...``, returns the output only).

Key scales (why exponential features cannot underflow)
-------------------------------------------------------
Exponential feature maps (FAVOR+, FAVOR++) hand over each key as ``k'_j exp(s_j)`` with
max_r k'_jr = 1 and the log-scale s_j (see feature_maps.py).  Attention is invariant to
one common factor on all keys a query sees, so

* bidirectional: every key is rescaled by exp(s_j - max_j s_j) (max over real keys and m);
* causal: query i sees keys j <= i through the running maximum M_i = max(m, max_{j<=i} s_j):
  out_i = sum_{j<=i} exp(s_j - M_i) (q'_i.k'_j) v_j / (same with v = 1).
  All factors exp(s_j - M_i) are <= 1 and the largest visible key has weight 1, so nothing
  overflows and the dominant terms never underflow; M_i uses positions <= i only, so past
  outputs do not depend on future keys.  The carried state is kept in units of the previous
  chunk's last M and rescaled when carried (online softmax's running-max trick: with a
  monotone M no factor ever exceeds 1).  The factors are per position, computed for the whole
  sequence in one pass over L (not L x r) and applied to the narrow side of each product
  (v, g, outputs: width d + 1) rather than to the r-wide features.

All state arithmetic runs in float32 with autocast disabled (float64 inputs stay float64);
the output is returned in V's dtype.  A non-finite value at a padded position is zeroed; one
at a future position never reaches past outputs (masks select, they do not multiply), nor past
gradients of a loss that does not depend on it (a zero output gradient contributes exactly zero).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: default chunk length of the causal path
DEFAULT_CHUNK_SIZE = 64

LinearState = tuple  # (S (B, H, r, d), Z (B, H, r), m (B, H, 1))

#: feature bytes (batch x heads x L x r x 4) one head group may hold: attention runs group by group
#: so that its L x r tensors are reused from the allocator's heap and stay near the cache (fresh
#: tensors of >= 32 MiB are mmapped and page-faulted on every call: measured ~3x slower per pass;
#: causal FAVOR+ fwd+bwd on this plain path, before fused_favor.py took FAVOR+ over, at head dim 32,
#: r = 256, L = 4096, 1 thread: 8 heads at once 0.378 s, groups of 4 heads (this value) 0.298 s, of 1 head 0.340 s)
GROUP_BYTES = 16 * 2 ** 20


def head_groups(batch: int, heads: int, length: int, r: int) -> int:
    """How many heads to run at once (>= 1) so that a group's features fit :data:`GROUP_BYTES`."""
    return max(1, min(heads, GROUP_BYTES // max(1, 4 * batch * length * r)))


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any of ``dtypes`` is, else float32: what the feature maps and the states compute in
    (decided in Python: ``torch.promote_types`` is an op the dispatcher counts, in every layer)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def with_ones(x: torch.Tensor) -> torch.Tensor:
    """[x, 1] along the last dim (the normalizer's column; width e + 1, not r)."""
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


def clamp_normalizer(den: torch.Tensor, eps) -> torch.Tensor:
    return torch.maximum(den, eps) if isinstance(eps, torch.Tensor) else den.clamp_min(eps)


def output_grad(g: torch.Tensor, out: torch.Tensor, den_c: torch.Tensor, clamped: torch.Tensor) -> torch.Tensor:
    """[g_num, g_den] (G, L, e + 1) for out = num / den_c: g / den_c and -(g . out) / den_c (0 where the
    normalizer was clamped); a zero gradient contributes zero even where the output is infinite (no 0 * inf)."""
    g_den = (-torch.where(g != 0, g * out, 0.0).sum(-1, keepdim=True) / den_c).masked_fill_(clamped, 0.0)
    return torch.cat([g / den_c, g_den], dim=-1)


class ChunkScales:
    """Per-position factors of the causal path for key log-scales s (G, L) and the state's m0 (G,).

    M_i = max(m0, max_{j<=i} s_j).  Chunk n's carried state is in units of m_prev[n] (the previous
    chunk's last M, m0 for the first) and leaves it in units of m_end[n]: query rows carry
    q = exp(m_prev - M), key rows k = exp(s - m_end), the state carry = exp(m_prev - m_end), and
    inside a chunk the scores carry decay[i, j] = exp(s_j - M_i) (j <= i); all <= 1."""

    def __init__(self, s: torch.Tensor, m0: torch.Tensor | None, C: int):
        G, L = s.shape
        self.s = s
        self.M = torch.cummax(s if m0 is None else torch.maximum(s, m0[:, None]), dim=1).values
        ends = torch.arange(C - 1, L + C - 1, C, device=s.device).clamp_max_(L - 1)
        m_end = self.M[:, ends]                                             # (G, N)
        m_prev = torch.cat([self.M[:, :1] if m0 is None else m0[:, None], m_end[:, :-1]], dim=1)
        per_pos = lambda x: x.repeat_interleave(C, dim=1)[:, :L]            # noqa: E731
        self.q = torch.exp(per_pos(m_prev) - self.M).unsqueeze(-1)          # (G, L, 1)
        self.k = torch.exp(s - per_pos(m_end)).unsqueeze(-1)
        self.carry = torch.exp(m_prev - m_end)[..., None, None]             # (G, N, 1, 1)
        self.m_final = m_end[:, -1]
        self._decay = {}

    def decay(self, a: int, b: int, upper: torch.Tensor) -> torch.Tensor:
        """The chunk's decay, formed once and kept (G x C per position): the backward reuses the forward's."""
        if a not in self._decay:
            self._decay[a] = (self.s[:, None, a:b] - self.M[:, a:b, None]).masked_fill_(upper, float("-inf")).exp_()
        return self._decay[a]


def _chunk_scores(x, y, sc, a, b, upper):
    """tril((x y^T) * decay) of one chunk, (G, c, c), masked by selection (0 * inf never happens)."""
    A = torch.bmm(x, y.transpose(1, 2))
    if sc is not None:
        A.mul_(sc.decay(a, b, upper))
    return A.masked_fill_(upper, 0.0)


def _carry(S: torch.Tensor, sc: ChunkScales | None, n: int) -> torch.Tensor:
    """S carried into chunk n's units, in place (the loops own their state: no copy per chunk)."""
    return S if sc is None else S.mul_(sc.carry[:, n])


def _chunk_buffer(x: torch.Tensor, C: int) -> torch.Tensor:
    """One chunk's worth of x's rows (G, C, width), contiguous: a product written into a slice of a
    (G, L, width) tensor runs one GEMM per row (and in-place ones too), into this buffer one batched
    GEMM; the copy into the slice costs less (4 heads, L = 4096, r = 256, 1 thread: the 64 chunks'
    dq products 14.9 ms into slices, 13.5 ms through the buffer)."""
    return x.new_empty(x.shape[0], min(C, x.shape[1]), x.shape[2])


def _spans(L: int, C: int):
    return [(n, a, min(a + C, L)) for n, a in enumerate(range(0, L, C))]


def causal_forward(q, k, v1, sc: ChunkScales | None, C: int, S: torch.Tensor):
    """[num, den] (G, L, e + 1) of the causal product for q, k (G, L, r), v1 = [v, 1] (G, L, e + 1)
    and the state S (G, r, e + 1) of earlier keys; returns them, the intra-chunk scores (a list of
    (G, c, c)) and the final state.  A chunk's products go through a contiguous buffer
    (:func:`_chunk_buffer`) into their slice of the output."""
    G, L, _ = q.shape
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu_(1)
    # a non-finite value must not meet the zeros of the mask in A @ v: set it aside and poison
    # the rows at and after it in its chunk instead (later chunks get it through the state)
    bad = ~torch.isfinite(v1.sum(-1))                                   # (G, L)
    v1_safe = v1.masked_fill(bad.unsqueeze(-1), 0.0)
    kv1 = v1 if sc is None else v1 * sc.k
    out, buf = torch.empty_like(v1), _chunk_buffer(v1, C)
    scores, S = [], S.clone()                                           # updated in place below
    for n, a, b in _spans(L, C):
        qc, kc = q[:, a:b], k[:, a:b]
        A = _chunk_scores(qc, kc, sc, a, b, upper[:b - a, :b - a])
        scores.append(A)
        o = torch.bmm(qc, S, out=buf[:, :b - a])
        if sc is not None:
            o.mul_(sc.q[:, a:b])
        out[:, a:b] = o.baddbmm_(A, v1_safe[:, a:b])
        S = _carry(S, sc, n).baddbmm_(kc.transpose(1, 2), kv1[:, a:b])
    N = len(scores)
    poison = F.pad(bad, (0, N * C - L)).view(G, N, C).cumsum(2).view(G, -1)[:, :L] > 0
    out[..., :-1].masked_fill_(poison.unsqueeze(-1), float("nan"))
    return out, scores, S


def causal_backward(q, k, v1, g1, scores, sc: ChunkScales | None, C: int, S0, dS_final, need_ds: bool = False,
                    on_dq=None, on_dk=None):
    """Gradients of causal_forward's [num, den] w.r.t. q, k, v, the initial state and (need_ds) the
    key log-scales (else None), given g1 = [g_num, g_den] (G, L, e + 1) and the final state's
    gradient (or None).  Key j enters as exp(s_j) k_j (x) [v_j, 1], so its scale may as well sit on
    [v_j, 1]: ds_j = dv1_j . [v_j, 1] with dv1 the gradient of the whole row [v_j, 1] (width e + 1,
    not a pass over the r-wide dk_j . k_j).  on_dq / on_dk (a, b, chunk): where each chunk's dq, dk
    (G, b - a, r) go (default: into L x r tensors; fused_favor.py takes them through the feature maps'
    backward while they are in cache; then dq / dk come back None)."""
    L, e = q.shape[1], v1.shape[-1] - 1
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu_(1)
    kv1 = v1 if sc is None else v1 * sc.k
    g1q = g1 if sc is None else g1 * sc.q
    dq = dk = None
    if on_dq is None:
        dq = torch.empty_like(q)
        on_dq = lambda a, b, x: dq[:, a:b].copy_(x)                     # noqa: E731
    if on_dk is None:
        dk = torch.empty_like(k)
        on_dk = lambda a, b, x: dk[:, a:b].copy_(x)                     # noqa: E731
    dv1 = torch.empty_like(v1)
    spans, Mx, S = _spans(L, C), [], S0.clone()                         # Mx: decay_ij (g1_i . v1_j)
    buf, nbuf = _chunk_buffer(q, C), _chunk_buffer(v1, C)
    for n, a, b in spans:
        kc = k[:, a:b]
        Mx.append(_chunk_scores(g1[:, a:b], v1[:, a:b], sc, a, b, upper[:b - a, :b - a]))
        on_dq(a, b, torch.bmm(Mx[-1], kc, out=buf[:, :b - a]).baddbmm_(g1q[:, a:b], S.transpose(1, 2)))
        S = _carry(S, sc, n).baddbmm_(kc.transpose(1, 2), kv1[:, a:b])
    R = torch.zeros_like(S0) if dS_final is None else dS_final.to(S0.dtype, copy=True)
    for n, a, b in reversed(spans):
        qc, kc = q[:, a:b], k[:, a:b]
        on_dk(a, b, torch.bmm(Mx[n].transpose(1, 2), qc, out=buf[:, :b - a]).baddbmm_(kv1[:, a:b], R.transpose(1, 2)))
        o = torch.bmm(kc, R, out=nbuf[:, :b - a])
        if sc is not None:
            o.mul_(sc.k[:, a:b])
        dv1[:, a:b] = o.baddbmm_(scores[n].transpose(1, 2), g1[:, a:b])
        R = _carry(R, sc, n).baddbmm_(qc.transpose(1, 2), g1q[:, a:b])
    ds = torch.linalg.vecdot(dv1, v1) if need_ds else None
    return dq, dk, dv1[..., :e], R, ds


class CausalLinearAttention(torch.autograd.Function):
    """out_i = num_i / max(den_i, eps), the causal linear attention above, with a backward that
    recomputes the states.  Inputs q, k (G, L, r), v (G, L, e), key log-scales (G, L) or None,
    eps a float or a (G, L, 1) tensor (a constant), the chunk length, and optionally the state
    of earlier keys: S0 = [S, Z] (G, r, e + 1) in units exp(m0), m0 (G,).  Returns the output
    (G, L, e), the final [S, Z] (G, r, e + 1) and its m (G,; not differentiable).  Saves q, k, v,
    s, the intra-chunk scores, the output and the normalizer: O(L (r + e + C)) per row."""

    @staticmethod
    def forward(ctx, q, k, v, scale, eps, chunk_size, S0=None, m0=None):
        G, L, r = q.shape
        C = max(1, min(int(chunk_size), L))
        with torch.autocast(q.device.type, enabled=False):
            S0_ = q.new_zeros(G, r, v.shape[-1] + 1) if S0 is None else S0
            sc = None if scale is None else ChunkScales(scale, m0, C)
            nd, scores, S = causal_forward(q, k, with_ones(v), sc, C, S0_)
            num, den = nd[..., :-1], nd[..., -1:]
            den_c = clamp_normalizer(den, eps)
            out = num / den_c
        if sc is not None:
            m = sc.m_final
        else:
            m = q.new_full((G,), torch.finfo(q.dtype).min) if m0 is None else m0.clone()
        ctx.mark_non_differentiable(m)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, scale, out, den_c, den_c > den, S0_, m0)
        ctx.chunk_size, ctx.scores, ctx.sc = C, scores, sc              # sc: the chunks' decays, reused
        return out, S, m

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, dS, _dm):
        q, k, v, scale, out, den_c, clamped, S0, m0 = ctx.saved_tensors
        scores = ctx.scores
        need = ctx.needs_input_grad + (False,) * 2                      # S0 and m0 may not be passed
        with torch.autocast(q.device.type, enabled=False):  # backward may run inside an autocast region
            g = torch.zeros_like(out) if g is None else g.to(q.dtype)
            sc = ctx.sc
            # key j enters as k_j exp(s_j) (the running maxima cancel): dL/ds_j = sum_r dL/dk_jr k_jr
            dq, dk, dv, dS0, ds = causal_backward(q, k, with_ones(v), output_grad(g, out, den_c, clamped), scores,
                                                  sc, ctx.chunk_size, S0, dS, need_ds=need[3])
            # S0 enters as S0 exp(m0)
            dm0 = (dS0 * S0).sum((1, 2)) if need[7] and scale is not None else None
        return dq, dk, dv, ds, None, None, dS0 if need[6] else None, dm0


# ----------------------------------------------------------------------------- public paths
def init_linear_state(batch: int, heads: int, r: int, d: int, device=None, dtype=torch.float32) -> LinearState:
    """Empty state: S (B, H, r, d), Z (B, H, r) and the running key log-scale m (B, H, 1)."""
    return (torch.zeros(batch, heads, r, d, device=device, dtype=dtype),
            torch.zeros(batch, heads, r, device=device, dtype=dtype),
            torch.full((batch, heads, 1), torch.finfo(dtype).min, device=device, dtype=dtype))


def prepare_inputs(q, k, v, k_log_scale, eps, key_padding_mask, initial_state):
    """Common input handling: compute dtype, key scales (B, H, L), padding, eps."""
    dtype = compute_dtype(q.dtype, k.dtype)
    if initial_state is not None:
        dtype = compute_dtype(dtype, initial_state[0].dtype)
    B, H, L, _ = q.shape
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
    return q, k, v, s, eps, dtype


def chunk_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           k_log_scale: torch.Tensor | None = None, eps: float | torch.Tensor | None = None,
                           key_padding_mask: torch.Tensor | None = None, chunk_size: int | None = None,
                           initial_state: LinearState | None = None, output_final_state: bool = False):
    """Causal linear attention, chunked: q, k (B, H, L, r) features, v (B, H, L, d) ->
    (out (B, H, L, d) in v's dtype, final state or None).  Arguments as :func:`linear_attention`;
    ``initial_state`` (S, Z, m) stands for the keys before position 0."""
    out_dtype = v.dtype
    B, H, L, r = q.shape
    d = v.shape[-1]
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, s, eps, dtype = prepare_inputs(q, k, v, k_log_scale, eps, key_padding_mask, initial_state)
        if isinstance(eps, torch.Tensor):
            eps = eps.expand(B, H, L, 1).reshape(B * H, L, 1)
        S0 = m0 = None
        if initial_state is not None:
            S, Z, m = initial_state
            S0 = torch.cat([S, Z.unsqueeze(-1)], dim=-1).to(dtype).reshape(B * H, r, d + 1)
            m0 = m.to(dtype).reshape(B * H)
        out, SZ, m = CausalLinearAttention.apply(
            q.reshape(B * H, L, r), k.reshape(B * H, L, r), v.reshape(B * H, L, d),
            None if s is None else s.reshape(B * H, L), eps, int(chunk_size or DEFAULT_CHUNK_SIZE), S0, m0)
        out = out.view(B, H, L, d).to(out_dtype)
    if not output_final_state:
        return out, None
    SZ = SZ.view(B, H, r, d + 1)
    return out, (SZ[..., :d], SZ[..., d], m.view(B, H, 1))


def bidirectional_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                   k_log_scale: torch.Tensor | None = None, eps: float | torch.Tensor | None = None,
                                   key_padding_mask: torch.Tensor | None = None,
                                   initial_state: LinearState | None = None, output_final_state: bool = False):
    """Every query sees every (real) key: q, k (B, H, L, r), v (B, H, L, d) -> (out, final state
    or None); ``initial_state`` holds extra keys every query sees, the final state all of them."""
    out_dtype = v.dtype
    d = v.shape[-1]
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, s, eps, dtype = prepare_inputs(q, k, v, k_log_scale, eps, key_padding_mask, initial_state)
        v1 = with_ones(v)                    # [S | Z] = K'^T [v, 1], the key scales on the narrow rows
        m = None if initial_state is None else initial_state[2].to(dtype)
        if s is not None:
            M = s.detach().amax(-1, keepdim=True)
            M = M if m is None else torch.maximum(M, m)
            v1 = v1 * torch.exp(s.unsqueeze(-1) - M.unsqueeze(-1))
        SZ = k.transpose(-1, -2) @ v1                                   # (B, H, r, d + 1)
        if initial_state is not None:
            S0 = torch.cat([initial_state[0], initial_state[1].unsqueeze(-1)], dim=-1).to(dtype)
            SZ = SZ + (S0 if s is None else S0 * torch.exp(m - M).unsqueeze(-1))
        if s is not None:
            m = M
        nd = q @ SZ
        out = (nd[..., :-1] / clamp_normalizer(nd[..., -1:], eps)).to(out_dtype)
    if not output_final_state:
        return out, None
    if m is None:
        m = torch.full((*q.shape[:2], 1), torch.finfo(dtype).min, device=q.device, dtype=dtype)
    return out, (SZ[..., :d], SZ[..., d], m)


def recurrent_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               k_log_scale: torch.Tensor | None = None, eps: float | torch.Tensor | None = None,
                               initial_state: LinearState | None = None, output_final_state: bool = False):
    """Causal linear attention position by position (decoding; plain autograd): q, k (B, H, T, r),
    v (B, H, T, d), k_log_scale (B, H, T, 1), eps a float or (B, H, T, 1) -> (out (B, H, T, d),
    final state or None).  Cost and memory per position do not grow with the position; the state
    is float32 (float64 inputs: float64)."""
    B, H, T, r = q.shape
    if initial_state is None:
        dtype = compute_dtype(q.dtype, k.dtype)
        initial_state = init_linear_state(B, H, r, v.shape[-1], q.device, dtype)
    S, Z, m = initial_state
    dtype = S.dtype
    eps = torch.finfo(dtype).tiny if eps is None else eps
    outs = []
    with torch.autocast(q.device.type, enabled=False):
        qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
        for t in range(T):
            kt = kf[:, :, t]
            if k_log_scale is not None:
                s = k_log_scale[:, :, t].to(dtype)
                new_m = torch.maximum(m, s)
                decay = torch.exp(m - new_m)
                S, Z, m = S * decay.unsqueeze(-1), Z * decay, new_m
                kt = kt * torch.exp(s - new_m)
            S = S + kt.unsqueeze(-1) * vf[:, :, t].unsqueeze(-2)
            Z = Z + kt
            num = (qf[:, :, t].unsqueeze(-2) @ S).squeeze(-2)
            den = (qf[:, :, t] * Z).sum(-1, keepdim=True)
            e = eps[:, :, t].to(dtype) if isinstance(eps, torch.Tensor) else eps
            outs.append(num / clamp_normalizer(den, e))
    out = torch.stack(outs, dim=2).to(v.dtype)
    return out, ((S, Z, m) if output_final_state else None)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     key_padding_mask: torch.Tensor | None = None, chunk_size: int | None = None,
                     eps: float | torch.Tensor | None = None,
                     k_log_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Linear attention with feature-mapped q, k (B, H, L, r) and v (B, H, L, d) -> (B, H, L, d).

    key_padding_mask: bool (B, L), True = padding (as in ``nn.MultiheadAttention``); padded
    keys and values are removed from the numerator and the normalizer.  Outputs at padded
    query positions are meaningless.  chunk_size: chunk length of the causal path (default
    64).  eps: lower clamp of the normalizer, a float or a tensor broadcastable to
    (B, H, L, 1) (default: smallest normal float).  k_log_scale (B, H, L, 1) or (B, H, L):
    key j's features are k[j] * exp(k_log_scale[j]) (see the module docstring).  The paths
    with states: :func:`chunk_linear_attention`, :func:`bidirectional_linear_attention`.
    """
    kw = dict(k_log_scale=k_log_scale, eps=eps, key_padding_mask=key_padding_mask)
    if causal:
        return chunk_linear_attention(q, k, v, chunk_size=chunk_size, **kw)[0]
    return bidirectional_linear_attention(q, k, v, **kw)[0]

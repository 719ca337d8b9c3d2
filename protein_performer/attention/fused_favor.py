r"""Attention through exponential random features (FAVOR+, FAVOR++), fused with the feature maps.

The plain path (feature_maps.py, then linear.py) forms the L x r query and key features, keeps them
for the backward and makes several passes over them (the map, its stabilizer, the products, and in
the backward du = g * f, dx = du W over the whole L x r gradient).  Here the features are formed
block by block while a block stays in cache, and their gradients never exist as L x r tensors.

Bidirectional (:class:`FusedFavorAttention`): a block of T positions at a time goes through the
whole chain, and the backward recomputes the features from the narrow inputs (width d) instead
of reading stored ones:

forward   keys:    u = [x, 1, -|x|^2] [W, b, c]^T, m_j = max_r u_j, f = exp(u - m);
                   [S | Z] += f^T ([v, 1] exp(m - M)), the running maximum M of the m_j (when it
                   grows, the state is rescaled by exp(M_old - M_new), as online softmax does);
          queries: q' = softmax_r(x W^T + b) (a per-query factor cancels), [num | den] = q' [S | Z].
backward  queries: dS += q'^T g1, dx = ((g1 [S | Z]^T) * q') W with g1 = [g / den, -(g . out) / den];
          keys:    du = (([v, 1] exp(m - M)) dS^T) * f, dx = du W - 2 c (sum_r du) x,
                   dv = (f dS) exp(m - M).

Causal (:class:`CausalFavorAttention`): the features are formed block by block and kept (the
chunked backward reads them twice), the product is linear.py's chunked one, and the backward
hands each chunk's dq', dk' (C x r, still in cache) straight to the feature maps' backward
(softmax's for queries, du = dk' * f for keys) and on through W, so only the d-wide dx is written.

The maxima m_j and M are common factors of a key's features and of every query's numerator and
normalizer, so treating them as constants gives the exact gradient (as in feature_maps.py).  The
same numbers as the plain path up to rounding (tests/test_attention.py); forward + backward in
0.82-0.93x its time causal, 0.84-0.87x bidirectional (r = 256, L = 2,048-4,096, 8 heads, head_dim
32 and 64; docs/attention_speed.md); the bidirectional backward keeps O(L d) per head instead of
O(L r).  All arithmetic is float32 (float64 stays float64) with autocast off; the output is
returned in v's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .feature_maps import augment, augmented_weight
from .linear import (DEFAULT_CHUNK_SIZE, ChunkScales, causal_backward, causal_forward, compute_dtype, output_grad,
                     with_ones)

#: bytes of one block's features (rows x T x r): T is chosen so that a block stays near the cache
#: (8 heads, r = 256, L = 8,192, 2 threads: 0.25 MiB blocks 1.0x the plain path's time, 1 MiB 0.83x,
#: 4 MiB 0.73-0.78x, 16 MiB 0.88x)
BLOCK_BYTES = 4 * 2 ** 20


#: bytes of one chunk's r-wide tiles (rows x C x r) in the causal path: with many rows (batch x heads)
#: the chunk is shortened until they fit, halving from the requested length down to 16 (r = 256, 2 threads,
#: paired, 11 reps: 8 x 8 heads x 1,024, 64 rows: chunk 32 0.84x chunk 64's time; 1 x 8 x 8,192, 8 rows:
#: chunk 64, which fits, 0.94x chunk 32's)
CHUNK_BYTES = 2 * 2 ** 20


def chunk_length(rows: int, r: int, C: int, itemsize: int = 4) -> int:
    """The causal path's chunk: C, halved (not below 16) while rows x C x r values exceed :data:`CHUNK_BYTES`."""
    while C > 16 and rows * C * r * itemsize > CHUNK_BYTES:
        C //= 2
    return C


def _blocks(L: int, T: int):
    return [(a, min(a + T, L)) for a in range(0, L, T)]


class FusedFavorAttention(torch.autograd.Function):
    """out = q' [S | Z] of raw queries and keys xq, xk (G, L, d) and values v (G, L, e); the exponent's
    parts w (r, d) or (G, r, d), b None, (r,) or (G, 1, r), c a float; valid (G, L) bool (False:
    a padded key) or None; eps the normalizer's clamp.  Blocks of :data:`BLOCK_BYTES` (the CPU's cache);
    :class:`WholeFavorAttention` is the one-block version.  Gradients for xq, xk and v."""

    @staticmethod
    def forward(ctx, xq, xk, v, w, b, c, valid, eps):
        G, L, _ = xq.shape
        T = max(16, BLOCK_BYTES // (xq.element_size() * G * w.shape[-2]))
        wq, wk = augmented_weight(w, b, 0.0), augmented_weight(w, b, c)
        v1 = torch.cat([v, torch.ones_like(v[..., :1])], -1)
        lowest = torch.finfo(xq.dtype).min
        if valid is not None:  # a padded key counts nowhere, whatever its values
            xk = xk.masked_fill(~valid.unsqueeze(-1), 0.0)
            v1 = v1.masked_fill(~valid.unsqueeze(-1), 0.0)
        SZ = xq.new_zeros(G, w.shape[-2], v1.shape[-1])
        M = xq.new_full((G, 1), lowest)
        m_all = xq.new_empty(G, L)
        for a, z in _blocks(L, T):
            u = torch.matmul(augment(xk[:, a:z], b, c), wk)
            m = u.amax(-1)
            m_all[:, a:z] = m if valid is None else m.masked_fill(~valid[:, a:z], lowest)
            M_new = torch.maximum(M, m_all[:, a:z].amax(-1, keepdim=True))
            SZ.mul_(torch.exp(M - M_new).unsqueeze(-1))
            M = M_new
            f = u.sub_(m.unsqueeze(-1)).exp_()
            SZ.baddbmm_(f.transpose(1, 2), v1[:, a:z] * torch.exp(m_all[:, a:z] - M).unsqueeze(-1))
        out, den = torch.empty_like(v), xq.new_empty(G, L, 1)
        for a, z in _blocks(L, T):
            nd = torch.bmm(torch.softmax(torch.matmul(augment(xq[:, a:z], b, 0.0), wq), -1), SZ)
            den[:, a:z] = nd[..., -1:]
            torch.div(nd[..., :-1], nd[..., -1:].clamp_min(eps), out=out[:, a:z])
        ctx.save_for_backward(xq, xk, v1, w, b, SZ, M, m_all, out, den, valid)
        ctx.c, ctx.eps, ctx.T = c, eps, T
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        xq, xk, v1, w, b, SZ, M, m_all, out, den, valid = ctx.saved_tensors
        with torch.autocast(xq.device.type, enabled=False):  # backward may run inside an autocast region
            return FusedFavorAttention._backward(ctx, g.to(xq.dtype), xq, xk, v1, w, b, SZ, M, m_all, out, den, valid)

    @staticmethod
    def _backward(ctx, g, xq, xk, v1, w, b, SZ, M, m_all, out, den, valid):
        c, T, L = ctx.c, ctx.T, xq.shape[1]
        wq, wk = augmented_weight(w, b, 0.0), augmented_weight(w, b, c)
        den_c = den.clamp_min(ctx.eps)
        g_den = (-(g * out).sum(-1, keepdim=True) / den_c).masked_fill_(den_c > den, 0.0)
        g1 = torch.cat([g / den_c, g_den], -1)
        dSZ, dxq = torch.zeros_like(SZ), torch.empty_like(xq)
        for a, z in _blocks(L, T):
            qf = torch.softmax(torch.matmul(augment(xq[:, a:z], b, 0.0), wq), -1)
            dSZ.baddbmm_(qf.transpose(1, 2), g1[:, a:z])
            dxq[:, a:z] = torch.matmul(torch.bmm(g1[:, a:z], SZ.transpose(1, 2)).mul_(qf), w)
        dxk, dv = torch.empty_like(xk), torch.empty_like(v1[..., :-1])
        for a, z in _blocks(L, T):
            x = xk[:, a:z]
            u = torch.matmul(augment(x, b, c), wk)
            f = u.sub_(u.amax(-1, keepdim=True)).exp_()        # the forward's f: m is the same row maximum
            scale = torch.exp(m_all[:, a:z] - M).unsqueeze(-1)
            if valid is not None:  # 0 for padded keys, even in a row of padding only
                scale = scale.masked_fill_(~valid[:, a:z, None], 0.0)
            du = torch.bmm(v1[:, a:z] * scale, dSZ.transpose(1, 2)).mul_(f)
            dx = torch.matmul(du, w)
            if c:
                dx.addcmul_(du.sum(-1, keepdim=True), x, value=-2 * c)
            dxk[:, a:z] = dx
            torch.mul(torch.bmm(f, dSZ[..., :-1]), scale, out=dv[:, a:z])
        if valid is not None:  # a row of padding only: dSZ may overflow (den clamped to eps) and inf x 0 is NaN
            dv.masked_fill_(~valid.unsqueeze(-1), 0.0)
        return dxq, dxk, dv, None, None, None, None, None


class WholeFavorAttention(torch.autograd.Function):
    """:class:`FusedFavorAttention` with the whole sequence as one block (a GPU: a fixed, small number of
    ops, no loop and no CPU cache budget).  Queries and keys come stacked, x (2G, L, d): queries then
    keys, as the layer's rotary makes them, so one product forms both sets of features and one forms
    both of their input gradients (docs/launches.md: three GEMMs fewer per layer than two of each).
    Other arguments as :class:`FusedFavorAttention`.

    Both use u = x w^T + b - c |x|^2; for a query the c term is a per-query factor that cancels (as its
    row maximum does), so it may be kept.  Query features exp(u - max_r u) (per row, unnormalized: the
    output does not change with a query's scale), key features exp(u - M) with M the maximum over the
    whole (L, r) slab: the same numbers as the blockwise path's exp(u - m_j) exp(m_j - M).  It keeps
    the features (L x r per head, as the plain path does) rather than recomputing them: on a GPU at
    protein lengths a step is bound by kernel launches, not memory; the blockwise CPU path recomputes."""

    @staticmethod
    def forward(ctx, x, v, w, b, c, valid, eps):
        G = v.shape[0]
        # (2G, d, r) and (2G, r, d): the one projection for queries and keys, as batched products take it
        wt, we = (w.transpose(-1, -2).expand(2 * G, -1, -1), w.expand(2 * G, -1, -1)) if w.dim() == 2 else \
            (w.transpose(-1, -2).repeat(2, 1, 1), w.repeat(2, 1, 1))
        v1 = F.pad(v, (0, 1), value=1.0)                                     # [v, 1]: the normalizer's column
        padded = None if valid is None else ~valid.unsqueeze(-1)            # (G, L, 1): negated once
        if padded is not None:  # a padded key counts nowhere, whatever its values
            x = x.masked_fill(F.pad(padded, (0, 0, 0, 0, G, 0)), 0.0)
            v1 = v1.masked_fill(padded, 0.0)
        u = torch.baddbmm((x * x).sum(-1, keepdim=True), x, wt, beta=-c) if c else torch.bmm(x, wt)
        if b is not None:
            u = u.add_(b.repeat(2, 1, 1) if b.dim() == 3 else b)
        uq, uk = u.split(G)
        if padded is not None:
            uk.masked_fill_(padded, torch.finfo(u.dtype).min)
        uq.sub_(uq.amax(-1, keepdim=True))
        uk.sub_(uk.amax((-2, -1), keepdim=True))
        feats = u.exp_()                                                      # [query features; key features]
        qf, f = feats.split(G)
        SZ = torch.bmm(f.transpose(1, 2), v1)
        nd = torch.bmm(qf, SZ)
        den = nd[..., -1:]
        den_c = den.clamp_min(eps)
        out = nd[..., :-1] / den_c
        ctx.save_for_backward(x, v1, we, feats, out, den_c, den_c > den, padded)
        ctx.c = c
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, v1, we, feats, out, den_c, clamped, padded = ctx.saved_tensors
        c, G = ctx.c, v1.shape[0]
        with torch.autocast(x.device.type, enabled=False):  # backward may run inside an autocast region
            g = g.to(x.dtype)
            g_den = (g * out).sum(-1, keepdim=True).neg_().masked_fill_(clamped, 0.0)
            g1 = torch.cat([g, g_den], -1).div_(den_c)            # dL/d[num | den]
            # [g1; [v, 1]; g1] (3G, L, e + 1), written once (a compiler fuses g1 into it); its first two thirds
            # against [q'; k'] give [dSZ; SZ] in one product (SZ recomputed, a (r, e + 1) tile per row: no
            # copy of it into a stack), its last two thirds against those the d[features] of keys
            # ([v, 1] dSZ^T) and queries (g1 SZ^T), also in one product
            A = torch.cat([g1, v1, g1])
            dS_S = torch.bmm(feats.transpose(1, 2), A[:2 * G])
            dfk_dfq = torch.bmm(A[G:], dS_S.transpose(1, 2))
            # du: both are exp(u - a constant); for queries the output does not change with their scale
            du = torch.cat([dfk_dfq[G:], dfk_dfq[:G]]).mul_(feats)
            du_sum = du.sum(-1, keepdim=True) if c else None       # beside du's product (one pass for both)
            dx = torch.bmm(du, we)
            if c:
                dx.addcmul_(du_sum, x, value=-2 * c)
            dv = torch.bmm(feats[G:], dS_S[:G, :, :-1])
            if padded is not None:  # 0 for padded keys, even in a row of padding only
                dv.masked_fill_(padded, 0.0)
        return dx, dv, None, None, None, None, None


class CausalFavorAttention(torch.autograd.Function):
    """Causal FAVOR+ / FAVOR++ of raw xq, xk (G, L, d), v (G, L, e): arguments as
    :class:`FusedFavorAttention`, and the chunk length C.  Saves the features (as the plain path
    does), the chunks' scores and decays (linear.py); gradients for xq, xk and v."""

    @staticmethod
    def forward(ctx, xq, xk, v, w, b, c, valid, eps, C):
        wq, wk = augmented_weight(w, b, 0.0), augmented_weight(w, b, c)
        if valid is not None:  # a padded key counts nowhere, whatever its values
            xk = xk.masked_fill(~valid.unsqueeze(-1), 0.0)
            v = v.masked_fill(~valid.unsqueeze(-1), 0.0)
        G, L, r = xq.shape[0], xq.shape[1], wq.shape[-1]
        T = max(16, BLOCK_BYTES // (xq.element_size() * G * r))
        qf, kf, s = xq.new_empty(G, L, r), xq.new_empty(G, L, r), xq.new_empty(G, L)
        for a, z in _blocks(L, T):
            torch.softmax(torch.matmul(augment(xq[:, a:z], b, 0.0), wq), -1, out=qf[:, a:z])
            u = torch.matmul(augment(xk[:, a:z], b, c), wk)
            torch.amax(u, -1, out=s[:, a:z])
            torch.exp(u.sub_(s[:, a:z].unsqueeze(-1)), out=kf[:, a:z])
        if valid is not None:
            kf.masked_fill_(~valid.unsqueeze(-1), 0.0)
            s = s.masked_fill(~valid, torch.finfo(s.dtype).min)
        C = max(1, min(chunk_length(G, r, int(C), xq.element_size()), L))
        S0 = xq.new_zeros(G, r, v.shape[-1] + 1)
        sc = ChunkScales(s, None, C)
        nd, scores, _ = causal_forward(qf, kf, with_ones(v), sc, C, S0)
        den = nd[..., -1:]
        den_c = den.clamp_min(eps)
        out = nd[..., :-1] / den_c
        ctx.save_for_backward(xk, v, w, qf, kf, s, out, den_c, den_c > den, valid)
        ctx.c, ctx.C, ctx.scores, ctx.sc = c, C, scores, sc
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        xk, v, w, qf, kf, s, out, den_c, clamped, valid = ctx.saved_tensors
        c, C = ctx.c, ctx.C
        with torch.autocast(xk.device.type, enabled=False):
            g = g.to(xk.dtype)
            dxq, dxk = qf.new_empty(*qf.shape[:2], w.shape[-1]), torch.empty_like(xk)

            def on_dq(a, z, x):  # x = dL/dq' of the chunk; q' = softmax_r(u), but the output does not
                # change with a query's scale, so x . q' = 0 and softmax's backward is du = x * q' (as above)
                dxq[:, a:z] = torch.matmul(x.mul_(qf[:, a:z]), w)

            def on_dk(a, z, x):  # x = dL/dk' of the chunk: f = exp(u - s), s a constant
                du = x.mul_(kf[:, a:z])
                dx = torch.matmul(du, w)
                if c:
                    dx.addcmul_(du.sum(-1, keepdim=True), xk[:, a:z], value=-2 * c)
                dxk[:, a:z] = dx

            S0 = qf.new_zeros(qf.shape[0], qf.shape[-1], v.shape[-1] + 1)
            _, _, dv, _, _ = causal_backward(qf, kf, with_ones(v), output_grad(g, out, den_c, clamped), ctx.scores,
                                             ctx.sc, C, S0, None, on_dq=on_dq, on_dk=on_dk)
            if valid is not None:
                dv = dv.masked_fill(~valid.unsqueeze(-1), 0.0)
        return dxq, dxk, dv, None, None, None, None, None, None


def fused_favor_attention(exponent, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor,
                          key_padding_mask: torch.Tensor | None = None, eps: float | None = None,
                          causal: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
                          one_block: bool = False) -> torch.Tensor:
    """Attention of raw (rotated) q, k (B, H, L, d) and v (B, H, L, e) through the exponential
    features whose exponent is ``exponent(dtype) -> (w, b, c)`` (FavorPlus.exponent); k None: q holds
    queries and keys stacked (2, B, H, L, d), as the layer's rotary makes them (no copy);
    key_padding_mask (B, L), True = padding; causal: chunks of ``chunk_size`` positions
    (:class:`CausalFavorAttention`); one_block: bidirectional in one block (no CPU cache budget).
    Returns (B, H, L, e) in v's dtype."""
    qk = torch.stack([q, k]) if k is not None and one_block and not causal else q
    B, H, L, d = qk.shape[-4:]
    G, out_dtype = B * H, v.dtype
    with torch.autocast(qk.device.type, enabled=False):
        dtype = compute_dtype(qk.dtype, v.dtype)
        w, b, c = exponent(dtype)
        if w.dim() == 3:  # per head (H, r, d), bias (H, 1, r): one copy per row of the batch
            w = w.expand(B, *w.shape).reshape(G, *w.shape[1:])
            b = b.expand(B, *b.shape).reshape(G, *b.shape[1:])
        valid = None if key_padding_mask is None else (~key_padding_mask.bool())[:, None].expand(B, H, L).reshape(G, L)
        rest = (w, b, c, valid, torch.finfo(dtype).tiny if eps is None else eps)
        v = v.to(dtype).reshape(G, L, v.shape[-1])
        if one_block and not causal:
            out = WholeFavorAttention.apply(qk.to(dtype).reshape(2 * G, L, d), v, *rest)
        else:
            if k is None:
                q, k = qk.unbind(0)
            args = (q.to(dtype).reshape(G, L, d), k.to(dtype).reshape(G, L, d), v, *rest)
            out = CausalFavorAttention.apply(*args, chunk_size) if causal else FusedFavorAttention.apply(*args)
    return out.view(B, H, L, -1).to(out_dtype)

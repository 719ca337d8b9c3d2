r"""Feature maps phi: R^d -> R^r for linear attention, one interface for every kernel.

``fm(x, is_query=True)`` takes raw (rotated) queries (B, H, L, d) and returns features
(B, H, L, r) in float32 (float64 stays float64); ``fm(x, is_query=False)`` returns
``KeyFeatures(features, log_scale)`` for keys, ready for
:func:`protein_performer.attention.linear_attention` (``log_scale`` None for maps whose
features need no rescaling).  ``stabilize=False`` returns the raw features (references).
Every map is computed with autocast
off: the exponentials and the states they feed must not be formed in bf16/fp16.

Kernels
-------
``FavorPlus`` (kernel "softmax")
    Positive random features of Choromanski et al. 2021 (Performer, FAVOR+):
    phi(x) = exp(w_i . x - |x|^2 / 2) / sqrt(m), x = q * d^(-1/4), so that
    E[phi(q).phi(k)] = exp(q.k / sqrt(d)).  Rows w_i are orthogonal random features
    (blocks of QR-orthogonalized Gaussian rows rescaled to chi_d norms) or iid Gaussian.
``FavorPlusPlus`` (kernel "favor++")
    Optimal positive random features (OPRF) of Likhosherstov et al. 2022, "Chefs' Random
    Tables": phi(x) = D exp(A |w|^2 + B w.x - |x|^2/2), B = sqrt(1 - 4A), D = (1-4A)^(d/4),
    with A = (1 - 2 rho - sqrt((2 rho + 1)^2 + 8 rho)) / 16 <= 0 minimizing the estimator's
    variance for rho = mean_{i,j} |x_i + y_j|^2 / d.  A <= 0 makes the features bounded.
    ``rho`` is a per-head buffer (an exponential moving average of the training batches'
    statistics, frozen in eval), so A never depends on the positions of the current
    sequence: the causal path stays causal and ``step`` matches ``forward``.
    rho = 0 gives A = 0, i.e. exactly FAVOR+.
``TrigFeatures`` (kernel "trig")
    phi(x) = exp(|x|^2/2) [sin(w.x), cos(w.x)] / sqrt(m) (r = 2m), the original random
    Fourier estimator of the softmax kernel.  Not positive: its normalizer can be near 0 or
    negative, which is why the Performer paper found it unstable.  Here the normalizer is
    floored (``TrigFeatures``), which bounds outputs by max|v| / 1e-6, and building it warns:
    training refuses it (TRIG_REFUSAL, measured in docs/fidelity.md); kept for the approximation study.
``ReluFeatures`` (kernel "relu")
    Generalized attention with f = ReLU: phi(x) = relu(W x) + 1e-3 (W orthogonal random
    features), or relu(x) + 1e-3 without a projection (r = d).  The 1e-3 is added to
    O(1)-scale features (no max-scaling happens before it), as in the Performer code.
``EluFeatures`` (kernel "elu")
    elu(x) + 1 of Katharopoulos et al. 2020 ("Transformers are RNNs"); r = d, no randomness.
``HedgehogFeatures`` (kernel "hedgehog")
    The learnable softmax mimic of Zhang et al. 2024 (Hedgehog, ICLR):
    phi(x) = [softmax(W x + b), softmax(-W x - b)] over the r/2 features, W, b per head and
    trained with the model (or distilled from exact attention, :func:`distill`).  Biased, not
    random: it trades the FAVOR estimators' variance, hopeless at realistic ||x + y||^2
    (docs/fidelity.md), for a fitted approximation; features lie in [0, 1], no stabilizer.

Stabilizer (why nothing underflows, why it is causal, and why there is no epsilon)
----------------------------------------------------------------------------------
Exponential features exp(u_r) overflow or underflow in float32 (normal range ~ +-87 nats),
so both sides are shifted by a constant *before* the exponential, never by an epsilon after:

* queries: softmax over the r features of that query's own exponent vector (the row maximum
  subtracted, then the row's sum divided out, in one fused pass).  A per-query constant
  multiplies that query's numerator and normalizer alike and cancels.
* keys: subtract the key's own row maximum s_j = max_r u_jr (u including -|x_j|^2/2) and
  hand it over with the features, ``KeyFeatures(exp(u_j - s_j), s_j)``.  The attention then applies the common
  factor a query can afford: bidirectional, exp(s_j - max_j s_j); causal, exp(s_j - M_i) with
  the running maximum M_i = max_{j<=i} s_j (linear.py; the chunked path rescales its states
  as online softmax does, the recurrent state carries M).  Every factor is <= 1, the largest
  visible key has weight 1, and M_i looks at positions <= i only.

  Measured against float64 (same module and projection, q and k coordinates N(0, s)):
  relative error <= 5e-6 for head_dim 32-128, s = 0.25-4, FAVOR+ and FAVOR++, causal and
  bidirectional.  The earlier data-independent bound (max_r |w_r|^2 / 2 for every key)
  wasted about head_dim / 2 nats: at head_dim 128 every key feature underflowed.

  performer-pytorch instead subtracts the maximum over *all* key positions (not causal:
  a later token changes earlier outputs) and then adds an epsilon of 1e-4 to every
  feature, which dominates small features and pulls attention toward a uniform average.
  We add nothing; the normalizer is clamped at the smallest normal float
  (``normalizer_eps``), which only matters if every visible key underflowed.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .linear import compute_dtype


#: the one default number of features per head (ModelConfig, Attention and every map read it); 64, not
#: 128, by measurement at equal training time: docs/long_proteins.md
NB_FEATURES = 64


class KeyFeatures(NamedTuple):
    """Key features of shape (B, H, L, r) and the per-key log-scale (B, H, L, 1) they were divided by."""
    features: torch.Tensor
    log_scale: torch.Tensor | None = None


def augment(x: torch.Tensor, b: torch.Tensor | None, c: float) -> torch.Tensor:
    """[x, 1 (if b), -|x|^2 (if c)]: with :func:`augmented_weight`, the exponent x W^T + b - c |x|^2 of
    the exponential features is one matmul (no separate passes for the bias and the norm term)."""
    cols = [x] + ([torch.ones_like(x[..., :1])] if b is not None else []) + (
        [-(x * x).sum(-1, keepdim=True)] if c else [])
    return torch.cat(cols, -1) if len(cols) > 1 else x


def augmented_weight(w: torch.Tensor, b: torch.Tensor | None, c: float) -> torch.Tensor:
    """[W, b, c]^T, (K, r) or (H, K, r) for w (r, d) or (H, r, d), b (r,) or (H, 1, r): :func:`augment`'s partner."""
    cols = [w] + ([b.transpose(-1, -2) if b.dim() > 1 else b[:, None]] if b is not None else []) + (
        [torch.full_like(w[..., :1], c)] if c else [])
    return (torch.cat(cols, -1) if len(cols) > 1 else w).transpose(-1, -2)


class _ExpFeatures(torch.autograd.Function):
    """Stabilized exponential features in one pass over L x r: f = exp(u - max_r u), m = max_r u, with
    u = x W^T + b - c |x|^2 (c = 0 for queries) formed by one matmul of [x, 1, -|x|^2] with [W, b, c]
    (no separate passes for the bias, the norm term and autograd's negation of it).  m is returned
    detached: it is a common factor of the row (queries: it cancels; keys: it is handed over as the
    log-scale and the attention multiplies it back), so treating it as a constant gives the exact
    gradient.  The backward is du = g f (one pass) and dx = du W - 2 c (sum_r du) x; it saves only
    f, which the attention saves anyway, and x.  Queries (``query=True``) may take any row factor,
    so they get softmax_r(u) = exp(u - m - log sum_r exp(u - m)): one fused pass over L x r instead
    of max, subtract and exp (matmul + map, 4 heads, L = 4096, r = 256, 1 thread: 12.8 -> 10.3 ms; the
    largest feature is >= 1/r, not 1); then only f is returned."""

    @staticmethod
    def forward(ctx, x, w, b, c, query=False):
        # x (..., d), w (r, d) or (H, r, d), b (r,) or (H, 1, r) or None, c a float
        u = torch.matmul(augment(x, b, c), augmented_weight(w, b, c))
        ctx.c = c
        if query:
            f = torch.softmax(u, -1)
            ctx.save_for_backward(x, f, w)
            return f
        m = u.amax(-1, keepdim=True)
        f = u.sub_(m).exp_()
        ctx.save_for_backward(x, f, w)
        ctx.mark_non_differentiable(m)
        return f, m

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, *_gm):
        x, f, w = ctx.saved_tensors
        du = g * f
        dx = torch.matmul(du, w)
        if ctx.c:
            dx.addcmul_(du.sum(-1, keepdim=True), x, value=-2 * ctx.c)
        return dx, None, None, None, None


def _exp_features(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, c: float = 0.0):
    """(exp(u - m), m) for u = x w^T + b - c |x|^2, m the row maximum (detached); see _ExpFeatures."""
    return _ExpFeatures.apply(x, w, b, c)


def _query_features(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """softmax_r(x w^T + b): query features up to a row factor, which cancels; see _ExpFeatures."""
    return _ExpFeatures.apply(x, w, b, 0.0, True)


def gaussian_random_matrix(nb_rows: int, nb_cols: int, generator: torch.Generator | None = None,
                           orthogonal: bool = True) -> torch.Tensor:
    """(nb_rows, nb_cols) projection with N(0, I) rows, drawn on CPU in float64.

    orthogonal=True: stacked blocks of nb_cols mutually orthogonal rows (QR of a Gaussian
    matrix, Haar-distributed via the sign fix), each row rescaled to the norm of an
    independent Gaussian vector (chi distribution), so every row is still marginally N(0, I).
    """
    if not orthogonal:
        return torch.randn(nb_rows, nb_cols, generator=generator, dtype=torch.float64)
    blocks = []
    for _ in range(math.ceil(nb_rows / nb_cols)):
        g = torch.randn(nb_cols, nb_cols, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(q.T)
    w = torch.cat(blocks, dim=0)[:nb_rows]
    norms = torch.randn(nb_rows, nb_cols, generator=generator, dtype=torch.float64).norm(dim=1)
    return w * norms[:, None]


class FeatureMap(nn.Module):
    """Base class. Subclasses define ``num_features`` and ``forward(x, is_query)``."""

    #: clamp for the normalizer q'.Z; None -> smallest normal float of the compute dtype
    normalizer_eps: float | None = None
    #: True if the map owns a random projection (``redraw`` does something)
    random: bool = False
    #: True if ``normalizer_floor`` returns a tensor (the decoding state then tracks it)
    has_normalizer_floor: bool = False
    #: True if the map has parameters per head (it must see all heads at once: no head groups)
    per_head: bool = False

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim

    @property
    def num_features(self) -> int:
        raise NotImplementedError

    def redraw(self, generator: torch.Generator) -> None:
        """Draw a new projection from ``generator`` (CPU); no-op for deterministic maps."""

    def normalizer_floor(self, k: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None = None):
        """Optional per-query lower clamp of the normalizer (tensor (B, H, L or 1, 1)); None = eps."""
        return None

    def forward(self, x: torch.Tensor, is_query: bool, stabilize: bool = True) -> torch.Tensor:
        raise NotImplementedError


class _Projected(FeatureMap):
    random = True

    def __init__(self, head_dim: int, nb_rows: int, orthogonal: bool = True,
                 generator: torch.Generator | None = None):
        super().__init__(head_dim)
        self.nb_rows, self.orthogonal = nb_rows, orthogonal
        self.register_buffer("projection", torch.zeros(nb_rows, head_dim))
        self.redraw(generator if generator is not None else torch.Generator().manual_seed(0))

    @torch.no_grad()
    def redraw(self, generator: torch.Generator) -> None:
        w = gaussian_random_matrix(self.nb_rows, self.head_dim, generator, self.orthogonal)
        self.projection.copy_(w.to(self.projection.dtype))

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.projection.to(x.dtype).T


class FavorPlus(_Projected):
    """FAVOR+ positive orthogonal random features for the softmax kernel."""

    def __init__(self, head_dim: int, nb_features: int = NB_FEATURES, orthogonal: bool = True,
                 generator: torch.Generator | None = None):
        super().__init__(head_dim, nb_features, orthogonal, generator)

    @property
    def num_features(self) -> int:
        return self.nb_rows

    def exponent(self, dtype: torch.dtype):
        """(w, b, c) of the features' exponent u = x w^T + b - c |x|^2 (keys; queries drop the c term,
        a per-query factor): the data scaling d^-1/4 folded into w, b None, c = d^-1/2 / 2."""
        return self.projection.to(dtype) * self.head_dim ** -0.25, None, 0.5 * self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, is_query: bool, stabilize: bool = True) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(compute_dtype(x.dtype))
            w, _, c = self.exponent(x.dtype)
            if not stabilize:
                return torch.exp(x @ w.T - c * (x * x).sum(-1, keepdim=True)) / math.sqrt(self.num_features)
            if is_query:  # per-query factors (|x|^2/2, the row's scale) cancel
                return _query_features(x, w)
            return KeyFeatures(*_exp_features(x, w, None, c))


def oprf_A(rho: torch.Tensor) -> torch.Tensor:
    """Variance-optimal A of the OPRF (Likhosherstov et al. 2022, Thm. 3.2) for rho = E|x+y|^2/d."""
    rho = rho.clamp_min(0)
    return (1 - 2 * rho - torch.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16


def oprf_rho(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head rho = mean over query/key pairs of the same sequence of |x_i + y_j|^2 / d.

    x, y: data-scaled queries/keys (B, H, L, d); mask: (B, L) True = padding.  Returns (H,).
    Per sequence, mean_{ij} |x_i + y_j|^2 = mean|x|^2 + mean|y|^2 + 2 mean(x).mean(y); sequences
    are weighted by their number of pairs."""
    d = x.shape[-1]
    if mask is None:
        w = x.new_ones(x.shape[0], 1, x.shape[2], 1)
    else:
        w = (~mask.bool()).to(x.dtype)[:, None, :, None]
    n = w.sum(dim=2)                                               # (B, 1, 1)
    nn_ = n.clamp_min(1)
    mx, my = (x * w).sum(2) / nn_, (y * w).sum(2) / nn_             # (B, H, d)
    sx = ((x * x) * w).sum(dim=(2, 3)) / nn_[..., 0]               # (B, H)
    sy = ((y * y) * w).sum(dim=(2, 3)) / nn_[..., 0]
    per_seq = sx + sy + 2 * (mx * my).sum(-1)                      # (B, H)
    pairs = (n[..., 0] ** 2)                                       # (B, 1)
    return (per_seq * pairs).sum(0) / pairs.sum(0).clamp_min(1) / d


class FavorPlusPlus(FavorPlus):
    """FAVOR++: optimal positive random features (OPRF), bounded and lower-variance than FAVOR+."""

    def __init__(self, head_dim: int, nb_features: int = NB_FEATURES, orthogonal: bool = True,
                 generator: torch.Generator | None = None, heads: int = 1, momentum: float = 0.05):
        super().__init__(head_dim, nb_features, orthogonal, generator)
        self.momentum, self.per_head = momentum, heads > 1
        self.register_buffer("rho", torch.zeros(heads))
        self.register_buffer("rho_updates", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update_rho(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """EMA update of rho from raw queries/keys (B, H, L, d); the first update sets it."""
        new = self._rho_of(q, k, mask)
        # weight max(momentum, 1/(n+1)) as a tensor op: no host-device sync
        m = (1.0 / (self.rho_updates + 1).to(self.rho.dtype)).clamp_min(self.momentum)
        self.rho.mul_(1 - m).add_(m * new)
        self.rho_updates.add_(1)

    @torch.no_grad()
    def set_rho(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Set rho from this data (raw queries/keys (B, H, L, d)) exactly."""
        self.rho.copy_(self._rho_of(q, k, mask))

    def _rho_of(self, q, k, mask) -> torch.Tensor:
        s = self.head_dim ** -0.25
        new = oprf_rho(q.double() * s, k.double() * s, mask)
        if self.rho.numel() == 1:
            new = new.mean()
        return new.to(self.rho.dtype).expand_as(self.rho)

    def _A(self, x: torch.Tensor) -> torch.Tensor:
        A = oprf_A(self.rho.to(x.dtype))
        return A.view(-1, 1, 1) if A.numel() > 1 else A.reshape(())  # broadcast over (B, H, L, r)

    def exponent(self, dtype: torch.dtype):
        """(w, b, c) of the exponent B w.x + A |w|^2 - |x d^-1/4|^2 / 2 = x wB^T + b - c |x|^2: wB (m, d) or
        (H, m, d), b = A |w|^2 (m,) or (H, 1, m), c = d^-1/2 / 2 (the constant D cancels)."""
        w = self.projection.to(dtype)
        A = self._A(w)                                                  # () or (H, 1, 1)
        wB = (torch.sqrt(1 - 4 * A) * self.head_dim ** -0.25) * w       # (m, d) or (H, m, d)
        return wB, A * (w * w).sum(-1), 0.5 * self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, is_query: bool, stabilize: bool = True) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(compute_dtype(x.dtype))
            wB, feat_bias, c = self.exponent(x.dtype)
            if not stabilize:
                A = self._A(x)
                u = torch.matmul(x, wB.transpose(-1, -2)).add_(feat_bias)   # B w.x + A |w|^2
                logD = 0.25 * self.head_dim * torch.log(1 - 4 * A)
                return torch.exp(u - c * (x * x).sum(-1, keepdim=True) + logD) / math.sqrt(self.num_features)
            if is_query:  # per-query factors (|x|^2/2, D, the row's scale) cancel
                return _query_features(x, wB, feat_bias)
            return KeyFeatures(*_exp_features(x, wB, feat_bias, c))


#: why training refuses trig (measured: docs/fidelity.md, "trig: non-positive normalizers")
TRIG_REFUSAL = ("model.attention.kernel=trig: refused for training: its normalizer q'.sum(k') is not positive "
                "(at logit std 1, 10-48 % of rows are <= 0 and floored, output errors ~1e4; docs/fidelity.md); "
                "use softmax, favor++, relu, elu or hedgehog")


class TrigFeatures(_Projected):
    """Random Fourier (sin/cos) features of the softmax kernel; r = nb_features (m = r/2 rows).

    The estimated normalizer q'.Z can be ~0 or negative (the estimator is unbiased but not
    positive).  ``normalizer_floor`` gives a per-query floor delta * U_i, where
    U_i = sum_{visible j} m exp(|k_j|^2/2) >= |q'_i . sum_j k'_j| bounds the normalizer's
    magnitude; clamping at it keeps |output| <= max|v| / delta (delta = 1e-6).
    """

    normalizer_eps = 1e-12
    floor = 1e-6
    has_normalizer_floor = True
    #: cap on |x|^2/2 in the keys' exp(|x|^2/2) factor (only reached at logits in the hundreds)
    max_log_scale = 40.0

    def __init__(self, head_dim: int, nb_features: int = NB_FEATURES, orthogonal: bool = True,
                 generator: torch.Generator | None = None):
        if nb_features % 2:
            raise ValueError(f"trig features need an even nb_features, got {nb_features}")
        super().__init__(head_dim, nb_features // 2, orthogonal, generator)

    @property
    def num_features(self) -> int:
        return 2 * self.nb_rows

    def forward(self, x: torch.Tensor, is_query: bool, stabilize: bool = True) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(compute_dtype(x.dtype)) * self.head_dim ** -0.25
            p = self._project(x)
            f = torch.cat([torch.sin(p), torch.cos(p)], dim=-1)
            log_scale = 0.5 * (x * x).sum(-1, keepdim=True)
            if not stabilize:
                return f * torch.exp(log_scale) / math.sqrt(self.nb_rows)
            if is_query:  # a per-query factor cancels exactly
                return f
            return KeyFeatures(f * torch.exp(log_scale.clamp_max(self.max_log_scale)))

    def normalizer_floor(self, k: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None = None):
        """delta * sum over visible keys of m exp(|k|^2/2), shape (B, H, L, 1) (causal) or (B, H, 1, 1)."""
        with torch.autocast(k.device.type, enabled=False):
            k = k.to(compute_dtype(k.dtype)) * self.head_dim ** -0.25
            scale = torch.exp((0.5 * (k * k).sum(-1, keepdim=True)).clamp_max(self.max_log_scale))
            if key_padding_mask is not None:
                scale = scale.masked_fill(key_padding_mask.bool()[:, None, :, None], 0.0)
            total = scale.cumsum(-2) if causal else scale.sum(-2, keepdim=True)
            return (self.floor * self.nb_rows) * total.clamp_min(torch.finfo(k.dtype).tiny)


class ReluFeatures(_Projected):
    """Generalized ReLU kernel: relu(W x) + eps (with a random projection) or relu(x) + eps."""

    eps = 1e-3

    def __init__(self, head_dim: int, nb_features: int = NB_FEATURES, orthogonal: bool = True,
                 generator: torch.Generator | None = None, projection: bool = True):
        self.use_projection = projection
        super().__init__(head_dim, nb_features if projection else 0, orthogonal, generator)
        self.random = projection

    @torch.no_grad()
    def redraw(self, generator: torch.Generator) -> None:
        if self.use_projection:
            super().redraw(generator)

    @property
    def num_features(self) -> int:
        return self.nb_rows if self.use_projection else self.head_dim

    def forward(self, x: torch.Tensor, is_query: bool, stabilize: bool = True) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(compute_dtype(x.dtype))
            if self.use_projection:
                u = x @ (self.projection.to(x.dtype) * self.head_dim ** -0.25).T
            else:
                u = x * self.head_dim ** -0.25
            f = u.clamp_min(0).add_(self.eps)
            return f if is_query or not stabilize else KeyFeatures(f)


class EluFeatures(FeatureMap):
    """elu(x) + 1 (linear transformer); r = head_dim."""

    @property
    def num_features(self) -> int:
        return self.head_dim

    def forward(self, x: torch.Tensor, is_query: bool, stabilize: bool = True) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            f = F.elu(x.to(compute_dtype(x.dtype))) + 1
            return f if is_query or not stabilize else KeyFeatures(f)


class HedgehogFeatures(FeatureMap):
    """Hedgehog: [softmax(W x + b), softmax(-W x - b)] with per-head learned W (d x r/2) and b."""

    per_head = True

    def __init__(self, head_dim: int, nb_features: int = NB_FEATURES, heads: int = 1,
                 generator: torch.Generator | None = None):
        if nb_features % 2:
            raise ValueError(f"hedgehog features need an even nb_features, got {nb_features}")
        super().__init__(head_dim)
        m = nb_features // 2
        g = generator if generator is not None else torch.Generator().manual_seed(0)
        # start near FAVOR+'s exponent w.x d^-1/4 (rows ~ N(0, I)), one draw per head
        w = torch.stack([gaussian_random_matrix(m, head_dim, g).T for _ in range(heads)]) * head_dim ** -0.25
        self.weight = nn.Parameter(w.float())                          # (H, d, m)
        self.bias = nn.Parameter(torch.zeros(heads, 1, m))

    @property
    def num_features(self) -> int:
        return 2 * self.bias.shape[-1]

    def forward(self, x: torch.Tensor, is_query: bool, stabilize: bool = True) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(compute_dtype(x.dtype))
            u = torch.matmul(x, self.weight.to(x.dtype)) + self.bias.to(x.dtype)
            f = torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], -1)
            return f if is_query or not stabilize else KeyFeatures(f)


def distill(fm: FeatureMap, batches, steps: int = 200, lr: float = 1e-2) -> list[float]:
    """Fit a learnable map's parameters to exact softmax attention (Hedgehog's distillation): minimize
    the cross-entropy of its attention rows against softmax(q k^T / sqrt(d)) on ``batches(step)`` ->
    (q, k) (B, H, L, d), with Adam.  Returns the losses (why: a trained model's layers can be fitted
    to the map before switching, and the fidelity benchmark fits the map to each data family)."""
    opt = torch.optim.Adam(fm.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        q, k = batches(step)
        with torch.no_grad():
            p = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
        a = fm(q, True) @ fm(k, False).features.transpose(-1, -2)
        loss = -(p * torch.log(a / a.sum(-1, keepdim=True))).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class Kernel(NamedTuple):
    """What the rest of the project knows about one attention kernel (the registry's entry)."""
    label: str                      # how docs and model cards name it
    build: Callable | None          # (head_dim, nb_features, orthogonal, generator, heads, relu_projection) -> map
    random: bool                    # draws a random projection (redrawn / seeded / exported as a buffer)
    approximates_softmax: bool      # an estimator of exp(q.k / sqrt(d)) (fidelity is measured against softmax)
    training_refusal: str | None = None  # why training with it is refused, or None


#: The one registry of attention kernels: config name -> entry. The config key "softmax" means FAVOR+
#: (positive orthogonal random features for the softmax kernel), kept for old configs and checkpoints.
REGISTRY: dict[str, Kernel] = {
    "softmax": Kernel("FAVOR+ (positive orthogonal random features for the softmax kernel)",
                      lambda d, r, o, g, h, rp: FavorPlus(d, r, o, g), random=True, approximates_softmax=True),
    "favor++": Kernel("FAVOR++ (optimal positive random features)",
                      lambda d, r, o, g, h, rp: FavorPlusPlus(d, r, o, g, heads=h), random=True,
                      approximates_softmax=True),
    "relu": Kernel("generalized ReLU kernel (Performer)",
                   lambda d, r, o, g, h, rp: ReluFeatures(d, r, o, g, projection=rp), random=True,
                   approximates_softmax=False),
    "trig": Kernel("trigonometric random features", lambda d, r, o, g, h, rp: TrigFeatures(d, r, o, g),
                   random=True, approximates_softmax=True,
                   training_refusal=TRIG_REFUSAL),
    "elu": Kernel("elu(x) + 1 (linear transformer)", lambda d, r, o, g, h, rp: EluFeatures(d), random=False,
                  approximates_softmax=False),
    "hedgehog": Kernel("Hedgehog (learned feature map that mimics softmax)",
                       lambda d, r, o, g, h, rp: HedgehogFeatures(d, r, h, g), random=False,
                       approximates_softmax=True),
    "exact": Kernel("exact softmax attention (baseline)", None, random=False, approximates_softmax=False),
}
KERNELS = tuple(REGISTRY)


def is_random(kernel: str, relu_projection: bool = True) -> bool:
    """Whether the kernel's map holds a random projection (ReLU only with ``relu_projection``)."""
    return REGISTRY[kernel].random and (kernel != "relu" or relu_projection)


def build_feature_map(kernel: str, head_dim: int, nb_features: int = NB_FEATURES, orthogonal: bool = True,
                      generator: torch.Generator | None = None, heads: int = 1,
                      relu_projection: bool = True) -> FeatureMap | None:
    """Feature map for a kernel name; None for "exact" (softmax attention through SDPA)."""
    if kernel not in REGISTRY:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    build = REGISTRY[kernel].build
    return None if build is None else build(head_dim, nb_features, orthogonal, generator, heads, relu_projection)

"""The attention module the model uses: projections, rotary, feature map, redraw, decoding.

``Attention(dim, heads, kernel=...)`` maps (B, L, dim) -> (B, L, dim).  The kernel is a
config choice ("softmax" = FAVOR+, "favor++", "relu", "trig", "elu", "hedgehog", "exact"); everything
else (projections, rotary embedding, recurrent decoding) is shared.  With ``local_heads`` = n, heads
0..n-1 attend exactly within a sliding window instead (local.py), the others through the kernel.

Redraw schedule
---------------
The random projection is a registered buffer (saved in checkpoints, so a reloaded model
gives identical outputs).  In training mode, every ``redraw_interval`` forward calls
(0/None = never) a new projection is drawn; never in eval mode.  Draw number n comes from
a CPU ``torch.Generator`` seeded with a hash of (seed, n), so every DDP rank draws the
same matrix without communication; ``run_seed`` (the run's ``seed``, model.attention.run_seed)
enters the hash too, so runs with different seeds get different projections (run_seed 0 keeps
the draws of earlier versions).  The counters (forward calls, redraws) are kept as the
module's extra state (``get_extra_state``), saved in checkpoints without device syncs.
Give each layer its own ``seed`` (e.g. the layer index) for independent projections.
"""
from __future__ import annotations

import hashlib
import warnings
from functools import partial

import torch
from torch import nn

from . import fla_backend
from .chunk_parallel import chunk_parallel_linear_attention
from .feature_maps import KERNELS, NB_FEATURES, FavorPlus, FavorPlusPlus, build_feature_map
from .fused_favor import fused_favor_attention
from .linear import (DEFAULT_CHUNK_SIZE, bidirectional_linear_attention, chunk_linear_attention, head_groups,
                     init_linear_state, recurrent_linear_attention)
from .local import local_attention, local_decode
from .masks import AttentionMasks
from .rotary import RotaryEmbedding
from .softmax import softmax_attention_sdpa


def projection_seed(seed: int, draw: int, run_seed: int = 0) -> int:
    """Deterministic 63-bit seed for draw number ``draw`` of layer ``seed`` in a run seeded ``run_seed``
    (same on every process and rank)."""
    run = f"{int(run_seed)}:" if run_seed else ""
    h = hashlib.sha256(f"protein-performer:{run}{int(seed)}:{int(draw)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def kernel_attention(feature_map, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     key_padding_mask: torch.Tensor | None = None, chunk_size: int | None = None,
                     backend: str = "torch") -> torch.Tensor:
    """Attention of raw (rotated) q, k (B, H, L, d) and v through a feature map (None = exact SDPA); k None:
    q holds queries and keys stacked (2, B, H, L, d), as :class:`Attention` rotates them (FAVOR+ in one
    block takes them so, without a copy).

    ``backend`` is how it runs (fla_backend.resolve_backend chooses it per device), not what it computes:

    * "torch" (the CPU): FAVOR+ / FAVOR++ fused with their feature maps block by block (fused_favor.py),
      other maps head group by head group, causal through linear.py's loop over chunks: CPU cache budgets;
    * "parallel" (a GPU without fla): the whole sequence at once, a number of ops that does not grow
      with L: causal through chunk_parallel.py, bidirectional FAVOR+ fused in one block;
    * "fla" (causal, CUDA): fla's chunk_simple_gla, all heads in one call (fla_backend.py).

    Inside ``torch.compile`` "torch" runs as "parallel": a fixed set of ops for the compiler to fuse, where
    the torch path's Python loops over blocks and chunks would unroll into a graph that grows with L."""
    if torch.compiler.is_compiling() and backend == "torch":
        backend = "parallel"  # a graph takes the whole-sequence ops (the torch path's loops would unroll)
    whole = backend != "torch"
    if isinstance(feature_map, FavorPlus) and not (causal and whole):
        return fused_favor_attention(feature_map.exponent, q, k, v, key_padding_mask, feature_map.normalizer_eps,
                                     causal, chunk_size or DEFAULT_CHUNK_SIZE, one_block=whole)
    if k is None:
        q, k = q.unbind(0)
    if feature_map is None:
        return softmax_attention_sdpa(q, k, v, causal, key_padding_mask)
    H = q.shape[1]
    g = H if (whole or feature_map.per_head) else head_groups(q.shape[0], H, q.shape[2], feature_map.num_features)
    if g < H:  # head group by head group (linear.head_groups: why); split's backward is one cat
        return torch.cat([kernel_attention(feature_map, *qkv, causal, key_padding_mask, chunk_size)
                          for qkv in zip(q.split(g, 1), k.split(g, 1), v.split(g, 1))], dim=1)
    qf, (kf, k_log_scale) = feature_map(q, is_query=True), feature_map(k, is_query=False)
    floor = feature_map.normalizer_floor(k, causal, key_padding_mask)
    kw = dict(k_log_scale=k_log_scale, key_padding_mask=key_padding_mask,
              eps=feature_map.normalizer_eps if floor is None else floor)
    if not causal:
        return bidirectional_linear_attention(qf, kf, v, **kw)[0]
    if backend == "fla":
        return fla_backend.fla_linear_attention(qf, kf, v, **kw)[0]
    path = chunk_parallel_linear_attention if backend == "parallel" else chunk_linear_attention
    return path(qf, kf, v, chunk_size=chunk_size, **kw)[0]


class Attention(nn.Module):
    """Multi-head self-attention with a configurable (linear or exact) kernel.

    Args:
        dim: model width.  heads: number of heads (head_dim = dim // heads unless given).
        kernel: "softmax" (FAVOR+ positive random features), "favor++" (OPRF), "relu",
            "trig", "elu" (elu+1, r = head_dim), "hedgehog" (learned softmax mimic) or "exact" (SDPA).
        nb_features: features r for softmax/favor++/relu/trig/hedgehog.
        chunk_size: chunk length of the causal linear path (FAVOR+ / FAVOR++: the longest; halved
            while batch x heads x chunk x r values exceed fused_favor.CHUNK_BYTES).
        redraw_interval: redraw the projection every this many training forward calls
            (0/None: never).
        causal: autoregressive masking.  dropout: attention-probability dropout for "exact",
            dropout on the per-head outputs for linear kernels.
        rotary: rotary position embedding on q, k (before the feature map).
        orthogonal: orthogonal (vs iid) random features.  seed: seeds the projection draws (the
            layer index); run_seed: the run's seed, mixed in (0: the layer seed alone).
        relu_projection: the "relu" kernel with (True) or without a random projection.
        backend: how the linear kernel runs (:func:`kernel_attention`): "auto" (the CPU: "torch"; CUDA:
            "fla" for causal models where the stack allows it, else "parallel"), "torch", "parallel" or
            "fla" (fla_backend.resolve_backend; resolved per device at the first forward, logged once).
        local_heads: the first this many heads attend exactly inside a sliding window of
            ``local_window`` positions (local.py: why); the others through ``kernel``.
    """

    def __init__(self, dim: int, heads: int, kernel: str = "softmax", nb_features: int = NB_FEATURES,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, redraw_interval: int | None = 1000,
                 causal: bool = False, dropout: float = 0.0, rotary: bool = True, orthogonal: bool = True,
                 seed: int = 0, head_dim: int | None = None, bias: bool = False,
                 relu_projection: bool = True, rotary_base: float = 10000.0, run_seed: int = 0,
                 backend: str = "auto", local_heads: int = 0, local_window: int = 128):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        if head_dim is None:
            if dim % heads:
                raise ValueError(f"dim={dim} is not divisible by heads={heads}")
            head_dim = dim // heads
        if not 0 <= local_heads < heads or local_window < 1:
            raise ValueError(f"local_heads={local_heads} must be in [0, heads={heads}) and local_window={local_window} >= 1")
        if kernel == "trig":
            warnings.warn("attention kernel 'trig' (random Fourier features) can give near-zero or negative "
                          "normalizers: outputs are floored, not right; unsafe for training", stacklevel=2)
        self.dim, self.heads, self.head_dim, self.kernel = dim, heads, head_dim, kernel
        self.causal, self.chunk_size, self.seed, self.run_seed = causal, chunk_size, seed, int(run_seed or 0)
        self.redraw_interval = redraw_interval or 0
        self.local_heads, self.local_window = int(local_heads), int(local_window)
        self.backend, self._resolved = backend, None       # _resolved: (device type, "torch" | "parallel" | "fla")
        inner = heads * head_dim
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=bias)
        self.to_out = nn.Linear(inner, dim)
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)
        self.rotary = RotaryEmbedding(head_dim, rotary_base) if rotary else None
        self.feature_map = build_feature_map(kernel, head_dim, nb_features, orthogonal,
                                             torch.Generator().manual_seed(projection_seed(seed, 0, self.run_seed)),
                                             heads=heads - self.local_heads, relu_projection=relu_projection)
        self.forward_calls = 0
        self.redraws = 0

    # -- checkpointed counters -----------------------------------------------------------
    def get_extra_state(self) -> dict:
        return {"forward_calls": self.forward_calls, "redraws": self.redraws}

    def set_extra_state(self, state: dict) -> None:
        self.forward_calls = int(state.get("forward_calls", 0))
        self.redraws = int(state.get("redraws", 0))

    @property
    def num_features(self) -> int | None:
        return None if self.feature_map is None else self.feature_map.num_features

    @torch.no_grad()
    def redraw_projection(self) -> None:
        """Draw the next projection (draw number redraws + 1) deterministically from the seed."""
        if self.feature_map is None or not self.feature_map.random:
            return
        self.redraws += 1
        seed = projection_seed(self.seed, self.redraws, self.run_seed)
        self.feature_map.redraw(torch.Generator().manual_seed(seed))

    def count_forward(self) -> None:
        """Count one training forward call and redraw when the schedule says so.  Eager forward calls do
        it themselves; a compiled model counts between steps instead (:func:`count_forwards`), as a
        Python counter inside the graph would be a guard that changes every step (a recompile each)."""
        if not self.training:
            return
        if self.redraw_interval and self.forward_calls > 0 and self.forward_calls % self.redraw_interval == 0:
            self.redraw_projection()
        self.forward_calls += 1

    def _backend(self, device: torch.device) -> str:
        """How the kernel runs on ``device`` ("torch", "parallel" or "fla"), resolved once per device type."""
        if self._resolved is None or self._resolved[0] != device.type:
            gated = isinstance(self.feature_map, FavorPlus)   # fla gets a per-position gate (the running max)
            resolved = (device.type, fla_backend.resolve_backend(self.backend, device, self.causal, gated))
            if torch.compiler.is_compiling():  # kept only outside a graph: state set while tracing is a
                return resolved[1]             # guard that fails on the next call (a recompile)
            self._resolved = resolved
        return self._resolved[1]

    # -- parallel forward ------------------------------------------------------------------
    def _rotated(self, x: torch.Tensor, offset: int = 0):
        """(qk (2, B, H, L, dh), v (B, H, L, dh)): queries and keys stacked and rotated together (one set of
        ops for both, and FAVOR+ takes them so)."""
        B, L, _ = x.shape
        qk, v = self.to_qkv(x).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).split([2, 1])
        return (qk if self.rotary is None else self.rotary(qk, offset)), v[0]

    def _qkv(self, x: torch.Tensor, offset: int = 0):
        """(q, k, v), each (B, H, L, dh), q and k rotated."""
        qk, v = self._rotated(x, offset)
        return (*qk.unbind(0), v)

    def _split(self, qk, v):
        """((qk, v) of the local heads, (qk, v) of the kernel heads): one split each (a slice per head set
        would cost a zero-filled gradient per slice in the backward)."""
        n = self.local_heads
        (qk_loc, qk_glob), (v_loc, v_glob) = qk.split([n, self.heads - n], dim=2), v.split([n, self.heads - n], dim=1)
        return (qk_loc, v_loc), (qk_glob, v_glob)

    def _merge(self, out: torch.Tensor) -> torch.Tensor:
        B, H, L, dh = out.shape
        return self.to_out(out.transpose(1, 2).reshape(B, L, H * dh))

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | AttentionMasks | None = None) -> torch.Tensor:
        """x (B, L, dim), key_padding_mask (B, L) bool True = padding, or the forward's shared
        :class:`~.masks.AttentionMasks` (the encoder builds one for all layers) -> (B, L, dim)."""
        if not torch.compiler.is_compiling():
            self.count_forward()
        qk, v = self._rotated(x)
        masks = AttentionMasks.of(key_padding_mask, x.shape[1])
        key_padding_mask = masks.key_padding_mask
        if not self.local_heads:
            return self._merge(self._global(qk, v, key_padding_mask, x.device))
        (qk_loc, v_loc), glob = self._split(qk, v)
        out = self._global(*glob, key_padding_mask, x.device)
        local = local_attention(*qk_loc.unbind(0), v_loc, self.local_window, self.causal, key_padding_mask,
                                bias=masks.local_bias(self.local_window, self.causal, self.local_heads, v_loc.dtype,
                                                      x.device))
        out = torch.cat([self.drop(local), out], dim=1)
        return self._merge(out)

    def _global(self, qk, v, key_padding_mask, device) -> torch.Tensor:
        """The heads that see the whole sequence (qk: queries and keys stacked): exact SDPA or the kernel."""
        if self.feature_map is None:
            return softmax_attention_sdpa(*qk.unbind(0), v, self.causal, key_padding_mask,
                                          self.dropout if self.training else 0.0)
        fm = self.feature_map
        out = self.drop(kernel_attention(fm, qk, None, v, self.causal, key_padding_mask, self.chunk_size,
                                         self._backend(device)))
        if self.training and isinstance(fm, FavorPlusPlus):
            fm.update_rho(qk[0].detach(), qk[1].detach(), key_padding_mask)  # used from the next call on
        return out

    # -- recurrent decoding ------------------------------------------------------------------
    def init_state(self, batch_size: int, device=None) -> dict:
        """Empty decoding state: position 0 and per-head (S, Z) in fp32 (or a KV cache for exact);
        the local heads' keys and values of the last local_window - 1 positions under "local"."""
        device = device if device is not None else self.to_qkv.weight.device
        H = self.heads - self.local_heads
        empty = torch.zeros(batch_size, self.local_heads, 0, self.head_dim, device=device, dtype=self.to_qkv.weight.dtype)
        local = {"local": (empty, empty.clone())} if self.local_heads else {}
        if self.feature_map is None:
            empty = empty.new_zeros(batch_size, H, 0, self.head_dim)
            return {"pos": 0, "k": empty, "v": empty.clone(), **local}
        dtype = torch.promote_types(self.to_qkv.weight.dtype, torch.float32)
        S, Z, m = init_linear_state(batch_size, H, self.feature_map.num_features, self.head_dim,
                                    device=device, dtype=dtype)
        state = {"pos": 0, "S": S, "Z": Z, "m": m, **local}
        if self.feature_map.has_normalizer_floor:
            state["floor"] = torch.zeros(batch_size, H, 1, device=device, dtype=dtype)
        return state

    def step(self, x_t: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """Causal decoding from a state: one token x_t (B, dim), or T tokens (B, T, dim) at once (a
        prompt: one chunked call) -> (out of the same shape, new state).

        Matches ``forward`` of a causal module at positions ``state["pos"]`` on; for linear
        kernels the cost per token and the state size do not grow with the position."""
        pos, one = int(state["pos"]), x_t.dim() == 2
        x = x_t.unsqueeze(1) if one else x_t
        T = x.shape[1]
        qk, v = self._rotated(x, offset=pos)                     # (2, B, H, T, dh), (B, H, T, dh)
        n, local = self.local_heads, None
        if n:
            (qk_loc, v_loc), (qk, v) = self._split(qk, v)
            local, local_cache = local_decode(*qk_loc.unbind(0), v_loc, self.local_window, state["local"])
        q, k = qk.unbind(0)
        if self.feature_map is None:
            K = torch.cat([state["k"], k], dim=2)
            V = torch.cat([state["v"], v], dim=2)
            out, new = softmax_attention_sdpa(q, K, V, causal=T > 1), {"pos": pos + T, "k": K, "v": V}
        else:
            fm = self.feature_map
            qf, (kf, k_log_scale) = fm(q, is_query=True), fm(k, is_query=False)
            new = {"pos": pos + T}
            eps = fm.normalizer_eps
            if "floor" in state:  # running sum of the per-key floor contributions
                eps = state["floor"].unsqueeze(2) + fm.normalizer_floor(k, True).to(state["floor"].dtype)
                new["floor"] = eps[:, :, -1]
            backend = self._backend(x.device)
            path = recurrent_linear_attention if T == 1 else (
                fla_backend.fla_linear_attention if backend == "fla" else
                partial(chunk_parallel_linear_attention if backend == "parallel" else chunk_linear_attention,
                        chunk_size=self.chunk_size))
            out, (new["S"], new["Z"], new["m"]) = path(qf, kf, v, k_log_scale=k_log_scale, eps=eps,
                                                       initial_state=(state["S"], state["Z"], state["m"]),
                                                       output_final_state=True)
        if n:
            out, new["local"] = torch.cat([local, out], dim=1), local_cache
        out = self._merge(out)
        return (out.squeeze(1) if one else out), new

    def extra_repr(self) -> str:
        return (f"kernel={self.kernel!r}, heads={self.heads}, head_dim={self.head_dim}, "
                f"nb_features={self.num_features}, causal={self.causal}, chunk_size={self.chunk_size}, "
                f"redraw_interval={self.redraw_interval}, seed={self.seed}"
                + (f", local_heads={self.local_heads}, local_window={self.local_window}" if self.local_heads else ""))


def count_forwards(model: nn.Module) -> None:
    """One training forward call of every :class:`Attention` in ``model``, counted (and redrawn on
    schedule) outside the graph: what a compiled model's step calls before its forward."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.count_forward()

r"""Causal linear attention through flash-linear-attention (``fla``, the ``gpu`` extra) on CUDA.

Why: on a GPU the chunked torch path (linear.py) is dozens of small kernels per layer; fla's
``chunk_simple_gla`` is the field's fused Triton kernel for the same recurrence, with float32
states and recomputation in the backward.  This module only maps the project's causal attention
onto fla's semantics; it adds no math, so its outputs are linear.py's (tests/test_fla_backend.py
holds it to fla's own naive references and to the float64 quadratic reference).

The mapping
-----------
fla computes S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale q_t S_t.  linear.py's causal output
is  out_i = sum_{j<=i} exp(s_j - M_i) (q'_i . k'_j) [v_j, 1] / (same, last column)  with the running
maximum M_i = max(m0, max_{j<=i} s_j) of the key log-scales s (feature_maps.py).  So, with

    k_t = k'_t exp(s_t - M_t)  (<= k'_t),   g_t = M_{t-1} - M_t  (<= 0),   v_t = [v_t, 1],

S_t = sum_{j<=t} exp(s_j - M_t) k'_j [v_j, 1]^T is linear.py's state in units of exp(M_t) (by
induction), and o_t = [num_t, den_t]: one call gives numerator and normalizer.  Maps without key
scales (elu+1, ReLU, hedgehog, trig) are the g = 0 case.  The first position of each sequence gets
g = 0; an initial state (units exp(m0)) is rescaled by exp(m0 - M_first) before the call, so no
gate ever holds the -3.4e38 of an empty state's m (fla sums gates inside a chunk: an infinite one
would turn its differences into NaN).  M is computed without gradient: the output does not depend
on it, so the gradient with M held fixed is the full one (as linear.py's backward has it).

Dtypes and sizes: bf16/fp16 values (autocast) run fla in that dtype (its states accumulate in
float32); anything else runs in float32 (fla has no float64 kernels).  Under fp16 the scale is a
power of two that keeps the normalizer (<= keys x features, as q', k' <= 1) below fp16's range.
The division by the clamped normalizer happens in float32.  Feature and value widths are padded with
zeros to multiples of 16 (Triton's smallest dot; fla's backward needs even widths in 16-bit).

Padding: a key_padding_mask packs the real tokens of each row into one sequence of a varlen call
(``cu_seqlens``), so no work is spent on padding; outputs at padded positions are 0.

Which backend runs: :func:`resolve_backend`, logged once per (backend, device type, choice, reason).
"auto": the torch path on a CPU (tuned for few cores); on CUDA the parallel path (chunk_parallel.py,
a fixed number of launches) for bidirectional models, and fla for causal ones when fla imports and
the stack is not refused, else the parallel path with one line saying why and what to install.
"torch" / "parallel": those paths anywhere.  "fla": causal on CUDA only, else a one-line
:class:`UserError` naming why and the fix.  The refused stack (:func:`fla_stack_problem`): a Hopper
GPU (compute capability 9.x) with 3.4.0 <= Triton < 3.7.1, where fla 0.6.0's gated backward
(``chunk_bwd_dqkwg`` with g, i.e. FAVOR+ / FAVOR++) raises ("incorrect results", fla #640) after
the forward ran; torch 2.10/2.11 pin Triton 3.6.0, 2.12.0 pins 3.7.0, 2.12.1+ pin >= 3.7.1.
Checked before any kernel compiles; tilelang (fla's other suggestion) refuses our 16-bit inputs
with float32 states, so it does not lift the refusal.
"""
from __future__ import annotations

import logging
import math
import os

import torch
import torch.nn.functional as F

from ..errors import UserError, first_line
from .linear import compute_dtype

log = logging.getLogger(__name__)

#: the config values of model.attention.backend (see :func:`resolve_backend`)
BACKENDS = ("auto", "torch", "parallel", "fla")
#: kernels whose keys carry log-scales, so the fla mapping passes a per-position gate g (FAVOR+, FAVOR++)
GATED_KERNELS = ("softmax", "favor++")
#: the fla release the mapping is tested against (the ``gpu`` extra pins it)
FLA_VERSION = "0.6.0"
#: widths are padded to a multiple of this (Triton's smallest tl.dot operand)
WIDTH_MULTIPLE = 16
#: fla 0.6.0's guard in fla/ops/common/chunk_o.py (chunk_bwd_dqkwg): gated backward on Hopper refused in [lo, hi)
REFUSED_TRITON = ("3.4.0", "3.7.1")
#: what lifts the refusal
STACK_FIX = "install torch>=2.12.1 (it pins Triton>=3.7.1)"
#: environment defaults set before fla is first imported (fla_op): autotune results cached on disk
CACHE_ENV = {"FLA_CACHE_RESULTS": "1", "TRITON_CACHE_AUTOTUNING": "1"}

_announced: set = set()


def fla_import_problem() -> str | None:
    """Why fla's chunk_simple_gla cannot be imported here (None when it can)."""
    try:
        fla_op()
    except Exception as e:  # ImportError, or triton failing to find a driver
        return f"flash-linear-attention does not import ({first_line(e)}); pip install 'protein-performer[gpu]'"
    return None


def fla_op():
    """fla's ``chunk_simple_gla`` (the op :func:`fla_linear_attention` calls by default).

    First-call cost: fla's kernels are Triton autotuners (up to 48 configurations each, every one
    compiled and timed on the first call of a shape key).  Before fla is first imported this sets
    the defaults of :data:`CACHE_ENV` (a value the user set is kept): ``FLA_CACHE_RESULTS=1`` (fla
    0.6.0's own switch, already its default) and ``TRITON_CACHE_AUTOTUNING=1`` (Triton's, for any
    autotuner fla declares without it), so the chosen configurations are written to Triton's cache
    (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``, beside the compiled kernels) and a later
    process on the same machine loads them instead of tuning again.  The cache directory is left to
    Triton: moving it would orphan the kernels already compiled there.  Autotuners read these
    variables when fla's modules are imported, so a process that imported fla earlier keeps its
    settings."""
    for key, value in CACHE_ENV.items():
        os.environ.setdefault(key, value)
    from fla.ops.simple_gla import chunk_simple_gla
    return chunk_simple_gla


def _triton_version() -> str | None:
    """The installed Triton's version (None without Triton); tests replace this."""
    try:
        import triton
    except Exception:  # noqa: BLE001 - no Triton, or one that fails to import: fla_import_problem says so
        return None
    return getattr(triton, "__version__", None)


def fla_stack_problem(device) -> str | None:
    """Why fla's gated backward would refuse this stack (None when it would not): fla 0.6.0 raises in
    ``chunk_bwd_dqkwg`` when g is given on a Hopper GPU with 3.4.0 <= Triton < 3.7.1 (its
    IS_NVIDIA_HOPPER: an NVIDIA GPU named "NVIDIA H..." or of compute capability 9.x; fla reads GPU 0,
    so GPU 0 is checked too).  Read from torch.cuda and :func:`_triton_version`, without compiling."""
    from packaging.version import InvalidVersion, Version
    device = torch.device(device)
    if device.type != "cuda" or getattr(torch.version, "hip", None):   # fla's guard is NVIDIA-only
        return None
    tv = _triton_version()
    try:
        if tv is None or not Version(REFUSED_TRITON[0]) <= Version(tv) < Version(REFUSED_TRITON[1]):
            return None
    except InvalidVersion:
        return None
    for index in dict.fromkeys((device.index or 0, 0)):
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        if major == 9 or "NVIDIA H" in name:
            return (f"fla {FLA_VERSION} refuses the gated backward (FAVOR+ / FAVOR++) with Triton {tv} on a "
                    f"Hopper GPU ({name}, compute capability {major}.{minor}; torch {torch.__version__}): "
                    f"Triton >= {REFUSED_TRITON[0]} and < {REFUSED_TRITON[1]} computes wrong gradients there "
                    "(fla #640)")
    return None


_PATHS = {"fla": "fla chunk_simple_gla", "torch": "the torch path", "parallel": "the parallel torch path"}


def resolve_backend(backend: str, device, causal: bool = True, gated: bool = True) -> str:
    """The linear-attention path for tensors on ``device``: "torch", "parallel" or "fla".

    ``causal``: the model's direction (fla has only the causal one here).  ``gated``: whether the
    kernel passes fla a per-position gate (:data:`GATED_KERNELS`; the Hopper refusal is about the
    gated backward only).  "fla" where it cannot run is a one-line :class:`UserError` with the fix;
    "auto" falls back and logs one line with the reason (once per backend, direction, device type,
    choice and reason)."""
    if backend not in BACKENDS:
        raise UserError(f"model.attention.backend={backend!r}: choose one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    level = logging.INFO
    if backend in ("torch", "parallel"):
        chosen, why = backend, "asked for"
    elif backend == "fla":
        if not causal:
            raise UserError("model.attention.backend=fla: fla has no bidirectional path here, "
                            "use backend=auto or parallel")
        if device.type != "cuda":
            raise UserError(f"model.attention.backend=fla needs a CUDA device (the model runs on {device}); "
                            "use backend=auto, torch or parallel")
        if (problem := fla_import_problem()) is not None:
            raise UserError(f"model.attention.backend=fla: {problem}")
        if gated and (problem := fla_stack_problem(device)) is not None:
            raise UserError(f"model.attention.backend=fla: {problem}; {STACK_FIX} or use backend=parallel")
        chosen, why = "fla", "asked for"
    elif device.type != "cuda":
        chosen, why = "torch", f"the model runs on {device}"
    elif not causal:
        chosen, why = "parallel", f"the model runs on {device}; fla has no bidirectional path here"
    elif (problem := fla_import_problem()) is not None:
        chosen, why = "parallel", problem
    elif gated and (problem := fla_stack_problem(device)) is not None:
        chosen, why, level = "parallel", f"{problem}; {STACK_FIX} to run fla", logging.WARNING
    else:
        chosen, why = "fla", f"the model runs on {device}"
    direction = "causal" if causal else "bidirectional"
    key = (backend, direction, device.type, chosen, why)
    if not torch.compiler.is_compiling() and key not in _announced:  # a log call inside a graph breaks it
        _announced.add(key)
        log.log(level, "%s linear attention: backend=%s runs %s (%s)", direction, backend, _PATHS[chosen], why)
    return chosen


def check_backend(backend: str, device, causal: bool = True, gated: bool = True) -> str:
    """:func:`resolve_backend` for a run's entry point, before any work: ``backend=fla`` on a stack
    that cannot run it fails here in one line; the choice it logs is not logged again when the
    model's layers resolve the same backend on the same device."""
    return resolve_backend(backend, device, causal, gated)


def training_device(accelerator) -> torch.device:
    """The device a Lightning run with ``trainer.accelerator`` trains on, as far as the backend
    choice goes: cuda:0 for "gpu" / "cuda" / "auto" when CUDA is available, "mps" for mps, else the CPU."""
    accelerator = str(accelerator or "auto").lower()
    if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        return torch.device("cuda", 0)
    if accelerator == "mps":
        return torch.device("mps")
    return torch.device("cpu")


def _pad_width(x: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(x, (0, width - x.shape[-1])) if width > x.shape[-1] else x


def _round_up(n: int) -> int:
    return max(WIDTH_MULTIPLE, math.ceil(n / WIDTH_MULTIPLE) * WIDTH_MULTIPLE)


def fla_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                         k_log_scale: torch.Tensor | None = None, eps: float | torch.Tensor | None = None,
                         key_padding_mask: torch.Tensor | None = None, initial_state=None,
                         output_final_state: bool = False, op=None):
    """Causal linear attention through fla: the arguments and results of
    :func:`~protein_performer.attention.linear.chunk_linear_attention` (q, k (B, H, L, r) features,
    v (B, H, L, d); state (S, Z, m)).  ``op``: a callable with ``chunk_simple_gla``'s signature
    (default: fla's); tests pass fla's naive references."""
    op = fla_op() if op is None else op
    B, H, L, r = q.shape
    d, out_dtype = v.shape[-1], v.dtype
    wdt = compute_dtype(q.dtype, k.dtype)   # scales, division
    run = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32     # what fla sees
    pad = None if key_padding_mask is None or not key_padding_mask.any() else key_padding_mask.bool()
    keep = None if pad is None else ~pad                                                 # (B, L)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(wdt), k.to(wdt), v.to(wdt)
        m0 = None if initial_state is None else initial_state[2].to(wdt).reshape(B, H)
        g = None
        if k_log_scale is not None:
            with torch.no_grad():
                s = k_log_scale.detach().to(wdt).reshape(B, H, L)
                if keep is not None:
                    s = s.masked_fill(pad[:, None, :], torch.finfo(wdt).min)
                M = torch.cummax(s if m0 is None else torch.maximum(s, m0[..., None]), dim=-1).values
                g = torch.cat([M[..., :1], M[..., :-1]], dim=-1) - M                   # M_{t-1} - M_t
                first = (torch.arange(L, device=q.device) == 0)[None].expand(B, L) if keep is None \
                    else keep & (keep.cumsum(1) == 1)                                    # (B, L)
                g = g.masked_fill(first[:, None, :], 0.0)
            s, Mk = k_log_scale.to(wdt).reshape(B, H, L), M
            if keep is not None:   # padded keys are packed out: a finite factor keeps their gradient 0, not 0 * inf
                s, Mk = s.masked_fill(pad[:, None, :], 0.0), M.masked_fill(pad[:, None, :], 0.0)
            k = k * torch.exp(s - Mk).unsqueeze(-1)
        Kp, Vp = _round_up(r), _round_up(d + 1)
        v1 = _pad_width(torch.cat([v, torch.ones_like(v[..., :1])], dim=-1), Vp)
        qp, kp = _pad_width(q, Kp), _pad_width(k, Kp)
        h0 = None
        if initial_state is not None:
            S, Z = initial_state[0].to(wdt), initial_state[1].to(wdt)
            h0 = torch.cat([S, Z.unsqueeze(-1)], dim=-1)                                 # (B, H, r, d + 1)
            if g is not None:   # into units of exp(M_first): g_first = 0 then (an empty row keeps m0)
                with torch.no_grad():
                    has = first.any(1)[:, None]                                          # (B, 1)
                    at = first.int().argmax(1)[:, None, None].expand(B, H, 1)            # first real position
                    M_first = torch.where(has, M.gather(-1, at)[..., 0], m0)
                h0 = h0 * torch.exp(m0 - M_first)[..., None, None]
            h0 = F.pad(h0, (0, Vp - d - 1, 0, Kp - r)).float()
        # fp16 only: 2^-n keeps the normalizer (<= L * r: features are <= 1) inside fp16's range
        scale = 1.0 if run != torch.float16 else 2.0 ** -max(0, math.ceil(math.log2(max(1, L * r) / 2 ** 14)))
        x = [t.transpose(1, 2).to(run) for t in (qp, kp, v1)]                            # (B, L, H, .)
        gt = None if g is None else g.transpose(1, 2).float()                            # (B, L, H)
        kw = dict(scale=scale, initial_state=h0, output_final_state=output_final_state)
        if keep is None:
            o, ht = op(*x, g=gt, **kw)
        else:   # varlen: the real tokens of row b are sequence b
            x = [t[keep].unsqueeze(0) for t in x]
            gt = None if gt is None else gt[keep].unsqueeze(0)
            cu = F.pad(keep.sum(1).cumsum(0), (1, 0))
            o, ht = op(*x, g=gt, cu_seqlens=cu, **kw)
            o = o.new_zeros(B, L, H, Vp).index_put((keep,), o[0])
        o = o.transpose(1, 2).to(wdt)                                                    # (B, H, L, Vp)
        num, den = o[..., :d], o[..., d:d + 1]
        eps = torch.finfo(wdt).tiny * scale if eps is None else eps
        if isinstance(eps, torch.Tensor):
            out = num / torch.maximum(den, eps.to(wdt) * scale)
        else:
            out = num / den.clamp_min(eps * scale)
        out = out.to(out_dtype)
    if not output_final_state:
        return out, None
    ht = ht.to(wdt)[..., :r, :d + 1]
    if g is not None:
        m = M[..., -1:]
    elif m0 is not None:
        m = m0[..., None]
    else:
        m = torch.full((B, H, 1), torch.finfo(wdt).min, device=q.device, dtype=wdt)
    return out, (ht[..., :d], ht[..., d], m)

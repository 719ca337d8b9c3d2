"""Compiled training steps: ``compile`` (auto | true | false) and ``compile_mode``.

Why: on a GPU a step of this small model is bound by kernel launches (docs/launches.md); the cure is
``torch.compile`` (the feature maps' element-wise work fused into a few kernels) and CUDA graphs
(``compile_mode=reduce-overhead``: a whole step replayed with one launch).  Both need one graph per
input shape: the model traces with no graph break and no host sync (tests/test_compile.py), the
batches come in a few static shapes (data.buckets, data/buckets.py), and the random-feature redraw
is counted between steps, outside the graph (:func:`~protein_performer.attention.layer.count_forwards`).

``compile=auto`` compiles on CUDA and stays eager on the CPU: a compiled CPU step is 1.2x eager
after warm-up (benchmarks/speed/training.py, docs/benchmarks_training.md), but each of the ~25 shapes of
a bundled-data run (training and validation buckets) compiles for tens of seconds, more than a
ten-minute run gains back.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..errors import UserError

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("auto", True, False)
#: torch.compile's modes (reduce-overhead: CUDA graphs on a GPU; on the CPU inductor's plain code)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def use_compile(setting, device: torch.device) -> bool:
    """Whether steps on ``device`` are compiled under ``compile=setting`` (auto: on CUDA only)."""
    if setting not in COMPILE_CHOICES:
        raise UserError(f"compile={setting}: compile is auto, true or false, not {setting!r}")
    return torch.device(device).type == "cuda" if setting == "auto" else bool(setting)


def check_compile_mode(mode) -> str:
    if mode not in COMPILE_MODES:
        raise UserError(f"compile_mode={mode!r}: choose one of {', '.join(COMPILE_MODES)}")
    return mode


def compile_model(model: nn.Module, device: torch.device, mode: str = "default", shapes: int = 8) -> nn.Module:
    """``model`` compiled in place (state_dict keys unchanged): the whole forward one graph
    (``fullgraph``), specialised to each input shape (``dynamic=False``), up to ``shapes`` shapes
    (the buckets, in training and in evaluation mode) before dynamo gives up recompiling."""
    from ..attention.layer import Attention
    device = torch.device(device)
    for m in model.modules():  # how each layer runs on this device, decided (and logged) outside the graph
        if isinstance(m, Attention):
            m._backend(device)
    if device.type == "cpu":  # dropout's random numbers from aten's generator: inductor's own per-element
        torch._inductor.config.fallback_random = True  # generator made a CPU step 1.5x slower (8 x 1,024)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, int(shapes))
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           4 * int(shapes))
    model.compile(fullgraph=True, dynamic=False, mode=None if mode == "default" else check_compile_mode(mode))
    return model


def plan_compile(cfg, device: torch.device):
    """``device`` when a run's steps compile there (``cfg.compile``), else None; ``data.buckets=auto``
    resolved in ``cfg`` to match (static shapes whenever steps are compiled) and ``cfg.compile`` to the
    choice, so that config.yaml says what ran."""
    compiled = use_compile(cfg.get("compile", "auto"), device)
    if cfg.data.get("buckets") == "auto":
        cfg.data.buckets = "auto" if compiled else None
    cfg.compile = compiled
    return torch.device(device) if compiled else None


def record_buckets(cfg, datamodule) -> None:
    """config.yaml records the bucket set in force (the data module resolved "auto"), not "auto"."""
    if "buckets" in cfg.data:
        cfg.data.buckets = getattr(datamodule, "buckets", None)


def compile_task(task, device: torch.device, mode: str, buckets) -> None:
    """The task's model compiled for ``device`` (:func:`compile_model`), one graph per bucket in
    training and in evaluation; the task then counts the redraw schedule between steps."""
    compile_model(task.model, device, mode, shapes=2 * len(buckets or []) + 2)
    task.compiled = True

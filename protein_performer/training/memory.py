"""The memory one training step needs, estimated from the config before the model is built: a
model too large for the machine (``model/size=650m`` on a 23 GB laptop: minutes a step, swapping)
is refused in one line instead of found out after the first step.

The estimate, in float32 (``trainer.precision=32-true``, the default; mixed precision needs less,
so it is then an upper bound):

- weights, their gradients and AdamW's two moments: ``16 x P`` bytes, ``P`` the parameters
  (counted exactly on PyTorch's meta device: no memory allocated);
- the activations the backward keeps: ``4 x depth x T x per_token`` bytes, ``T`` the tokens of a
  training batch (``data.max_tokens``; without a budget ``data.batch_size x data.max_len``), ``L``
  the crop length (``data.max_len``, or ``data.concat_len``, at most ``T``) and per layer and token

  ``per_token = 34 x dim`` (norms, q k v, the feed-forward's hidden states, residuals)
  ``+ 2 x nb_features x (heads - local_heads)`` (linear attention's q and k features)
  ``+ local_heads x min(2 x local_window, L)`` (local heads' scores)
  ``+ 3 x heads x L`` for exact attention (its L x L scores, L = the crop length).

The constants were measured: the peak resident memory of one step on a CPU over
``dim`` 128 and 256, Performer and exact attention, crops 512 and 2,048, was within 20 % of it
(tests/test_safety_edges.py holds the formula to a hand count). A run is refused when the estimate
is above :data:`REFUSE_ABOVE` times the machine's memory (the GPU's for a CUDA run, else the RAM),
and warned about above :data:`WARN_ABOVE`.
"""
from __future__ import annotations

import logging
import os

import torch

from ..errors import UserError
from ..model import ModelConfig, PerformerLM
from ..tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: refuse above this multiple of the machine's memory ("clearly above": the estimate is within ~20 %)
REFUSE_ABOVE = 1.25
#: warn above this share of it
WARN_ABOVE = 0.75


def size(n: int) -> str:
    """Bytes for a message: GB, or MB below a tenth of one."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def parameters(model: dict, causal: bool) -> int:
    """The model's parameter count, from a build on the meta device (exact; nothing allocated)."""
    vocab = Tokenizer(vocabulary=model.get("vocabulary", Tokenizer().vocabulary)).vocab_size
    config = ModelConfig.from_dict({k: v for k, v in model.items() if k != "name"}, vocab_size=vocab, causal=causal)
    with torch.device("meta"):
        return sum(p.numel() for p in PerformerLM(config).parameters())


def batch_tokens(data: dict) -> tuple[int, int]:
    """(tokens of a training batch, the crop length) from the data settings (a protein longer than
    ``max_tokens`` exceeds the budget alone: rare, left out)."""
    length = data.get("concat_len") if data.get("mode") == "concat" else data.get("max_len")
    budget = data.get("max_tokens")
    if budget:
        return int(budget), int(min(length or budget, budget))
    return int(data.get("batch_size") or 1) * int(length), int(length)


def step_bytes(model: dict, data: dict, causal: bool) -> dict:
    """The estimate (module docstring): parameters, bytes of weights + gradients + AdamW state, bytes
    of activations, tokens per batch, and their total."""
    p = parameters(model, causal)
    tokens, length = batch_tokens(data)
    a = model.get("attention") or {}
    heads, dim = int(model["heads"]), int(model["dim"])
    per_token = 34 * dim
    if a.get("kernel", "softmax") == "exact":
        per_token += 3 * heads * length
    else:
        local = int(a.get("local_heads", 0) or 0)
        per_token += 2 * int(a.get("nb_features", 0) or 0) * (heads - local)
        per_token += local * min(2 * int(a.get("local_window", 0) or 0), length)
    state, activations = 16 * p, 4 * int(model["depth"]) * tokens * per_token
    return {"parameters": p, "state": state, "activations": activations, "tokens": tokens,
            "total": state + activations}


def machine_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are) of the memory a run on ``device`` has: the GPU's, or the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"GPU memory ({torch.cuda.get_device_name(device)})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"


def check_memory(model: dict, data: dict, causal: bool, device: torch.device) -> dict:
    """Log the estimate (the run's first lines); refuse in one line when it is clearly above the
    machine's memory, warn when it is close. Returns the estimate."""
    e = step_bytes(model, data, causal)
    have, what = machine_memory(device)
    text = (f"a training step needs about {size(e['total'])}: {size(e['state'])} of weights, gradients and AdamW "
            f"state ({e['parameters']:,} parameters) and {size(e['activations'])} of activations ({e['tokens']:,} "
            f"tokens a batch); this machine has {size(have)} of {what}")
    if e["total"] > REFUSE_ABOVE * have:
        raise UserError(f"memory: {text}: lower data.max_tokens (or data.max_len, data.batch_size), model.dim or "
                        f"model.depth, or train on a larger machine")
    if e["total"] > WARN_ABOVE * have:
        log.warning("memory: %s: close to all of it (steps may swap or run out of memory)", text)
    else:
        log.info("memory: %s", text)
    return e

"""Where models run: one rule for every entry point (train, evaluate, embed, generate)."""
from __future__ import annotations

import torch

from .errors import UserError

#: what ``precision`` may say for inference (embed, score), and the dtype the model then runs in
#: (under autocast)
DTYPES = {"32": torch.float32, "fp32": torch.float32, "32-true": torch.float32,
          "bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16,
          "16": torch.float16, "fp16": torch.float16, "16-mixed": torch.float16}


def precision_dtype(precision: str | int) -> torch.dtype:
    """``precision`` (32, bf16, 16 and Lightning's spellings of them) -> the dtype to run in."""
    p = str(precision).lower()
    if p not in DTYPES:
        raise UserError(f"precision {precision!r}: expected 32, bf16 or 16")
    return DTYPES[p]


def resolve_device(device: str | None = "auto") -> torch.device:
    """'auto' (or None) -> CUDA when available, else CPU; asking for CUDA where there is none
    is a one-line error rather than a deep traceback."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device} requested but CUDA is not available")
    return torch.device(device)

"""Where models run: one rule for every entry point (train, evaluate, embed, generate)."""
from __future__ import annotations

import torch

from .errors import UserError


def resolve_device(device: str | None = "auto") -> torch.device:
    """'auto' (or None) -> CUDA when available, else CPU; asking for CUDA where there is none
    is a one-line error rather than a deep traceback."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device} requested but CUDA is not available")
    return torch.device(device)

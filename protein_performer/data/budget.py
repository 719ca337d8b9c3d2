"""The token budget's one notice: a protein longer than ``max_tokens`` forms a batch of its own that
exceeds the budget (a protein is never split), so a budget chosen to bound memory does not bound it.
Said once per run (per process and budget), where the batches are cut."""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

_said: set[tuple[str, int]] = set()  # (key, budget) already warned of in this process


def warn_over_budget(lengths: Sequence[int], max_tokens: int | None, key: str = "data.max_tokens") -> bool:
    """One log warning, the first time in this process for ``key`` and budget, when some of ``lengths``
    (tokens per protein as batched: bucketed where buckets are on) exceed ``max_tokens`` (None: no
    budget). Returns whether any does."""
    over = np.asarray(lengths, dtype=np.int64)
    over = over[over > max_tokens] if max_tokens is not None else over[:0]
    if not len(over):
        return False
    if (key, int(max_tokens)) not in _said:
        _said.add((key, int(max_tokens)))
        log.warning("%s=%d is smaller than %d protein%s (the longest: %d tokens): each forms a batch of its own "
                    "that exceeds the budget (a protein is never split); raise %s if memory allows", key,
                    max_tokens, len(over), "" if len(over) == 1 else "s", int(over.max()), key)
    return True

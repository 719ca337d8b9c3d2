"""Static length buckets: every batch padded to one of a few lengths, and to a fixed number of rows.

Why: a compiled step (``torch.compile``, CUDA graphs) is specialised to its input's shape; batches of
free lengths would compile (and capture) again and again.  With buckets a batch of proteins whose
longest has n tokens is padded to the smallest bucket >= n, and to ``max_tokens // bucket`` rows
(rows of padding only where the sampler had fewer proteins), so each bucket is one shape and
compiles once.  Padding never changes a result: padded keys are masked out of attention and padded
positions are never scored.

The default set has three lengths per octave, 4, 5 and 6 x 2^k from 64 on (64, 80, 96, 128, 160,
192, 256, 320, ...): a protein is padded by at most a third of its length, about 11 % of the tokens
on the bundled sample (multiples of 256 would pad 25 %, two lengths per octave 16 %).
"""
from __future__ import annotations

import bisect
import logging
from typing import Sequence

import numpy as np

from ..errors import UserError

log = logging.getLogger(__name__)

#: the shortest default bucket
SHORTEST = 64


def default_buckets(longest: int) -> list[int]:
    """4, 5 and 6 x 2^k from :data:`SHORTEST` on, up to the first one >= ``longest``."""
    out, e = [], 0
    while not out or out[-1] < longest:
        out += [b for b in (4 << e, 5 << e, 6 << e) if b >= SHORTEST]
        e += 1
    return out[:bisect.bisect_left(out, longest) + 1]


def check_buckets(buckets, longest: int | None = None, key: str = "data.buckets") -> list[int] | None:
    """``buckets`` as a sorted list of positive ints (None: no buckets; "auto": :func:`default_buckets`
    up to ``longest``); one line naming ``key`` for anything else."""
    if buckets is None:
        return None
    if isinstance(buckets, str):
        if buckets != "auto" or longest is None:
            raise UserError(f"{key}={buckets!r}: give a list of lengths, auto or null")
        return default_buckets(int(longest))
    try:
        out = sorted({int(b) for b in buckets})
    except (TypeError, ValueError):
        raise UserError(f"{key} must be a list of positive lengths, auto or null, got {buckets!r}") from None
    if not out or out[0] < 1:
        raise UserError(f"{key} must be a list of positive lengths, auto or null, got {buckets!r}")
    if longest is not None and out[-1] < longest:
        out.append(int(longest))  # the longest crop must fit in some bucket
    return out


def bucket_of(buckets: Sequence[int] | None, n: int) -> int:
    """The padded length of a batch whose longest item has ``n`` tokens (n itself without buckets or
    beyond the last bucket)."""
    if not buckets:
        return n
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def bucketed(buckets: Sequence[int] | None, lengths: np.ndarray) -> np.ndarray:
    """Each length's bucket (what the batch cutters budget with)."""
    if not buckets:
        return lengths
    b = np.asarray(buckets, dtype=np.int64)
    i = np.searchsorted(b, lengths)
    return np.where(i < len(b), b[np.minimum(i, len(b) - 1)], lengths)


def bucket_shape(buckets: Sequence[int] | None, longest: int, rows: int, max_tokens: int | None) -> tuple[int, int]:
    """(rows, length) of a padded batch: ``(max(rows, max_tokens // bucket), bucket)`` with buckets,
    ``(rows, longest)`` without."""
    if not buckets:
        return rows, longest
    length = bucket_of(buckets, longest)
    return (rows if max_tokens is None else max(rows, max_tokens // length, 1)), length


def padding_share(batch_lengths: Sequence[Sequence[int]], buckets: Sequence[int] | None, max_tokens: int | None) -> float:
    """Share of a set of batches' padded tokens that are padding (each batch a list of item lengths)."""
    real = padded = 0
    for lens in batch_lengths:
        rows, length = bucket_shape(buckets, int(max(lens)), len(lens), max_tokens)
        real += int(sum(lens))
        padded += rows * length
    return 1.0 - real / max(padded, 1)


def log_buckets(buckets: Sequence[int] | None) -> None:
    """The run's bucket set, in its first lines (config.yaml records it too)."""
    if buckets:
        log.info("length buckets (data.buckets): %s", ", ".join(map(str, buckets)))


def log_padding(sampler) -> None:
    """The epoch's padding with buckets against without (a TokenBudgetBatchSampler)."""
    share, plain = sampler.padding()
    log.info("padding: %.1f %% of this epoch's batch tokens with buckets (%.1f %% without)", 100 * share, 100 * plain)

"""Length-bucketed batches under a token budget, reproducible, DDP-disjoint, resumable.

Each epoch: shuffle all items with a generator seeded by (seed, epoch); cut the order into
pools of ``pool_size`` items; sort each pool by length and cut it greedily into batches
whose padded size (items x longest item) stays within ``max_tokens``; shuffle the batch
order. Rank ``r`` of ``R`` takes batches ``r, r+R, ...`` (training drops the last few
batches so all ranks take the same number of steps). ``state_dict`` / ``start`` resume an
epoch after the batches already consumed, so nothing is seen twice or skipped.

With ``buckets`` (buckets.py) a batch's padded size is items x the bucket of its longest item, so a
batch holds at most ``max_tokens // bucket`` items (the collator pads it to exactly that many rows).

Length curriculum (``crop_schedule``, a list of ``(step, crop_len)``): from training step
``s`` on, items are cropped to the ``crop_len`` of the last entry with ``step <= s`` and
batches are cut on those cropped lengths under the same token budget (longer crops, fewer
items). Batches are then lists of ``(index, crop_len)`` pairs, which ``CropDataset``
understands. The step of the epoch's first batch comes from ``step_fn`` (a Lightning data
module passes the trainer's ``global_step``, so a resumed run continues the curriculum) or,
without it, from the number of batches this sampler has yielded. Each phase of constant
crop length is cut like a whole epoch above (pools, sort, budget, shuffle) on the items
not yet used; a phase that ends mid-epoch returns its unused batches' items to the front
of the order. With a one-entry schedule ``[(0, L)]`` the batches are exactly those of the
plain sampler over ``min(lengths, L)``.
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import DistributedSampler

from ..errors import UserError
from .budget import warn_over_budget
from .buckets import bucketed, padding_share

#: padded tokens per batch (items x longest): the one default budget of every token-batched loop
#: (training on shards, evaluate, embed, score)
MAX_TOKENS = 16384


class TokenBudgetBatchSampler(DistributedSampler):
    """Yields lists of item indices. It subclasses ``DistributedSampler`` only so that
    Lightning leaves it in place under DDP instead of injecting its own sampler; it
    does its own rank splitting."""

    def __init__(self, lengths: np.ndarray, max_tokens: int, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, pool_size: int | None = None, drop_last: bool | None = None,
                 crop_schedule: Sequence[Sequence[int]] | None = None, step_fn: Callable[[], int] | None = None,
                 buckets: Sequence[int] | None = None, budget_key: str = "data.max_tokens"):
        lengths = np.asarray(lengths, dtype=np.int64)
        if max_tokens < 1:
            raise UserError(f"max_tokens must be positive, got {max_tokens}")
        if not 0 <= rank < num_replicas:
            raise UserError(f"rank {rank} out of range for {num_replicas} replicas")
        self.lengths, self.max_tokens, self.shuffle, self.seed = lengths, int(max_tokens), shuffle, seed
        self.num_replicas, self.rank = num_replicas, rank
        self.drop_last = shuffle if drop_last is None else drop_last  # equal steps per rank in training
        mean = float(lengths.mean()) if len(lengths) else 1.0
        self.pool_size = pool_size or max(1, int(100 * max_tokens / max(mean, 1.0)))
        self.epoch = 0
        self.start = 0  # batches of this rank to skip in the next epoch started (resume)
        self._cache: tuple | None = None
        self.crop_schedule = check_crop_schedule(crop_schedule)
        self.step_fn = step_fn  # () -> global step of the next batch; None: count the batches yielded
        self._yielded = 0
        self.buckets = list(buckets) if buckets else None  # batches cut on their bucket's length (buckets.py)
        warn_over_budget(bucketed(self.buckets, lengths), self.max_tokens, budget_key)  # once per run

    # --- length curriculum -------------------------------------------------------------
    def crop_at(self, step: int) -> int:
        """Crop length in force at training ``step`` (the last entry with entry step <= step)."""
        steps = [s for s, _ in self.crop_schedule]
        return self.crop_schedule[max(bisect.bisect_right(steps, step) - 1, 0)][1]

    def _next_change(self, step: int) -> int | None:
        return next((s for s, _ in self.crop_schedule if s > step), None)

    def current_step(self) -> int:
        """Global training step of the next batch: ``step_fn()`` or the batches yielded so far."""
        return int(self.step_fn()) if self.step_fn is not None else self._yielded

    def _first_step(self) -> int:
        """Step of the current epoch's first batch (a resumed epoch skips ``start`` batches)."""
        return max(self.current_step() - self.start, 0)

    # --- batches ---------------------------------------------------------------------
    def epoch_batches(self, epoch: int, first_step: int = 0) -> list[np.ndarray]:
        """All batches of ``epoch`` (every rank), in order. With a crop schedule each batch is
        an ``(items, 2)`` array of (index, crop_len) rows and ``first_step`` is the training
        step of the epoch's first batch."""
        if self.crop_schedule is not None:
            key = (epoch, first_step)
            if self._cache is None or self._cache[0] != key:
                self._cache = (key, self._scheduled_batches(epoch, first_step))
            return self._cache[1]
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        batches = []
        for a in range(0, n, self.pool_size):
            pool = order[a:a + self.pool_size]
            if self.shuffle:
                pool = pool[np.argsort(self.lengths[pool], kind="stable")]
            batches.extend(self._cut(pool))
        if self.shuffle:
            perm = rng.permutation(len(batches))
            batches = [batches[i] for i in perm]
        self._cache = (epoch, batches)
        return batches

    def _scheduled_batches(self, epoch: int, first_step: int) -> list[np.ndarray]:
        n, reps = len(self.lengths), self.num_replicas
        rng = np.random.default_rng([self.seed, epoch])
        remaining = rng.permutation(n) if self.shuffle else np.arange(n)
        out: list[np.ndarray] = []
        while len(remaining):
            step = first_step + len(out) // reps  # rank r takes global batches r, r+R, ...
            crop = self.crop_at(step)
            nxt = self._next_change(step)
            need = len(remaining) if nxt is None else (nxt - first_step) * reps - len(out)  # >= 1
            lengths = np.minimum(self.lengths, crop)
            batches, a = [], 0
            while a < len(remaining) and len(batches) < need:
                pool = remaining[a:a + self.pool_size]
                a += self.pool_size
                if self.shuffle:
                    pool = pool[np.argsort(lengths[pool], kind="stable")]
                batches.extend(self._cut(pool, lengths))
            if self.shuffle:
                perm = rng.permutation(len(batches))
                batches = [batches[i] for i in perm]
            out.extend(np.stack([b, np.full(len(b), crop)], axis=1) for b in batches[:need])
            remaining = np.concatenate(batches[need:] + [remaining[a:]])
        return out

    def _cut(self, pool: np.ndarray, lengths: np.ndarray | None = None) -> list[np.ndarray]:
        """Greedy cut of ``pool`` (in its order) into batches within the token budget (padded to their
        bucket's length, with buckets)."""
        lens = bucketed(self.buckets, (self.lengths if lengths is None else lengths)[pool]).tolist()
        out, i, m = [], 0, len(lens)
        budget = self.max_tokens
        if self.shuffle:  # sorted ascending: (count * last length) grows with the end, so bisect
            while i < m:
                j = bisect.bisect_right(range(i, m), budget, key=lambda k: (k - i + 1) * lens[k]) + i
                j = max(j, i + 1)
                out.append(pool[i:j])
                i = j
        else:  # evaluation keeps file order: extend while the padded size fits
            while i < m:
                j, longest = i + 1, lens[i]
                while j < m and (j - i + 1) * max(longest, lens[j]) <= budget:
                    longest = max(longest, lens[j])
                    j += 1
                out.append(pool[i:j])
                i = j
        return out

    def rank_batches(self, epoch: int, first_step: int = 0) -> list[np.ndarray]:
        b = self.epoch_batches(epoch, first_step)
        if self.drop_last and self.num_replicas > 1:
            b = b[: len(b) // self.num_replicas * self.num_replicas]
        return b[self.rank::self.num_replicas]

    # --- Sampler protocol ------------------------------------------------------------
    def __iter__(self) -> Iterator[list]:
        if self.crop_schedule is not None:
            first = self._first_step()
            start, self.start = self.start, 0
            for batch in self.rank_batches(self.epoch, first)[start:]:
                self._yielded += 1
                yield [(i, c) for i, c in batch.tolist()]
            return
        start, self.start = self.start, 0
        for batch in self.rank_batches(self.epoch)[start:]:
            yield batch.tolist()

    def __len__(self) -> int:
        if self.crop_schedule is not None:
            return len(self.rank_batches(self.epoch, self._first_step()))
        return len(self.rank_batches(self.epoch))

    def padding(self) -> tuple[float, float]:
        """Share of this epoch's padded tokens that are padding: (as batched, without buckets)."""
        batches = self.rank_batches(self.epoch, self._first_step() if self.crop_schedule is not None else 0)
        lens = [np.minimum(self.lengths[b[:, 0]], b[:, 1]) if b.ndim == 2 else self.lengths[b] for b in batches]
        return padding_share(lens, self.buckets, self.max_tokens), padding_share(lens, None, None)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def state_dict(self, consumed: int) -> dict:
        return {"epoch": self.epoch, "consumed": int(consumed), "seed": self.seed, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Resume ``state['epoch']`` after ``state['consumed']`` batches of this rank."""
        if state.get("num_replicas", self.num_replicas) != self.num_replicas or state.get("seed", self.seed) != self.seed:
            raise UserError(f"cannot resume mid-epoch: the checkpoint was written with seed {state.get('seed')} and "
                             f"{state.get('num_replicas')} ranks, this run has seed {self.seed} and "
                             f"{self.num_replicas} ranks")
        self.epoch, self.start = int(state["epoch"]), int(state["consumed"])


def check_crop_schedule(schedule: Sequence[Sequence[int]] | None) -> list[tuple[int, int]] | None:
    """Validate ``[[step, crop_len], ...]``: int pairs, first step 0, steps strictly increasing."""
    if schedule is None:
        return None
    try:
        out = [(int(s), int(c)) for s, c in schedule]
    except (TypeError, ValueError):
        raise UserError(f"crop_schedule must be a list of [step, crop_len] pairs, got {schedule!r}") from None
    steps = [s for s, _ in out]
    if not out or steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])) or min(c for _, c in out) < 1:
        raise UserError(f"crop_schedule must start at step 0 with strictly increasing steps and positive "
                         f"crop lengths, got {schedule!r}")
    return out


def token_budget_batches(lengths: Sequence[int], token_budget: int, max_batch: int | None = None,
                         buckets: Sequence[int] | None = None) -> list[list[int]]:
    """Indices grouped so that ``len(batch) * longest <= token_budget`` (padded tokens) and
    at most ``max_batch`` items, longest first so that an out-of-memory shows up at once;
    a protein longer than the budget forms a batch of its own; with ``buckets`` the longest is its
    bucket's length. (Inference: evaluation, embedding.)"""
    lengths = bucketed(buckets, np.asarray(lengths, dtype=np.int64)).tolist()
    warn_over_budget(lengths, token_budget, "max_tokens")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur, longest = [], [], 0
    for i in order:
        m = max(longest, lengths[i])
        if cur and (m * (len(cur) + 1) > token_budget or (max_batch is not None and len(cur) >= max_batch)):
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        longest = m
    if cur:
        batches.append(cur)
    return batches

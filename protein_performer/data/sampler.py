"""Length-bucketed batches under a token budget, reproducible, DDP-disjoint, resumable.

Each epoch: shuffle all items with a generator seeded by (seed, epoch); cut the order into
pools of ``pool_size`` items; sort each pool by length and cut it greedily into batches
whose padded size (items x longest item) stays within ``max_tokens``; shuffle the batch
order. Rank ``r`` of ``R`` takes batches ``r, r+R, ...`` (training drops the last few
batches so all ranks take the same number of steps). ``state_dict`` / ``start`` resume an
epoch after the batches already consumed, so nothing is seen twice or skipped.
"""
from __future__ import annotations

import bisect
from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import DistributedSampler


class TokenBudgetBatchSampler(DistributedSampler):
    """Yields lists of item indices. It subclasses ``DistributedSampler`` only so that
    Lightning leaves it in place under DDP instead of injecting its own sampler; it
    does its own rank splitting."""

    def __init__(self, lengths: np.ndarray, max_tokens: int, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, pool_size: int | None = None, drop_last: bool | None = None):
        lengths = np.asarray(lengths, dtype=np.int64)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for {num_replicas} replicas")
        self.lengths, self.max_tokens, self.shuffle, self.seed = lengths, int(max_tokens), shuffle, seed
        self.num_replicas, self.rank = num_replicas, rank
        self.drop_last = shuffle if drop_last is None else drop_last  # equal steps per rank in training
        mean = float(lengths.mean()) if len(lengths) else 1.0
        self.pool_size = pool_size or max(1, int(100 * max_tokens / max(mean, 1.0)))
        self.epoch = 0
        self.start = 0  # batches of this rank to skip in the next epoch started (resume)
        self._cache: tuple[int, list] | None = None

    # --- batches ---------------------------------------------------------------------
    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """All batches of ``epoch`` (every rank), in order."""
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

    def _cut(self, pool: np.ndarray) -> list[np.ndarray]:
        """Greedy cut of ``pool`` (in its order) into batches within the token budget."""
        lens = self.lengths[pool].tolist()
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

    def rank_batches(self, epoch: int) -> list[np.ndarray]:
        b = self.epoch_batches(epoch)
        if self.drop_last and self.num_replicas > 1:
            b = b[: len(b) // self.num_replicas * self.num_replicas]
        return b[self.rank::self.num_replicas]

    # --- Sampler protocol ------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        start, self.start = self.start, 0
        for batch in self.rank_batches(self.epoch)[start:]:
            yield batch.tolist()

    def __len__(self) -> int:
        return len(self.rank_batches(self.epoch))

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def state_dict(self, consumed: int) -> dict:
        return {"epoch": self.epoch, "consumed": int(consumed), "seed": self.seed, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Resume ``state['epoch']`` after ``state['consumed']`` batches of this rank."""
        if state.get("num_replicas", self.num_replicas) != self.num_replicas or state.get("seed", self.seed) != self.seed:
            raise ValueError(f"cannot resume mid-epoch: the checkpoint was written with seed {state.get('seed')} and "
                             f"{state.get('num_replicas')} ranks, this run has seed {self.seed} and "
                             f"{self.num_replicas} ranks")
        self.epoch, self.start = int(state["epoch"]), int(state["consumed"])


def token_budget_batches(lengths: Sequence[int], token_budget: int, max_batch: int | None = None) -> list[list[int]]:
    """Indices grouped so that ``len(batch) * longest <= token_budget`` (padded tokens) and
    at most ``max_batch`` items, longest first so that an out-of-memory shows up at once;
    a protein longer than the budget forms a batch of its own. (Inference: evaluation,
    embedding.)"""
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

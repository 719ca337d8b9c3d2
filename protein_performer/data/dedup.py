"""An insert-only set of 64-bit sequence hashes for exact de-duplication at TrEMBL scale.

A Python ``set`` of 250 million ints needs ~16 GB; this open-addressing table of
``uint64`` (load <= 0.5, vectorized linear probing) needs 8-16 bytes per sequence and
adds a whole block of hashes per call. The first occurrence of a hash (in call order,
then array order) is the one reported new, so the kept records never depend on timing.
"""
from __future__ import annotations

import numpy as np

EMPTY = np.uint64(0)


class HashSet:
    def __init__(self, capacity: int = 1 << 16):
        size = 1 << max(4, int(capacity - 1).bit_length())
        self.table = np.zeros(size, dtype=np.uint64)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def _grow(self, needed: int) -> None:
        size = len(self.table)
        while needed * 2 > size:
            size *= 2
        if size != len(self.table):
            old = self.table[self.table != EMPTY]
            self.table = np.zeros(size, dtype=np.uint64)
            self.count = 0
            self._insert(old)

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Insert ``keys``; return a bool array, True where the key was not seen before."""
        keys = np.asarray(keys, dtype=np.uint64).copy()
        keys[keys == EMPTY] = 1  # 0 marks an empty slot
        self._grow(self.count + len(keys))
        return self._insert(keys)

    def _insert(self, keys: np.ndarray) -> np.ndarray:
        mask = np.uint64(len(self.table) - 1)
        is_new = np.zeros(len(keys), dtype=bool)
        pending = np.arange(len(keys))
        slots = keys & mask
        while pending.size:
            k, s = keys[pending], slots[pending]
            t = self.table[s]
            dup = t == k
            empty = t == EMPTY
            cand = np.flatnonzero(empty)
            won = np.zeros(len(pending), dtype=bool)
            if cand.size:  # several new keys may want one slot: the earliest gets it
                uniq, first = np.unique(s[cand], return_index=True)
                winners = cand[first]
                self.table[uniq] = k[winners]
                won[winners] = True
                is_new[pending[winners]] = True
                self.count += len(winners)
            move = ~dup & ~empty  # slot taken by another key: probe the next one
            slots[pending[move]] = (s[move] + np.uint64(1)) & mask
            pending = pending[~dup & ~won]  # losers of a slot retry it (it may now hold their key)
        return is_new

"""Prepared token shards: what preparation writes and what datasets memory-map.

A prepared folder holds, per split, numbered shards of two arrays::

    <split>/NNNNN.tokens        uint8, each record's residues followed by <eos>
    <split>/NNNNN.offsets.npy   int64, n + 1 record boundaries into .tokens
    <split>/NNNNN.hashes.npy    uint64, sequence hashes (rebuilds the de-dup set on resume)

plus ``manifest.json`` (counts, histogram, source checksum, tokenizer version), which is
written last: a folder without it is an unfinished preparation.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .split import SPLITS
from ..errors import UserError

MANIFEST = "manifest.json"


class ShardWriter:
    """Appends records of one split to shard ``index``; ``close`` writes the offsets."""

    def __init__(self, root: Path, split: str, index: int):
        self.dir = Path(root) / split
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = f"{index:05d}"
        self.fh = open(self.dir / f"{self.name}.tokens", "wb")  # truncates a killed run's leftovers
        self.offsets = [np.zeros(1, dtype=np.int64)]
        self.hashes = []
        self.tokens = 0

    def append(self, tokens: np.ndarray, lengths_with_eos: np.ndarray, hashes: np.ndarray) -> None:
        if len(lengths_with_eos) == 0:
            return
        self.fh.write(memoryview(np.ascontiguousarray(tokens, dtype=np.uint8)))
        self.offsets.append(self.tokens + np.cumsum(lengths_with_eos, dtype=np.int64))
        self.hashes.append(np.asarray(hashes, dtype=np.uint64))
        self.tokens += int(lengths_with_eos.sum())

    def close(self) -> dict:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        offsets = np.concatenate(self.offsets)
        hashes = np.concatenate(self.hashes) if self.hashes else np.zeros(0, np.uint64)
        np.save(self.dir / f"{self.name}.offsets.npy", offsets)
        np.save(self.dir / f"{self.name}.hashes.npy", hashes)
        rel = f"{self.dir.name}/{self.name}"
        return {"tokens_file": f"{rel}.tokens", "offsets_file": f"{rel}.offsets.npy",
                "hashes_file": f"{rel}.hashes.npy", "records": len(offsets) - 1, "tokens": self.tokens}


class SplitShards:
    """All shards of one split, memory-mapped: record ``i`` is a uint8 view
    ``residues <eos>``; ``lengths`` are token counts including the eos."""

    def __init__(self, root: str | Path, shards: list[dict]):
        self.root = Path(root)
        self.shards = [s for s in shards if s["records"] > 0]
        self._tokens = [None] * len(self.shards)
        self._offsets = [np.load(self.root / s["offsets_file"], mmap_mode="r") for s in self.shards]
        counts = np.array([s["records"] for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(counts)))
        self.lengths = (np.concatenate([np.diff(o) for o in self._offsets]) if self.shards
                        else np.zeros(0, np.int64))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def tokens(self, j: int) -> np.ndarray:
        """Token stream of shard ``j`` (opened lazily, so forked workers map it themselves)."""
        if self._tokens[j] is None:
            path = self.root / self.shards[j]["tokens_file"]
            self._tokens[j] = (np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path)
                               else np.zeros(0, np.uint8))
        return self._tokens[j]

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(np.searchsorted(self.starts, i, side="right")) - 1
        k = i - int(self.starts[j])
        o = self._offsets[j]
        return self.tokens(j)[int(o[k]):int(o[k + 1])]

    def __getstate__(self):  # memmaps are reopened in the receiving process
        d = dict(self.__dict__)
        d["_tokens"] = [None] * len(self.shards)
        return d


class PreparedData:
    """A finished prepared folder: ``manifest`` plus ``split(name)`` shards."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{self.root}: no {MANIFEST}; the data is not prepared (or preparation "
                                    f"did not finish): run scripts/prepare_data.py")
        self.manifest = json.loads(path.read_text())

    def split(self, name: str) -> SplitShards:
        if name not in SPLITS:
            raise UserError(f"unknown split {name!r} (expected one of {SPLITS})")
        return SplitShards(self.root, self.manifest["splits"][name]["shards"])

    def aa_frequencies(self) -> np.ndarray:
        """Frequencies of every vocabulary id among training residues (specials 0)."""
        c = np.asarray(self.manifest["train_token_counts"], dtype=np.float64)
        return c / max(c.sum(), 1.0)

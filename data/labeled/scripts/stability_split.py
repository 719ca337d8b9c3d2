#!/usr/bin/env python
"""How TAPE stability's splits relate: why its validation split can choose what its test split punishes.

    python data/labeled/scripts/stability_split.py

Counts, for the validation and test sequences, those identical to a training sequence and those one
substitution away from one, and groups the test sequences into clusters linked by single substitutions (union-find over the
sequences that share all but one position).  The bundled files are ProteinBERT's copy of TAPE's
splits (data/labeled/README.md).  Prints a table; docs/downstream.md cites it.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import sys
from collections import Counter, defaultdict
from pathlib import Path

if __name__ == "__main__":  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[3])
from benchmarks import common  # noqa: E402

FILES = {s: common.ROOT / "data" / "labeled" / f"labeled_stability_tape_proteinbert.{s}.csv.gz"
         for s in ("train", "valid", "test")}


def read(path: Path) -> list[str]:
    with gzip.open(path, "rt", newline="") as f:
        return [row["seq"] for row in csv.DictReader(f)]


def masks(seq: str) -> list[str]:
    """The sequence with each position in turn replaced by '*': two sequences one substitution apart share one."""
    return [seq[:i] + "*" + seq[i + 1:] for i in range(len(seq))]


def by_mask(seqs: list[str]) -> dict[str, set[str]]:
    index = defaultdict(set)
    for q in seqs:
        for m in masks(q):
            index[m].add(q)
    return index


def near_training(seqs: list[str], train: set[str], index: dict[str, set[str]]) -> tuple[int, int]:
    """How many of ``seqs`` stand by the training sequences ``train`` (``index``: by_mask of them):
    (identical to one, one substitution from one and identical to none)."""
    same = sum(q in train for q in seqs)
    one = sum(q not in train and any(index.get(m) for m in masks(q)) for q in seqs)
    return same, one


def clusters(seqs: list[str]) -> Counter:
    """Sizes of the groups of ``seqs`` linked by chains of single substitutions."""
    parent = {q: q for q in seqs}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for group in by_mask(seqs).values():
        first, *rest = group
        for q in rest:
            parent[root(q)] = root(first)
    return Counter(root(q) for q in seqs)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    seqs = {s: read(p) for s, p in FILES.items()}
    train, index = set(seqs["train"]), by_mask(seqs["train"])
    rows = []
    for s in ("valid", "test"):
        same, one = near_training(seqs[s], train, index)
        sizes = sorted(clusters(seqs[s]).values(), reverse=True)
        rows.append([s, f"{len(seqs[s]):,}", f"{same:,}", f"{one:,} ({one / len(seqs[s]):.1%})", f"{len(sizes):,}",
                     f"{sizes[0]:,} to {sizes[-1]:,}"])
    print("\n".join(common.md_table(["split", "sequences", "identical to a training sequence",
                                     "one substitution from one", "clusters (single-substitution links)",
                                     "cluster sizes"], rows)))


if __name__ == "__main__":
    main()

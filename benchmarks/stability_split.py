#!/usr/bin/env python
"""How TAPE stability's splits relate: why its validation split can choose what its test split punishes.

    python benchmarks/stability_split.py

Counts, for the validation and test sequences, those one substitution away from a training sequence,
and groups the test sequences into clusters linked by single substitutions (union-find over the
sequences that share all but one position).  The bundled files are ProteinBERT's copy of TAPE's
splits (data/labeled/README.md).  Prints a table; docs/downstream.md cites it.
"""
from __future__ import annotations

import csv
import gzip
import sys
from collections import Counter, defaultdict
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
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


def neighbours_in(seqs: list[str], index: dict[str, set[str]]) -> int:
    """How many of ``seqs`` are one substitution from a sequence of ``index``."""
    return sum(any(index.get(m, set()) - {q} for m in masks(q)) for q in seqs)


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
    seqs = {s: read(p) for s, p in FILES.items()}
    train = by_mask(seqs["train"])
    rows = []
    for s in ("valid", "test"):
        near = neighbours_in(seqs[s], train)
        sizes = sorted(clusters(seqs[s]).values(), reverse=True)
        rows.append([s, f"{len(seqs[s]):,}", f"{near:,} ({near / len(seqs[s]):.1%})", f"{len(sizes):,}",
                     ", ".join(map(str, sizes[:5]))])
    print("\n".join(common.md_table(["split", "sequences", "one substitution from a training sequence",
                                     "clusters (single-substitution links)", "largest clusters"], rows)))


if __name__ == "__main__":
    main()

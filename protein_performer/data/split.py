"""The one train/validation/test split: from a hash of the record's accession, so the same
protein lands in the same split on every machine, run and worker count, in the in-memory
data module (data=sample) and in prepared shards (data=fasta, data=trembl) alike, and
whether its header reads ``sp|P12345|NAME`` or ``P12345``."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

from ..formats import accession

SPLITS = ("train", "valid", "test")


def split_codes(accessions: Sequence[bytes | str], valid_fraction: float, test_fraction: float = 0.0) -> np.ndarray:
    """Split of each accession (0 train, 1 valid, 2 test) from its xxh3-64 hash:
    u = hash / 2^64; valid if u < valid_fraction, test if below valid_fraction + test_fraction."""
    h = np.fromiter((xxhash.xxh3_64_intdigest(a.encode() if isinstance(a, str) else a) for a in accessions),
                    dtype=np.uint64, count=len(accessions))
    u = h.astype(np.float64) / 2.0**64
    codes = np.zeros(len(accessions), dtype=np.uint8)
    codes[u < valid_fraction + test_fraction] = 2
    codes[u < valid_fraction] = 1
    return codes


def split_of(record_id: str, valid_fraction: float, test_fraction: float = 0.0) -> str:
    """'train', 'valid' or 'test' for one record id (its accession decides)."""
    return SPLITS[int(split_codes([accession(record_id)], valid_fraction, test_fraction)[0])]

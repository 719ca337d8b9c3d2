"""Deterministic train/validation/test assignment from a hash of the record id, so the
same protein lands in the same split on every machine, run and worker count."""
from __future__ import annotations

import hashlib

SPLITS = ("train", "valid", "test")


def split_of(record_id: str, valid_fraction: float, test_fraction: float = 0.0) -> str:
    h = int.from_bytes(hashlib.blake2b(record_id.encode(), digest_size=8).digest(), "little")
    u = h / 2**64
    if u < valid_fraction:
        return "valid"
    if u < valid_fraction + test_fraction:
        return "test"
    return "train"

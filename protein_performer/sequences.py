"""Reading protein sequences for inference, one way for every command: FASTA, UniProt
.dat, CSV / TSV (gzipped or not), or in-memory sequences, tokenized, under one policy.

Invalid-record policy (:func:`read_sequences`), the same for every command:

- a record with no residues is skipped and counted (``empty``);
- a record with a residue outside the vocabulary is an error naming file, line, record
  and character, or with ``on_invalid="skip"`` skipped and counted (``invalid``);
- a record whose id was seen before with the same sequence is skipped and counted
  (``duplicate``); with a different sequence it is an error naming both lines, or with
  ``on_invalid="skip"`` skipped and counted as ``invalid``.

The first few skipped records of each kind are named in a warning; the rest are counted.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import UserError
from .formats import ParseError, check_source, read_records
from .tokenizer import InvalidSequenceError, Tokenizer

log = logging.getLogger(__name__)

#: skipped records named per kind before only counting
MAX_MESSAGES = 5
SKIP_KINDS = ("empty", "invalid", "duplicate")


@dataclass
class Entry:
    """One record to run: ``where`` is ``file:line`` (or ``<sequences>[i]``) for messages;
    ``tokens`` are ``<cls> residues <eos>`` ids."""

    id: str
    sequence: str
    tokens: np.ndarray
    where: str


def _raw(source: Any, format: str | None, stats: dict) -> Iterator[tuple[str, str, str]]:
    """(id, sequence, where) from a path or from in-memory sequences."""
    if isinstance(source, (str, Path)):
        check_source(source)  # a directory, empty or binary file: one line naming it
        for rec in read_records(source, format, skip_empty=True, stats=stats):
            yield rec.id, rec.sequence, f"{source}:{rec.line}"
        return
    if isinstance(source, dict):
        source = list(source.items())
    for n, s in enumerate(source):
        rid, seq = (str(n), s) if isinstance(s, str) else (str(s[0]), s[1])
        yield rid, seq, f"<sequences>[{n}]"


def read_sequences(source: Any, format: str | None = None, *, tokenizer: Tokenizer | None = None,
                   unknown: str = "error", on_invalid: str = "error", stats: dict | None = None,
                   warn: bool = True) -> Iterator[Entry]:
    """Tokenized records of a FASTA / UniProt .dat / CSV / TSV file (gzipped or not), a
    dict id -> sequence, or a list of sequences or (id, sequence) pairs, under the policy
    in this module's docstring. ``stats`` receives the counts of skipped records
    (``empty``, ``invalid``, ``duplicate``); ``warn=False`` names none of them (a second
    pass over the same input)."""
    if on_invalid not in ("error", "skip"):
        raise UserError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    tokenizer = tokenizer or Tokenizer(unknown=unknown)
    stats = {} if stats is None else stats
    for k in SKIP_KINDS:
        stats.setdefault(k, 0)
    shown = dict.fromkeys(SKIP_KINDS, 0)

    def skip(kind: str, message: str):
        stats[kind] += 1
        if warn and shown[kind] < MAX_MESSAGES:
            shown[kind] += 1
            log.warning("skipped (%s): %s", kind, message)

    seen: dict[str, tuple[str, int]] = {}  # id -> (where, hash of the cleaned sequence)
    for rid, seq, where in _raw(source, format, stats):
        cleaned = "".join(seq.split()).upper().removesuffix("*")
        if not cleaned:
            skip("empty", f"{where}: record {rid!r} has an empty sequence")
            continue
        h = hash(cleaned)
        if rid in seen:
            first, h0 = seen[rid]
            if h == h0:
                skip("duplicate", f"{where}: record {rid!r} repeats the id and sequence first seen at {first}")
                continue
            msg = f"{where}: record {rid!r} repeats the id first seen at {first} with a different sequence"
            if on_invalid == "error":
                raise ParseError(msg + " (rename one, or pass on_invalid=skip to skip it)")
            skip("invalid", msg)
            continue
        seen[rid] = (where, h)
        try:
            tokens = tokenizer.encode(seq, source=where, record=rid)
        except InvalidSequenceError as e:
            if on_invalid == "error":
                raise
            skip("invalid", str(e))
            continue
        yield Entry(rid, seq, tokens, where)


def check_max_records(value, key: str = "data.max_records") -> None:
    """Every command's "read only the first N records" setting, checked one way before any work
    (``itertools.islice`` would otherwise raise a ValueError mid-run for -1, or take 2.5 as a bug)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(f"{key}={value!r}: a positive number of records, or null for all")


def skipped_text(stats: dict) -> str:
    """'3 invalid, 1 empty' (or 'none') for messages."""
    return ", ".join(f"{stats[k]} {k}" for k in SKIP_KINDS if stats.get(k)) or "none"

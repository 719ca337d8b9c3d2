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

import csv
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import UserError
from .io import ParseError, _lines, check_source, read_records
from .tokenizer import InvalidSequenceError, Tokenizer

log = logging.getLogger(__name__)

CSV_SUFFIXES = (".csv", ".tsv")
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


def sequence_id(sequence: str) -> str:
    """Stable id for a sequence without a name (CSV files with only a ``seq`` column):
    the probe computes the same id to find the sequence's embedding."""
    seq = "".join(sequence.split()).upper()
    return "seq_" + hashlib.sha1(seq.encode()).hexdigest()[:16]


def is_csv(path: str | Path, format: str | None = None) -> bool:
    return format in ("csv", "tsv") or (format is None and str(path).lower().removesuffix(".gz").endswith(CSV_SUFFIXES))


def _csv_rows(path: str | Path, format: str | None) -> Iterator[tuple[str, str, str]]:
    """(id, sequence, where) from a CSV/TSV with a ``seq`` (or ``sequence``) column and
    optionally ``id``; without ids, :func:`sequence_id` names each sequence."""
    tsv = format == "tsv" or (format is None and str(path).lower().removesuffix(".gz").endswith(".tsv"))
    reader = csv.reader((line for _, line in _lines(path)), delimiter="\t" if tsv else ",", strict=True)
    try:
        header = [h.strip().lower() for h in next(reader, [])]
        seq_col = next((header.index(c) for c in ("seq", "sequence") if c in header), None)
        if seq_col is None:
            raise ParseError(f"{path}:1: CSV header {header[:8]} has no 'seq' or 'sequence' column")
        id_col = header.index("id") if "id" in header else None
        for row in reader:
            if not row:
                continue
            n = reader.line_num
            if len(row) <= max(seq_col, id_col or 0):
                raise ParseError(f"{path}:{n}: expected {len(header)} columns, got {len(row)}")
            seq = row[seq_col]
            yield (row[id_col].strip() if id_col is not None else sequence_id(seq)), seq, f"{path}:{n}"
    except csv.Error as e:
        raise ParseError(f"{path}:{reader.line_num}: not a readable CSV file ({e})") from e


def _raw(source: Any, format: str | None, stats: dict) -> Iterator[tuple[str, str, str]]:
    """(id, sequence, where) from a path or from in-memory sequences."""
    if isinstance(source, (str, Path)):
        check_source(source)  # a directory, empty or binary file: one line naming it
        if is_csv(source, format):
            yield from _csv_rows(source, format)
            return
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


def skipped_text(stats: dict) -> str:
    """'3 invalid, 1 empty' (or 'none') for messages."""
    return ", ".join(f"{stats[k]} {k}" for k in SKIP_KINDS if stats.get(k)) or "none"

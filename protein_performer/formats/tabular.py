"""CSV and TSV tables of sequences (gzipped or not): a header with a ``seq`` (or ``sequence``)
column and optionally ``id``. The one place that tells a table from a sequence file and a TSV
from a CSV (by the name, or the format a setting gives); label tables (probe, finetune) read
their own columns through :func:`csv_reader`. Data preparation reads no tables (no byte-level
shard tokenizer).
"""
from __future__ import annotations

import csv
import functools
import hashlib
from pathlib import Path
from typing import Iterator

from .text import Format, ParseError, Record, numbered_lines


def _name(path: str | Path) -> str:
    return str(path).lower().removesuffix(".gz")


def is_table(path: str | Path, format: str | None = None) -> bool:
    """A CSV/TSV: ``format`` says so, or (no format given) the name ends in .csv or .tsv (+ .gz)."""
    return format in ("csv", "tsv") or (format is None and _name(path).endswith((".csv", ".tsv")))


def table_format(path: str | Path, format: str | None = None) -> str:
    """'tsv' when ``format`` says so or (no format given) the name ends in .tsv (+ .gz); else 'csv'."""
    return "tsv" if format == "tsv" or (format is None and _name(path).endswith(".tsv")) else "csv"


def csv_reader(path: str | Path, format: str | None = None):
    """A strict :func:`csv.reader` over the file's lines (gzip and encodings as every format reads
    them), tab-separated for a TSV (:func:`table_format`); ``reader.line_num`` numbers the lines."""
    return csv.reader((line for _, line in numbered_lines(path)),
                      delimiter="\t" if table_format(path, format) == "tsv" else ",", strict=True)


def sequence_id(sequence: str) -> str:
    """Stable id for a sequence without a name (tables with only a ``seq`` column): the probe
    computes the same id to find the sequence's embedding."""
    seq = "".join(sequence.split()).upper()
    return "seq_" + hashlib.sha1(seq.encode()).hexdigest()[:16]


def read_table(path: str | Path, format: str | None = None, *, skip_empty: bool = False,
               stats: dict | None = None) -> Iterator[Record]:
    """Records of a table (``description`` empty, ``line`` the row's line); without an ``id``
    column, :func:`sequence_id` names each sequence. A row with an empty sequence is an error,
    or with ``skip_empty`` counted in ``stats['empty']`` (as in every other format)."""
    reader = csv_reader(path, format)
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
            rid = row[id_col].strip() if id_col is not None else sequence_id(seq)
            if not seq.strip():
                if not skip_empty:
                    raise ParseError(f"{path}:{n}: record {rid!r} has no sequence")
                if stats is not None:
                    stats["empty"] = stats.get("empty", 0) + 1
                continue
            yield Record(rid, "", seq, n)
    except csv.Error as e:
        raise ParseError(f"{path}:{reader.line_num}: not a readable CSV file ({e})") from e


CSV = Format("csv", (".csv",), functools.partial(read_table, format="csv"))
TSV = Format("tsv", (".tsv",), functools.partial(read_table, format="tsv"))

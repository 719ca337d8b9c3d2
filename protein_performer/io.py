"""Streaming readers for FASTA and UniProt flat files (``.dat``, the format TrEMBL ships
in), plain or gzipped.

Both readers yield :class:`Record` objects one at a time, so a 50 GB file never sits in
memory. They are hand-written for speed (TrEMBL scale) and tested against Biopython's
``fasta`` and ``swiss`` parsers on real files. Problems are reported as
:class:`ParseError` naming the file, the record and the line.
"""
from __future__ import annotations

import codecs
import gzip
import io
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from typing import Iterator

FASTA_SUFFIXES = (".fasta", ".fa", ".faa", ".fas", ".fna", ".mpfa", ".pep")
DAT_SUFFIXES = (".dat", ".txt", ".swiss", ".sp")


class ParseError(UserError):
    """A malformed input file; the message names file, record and line."""


def _latin1_fallback(err: UnicodeDecodeError):
    # bytes that are not UTF-8 are read as Latin-1: any file opens, and messages show the
    # character the file holds ('é', not 'Ã©')
    return err.object[err.start:err.end].decode("latin-1"), err.end


codecs.register_error("protein_performer.latin1", _latin1_fallback)
#: UTF-8, a leading byte-order mark dropped, other bytes as Latin-1
TEXT = dict(encoding="utf-8-sig", errors="protein_performer.latin1")


@dataclass
class Record:
    id: str
    description: str
    sequence: str
    line: int = 0  # 1-based line where the record starts

    @property
    def accession(self) -> str:
        return accession(self.id)


def accession(record_id):
    """UniProt accession of a record id (str or bytes): ``sp|P12345|NAME`` -> ``P12345``;
    otherwise the id itself. Splits are drawn from it, so a protein keeps its split
    whichever header style or file format it comes in."""
    bar = "|" if isinstance(record_id, str) else b"|"
    if record_id[:3] in ("sp|", "tr|", b"sp|", b"tr|"):
        parts = record_id.split(bar, 2)
        if len(parts) == 3:
            return parts[1]
    return record_id


def open_text(path: str | Path):
    """Open plain or gzipped text (detected from the magic bytes, not the name) as :data:`TEXT`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), **TEXT)
    return open(path, "r", **TEXT)


def check_source(path: str | Path, key: str | None = None) -> None:
    """Open ``path`` and look at its first bytes before anything is written for it, so a
    directory, an empty file or a binary file is a one-line error naming it (``key=path``
    when a setting gave the path) instead of an empty preparation."""
    path = Path(path)
    name = f"{key}={path}" if key else str(path)
    if path.is_dir():
        raise UserError(f"{name}: is a directory, not a FASTA or UniProt file")
    if not path.exists():
        raise FileNotFoundError(f"{name}: no such file")
    with open(path, "rb") as fh:
        head = fh.read(1 << 16)
    if not head:
        raise UserError(f"{name}: is empty")
    if head[:2] == b"\x1f\x8b":
        try:
            with gzip.open(path, "rb") as fh:
                head = fh.read(1 << 16)
        except (OSError, EOFError, ValueError):  # truncated or corrupt: the reader reports where
            return
        if not head:
            raise UserError(f"{name}: is empty (a gzip file holding no text)")
    control = sum(head.count(bytes([c])) for c in range(32) if c not in b"\t\n\v\f\r")
    if b"\0" in head or control > len(head) // 100:
        raise UserError(f"{name}: is a binary file, not FASTA or UniProt text")


def detect_format(path: str | Path) -> str:
    """'fasta' or 'uniprot', from the name (``.gz`` ignored) or else the first line."""
    name = str(path).lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(FASTA_SUFFIXES):
        return "fasta"
    if name.endswith(DAT_SUFFIXES):
        return "uniprot"
    with open_text(path) as fh:
        first = fh.readline()
    if first.startswith(">"):
        return "fasta"
    if first.startswith("ID   "):
        return "uniprot"
    raise ParseError(f"{path}:1: cannot tell whether this is FASTA or a UniProt flat file")


def _lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """Numbered lines; a truncated or corrupt gzip becomes a ParseError with the line."""
    n = 0
    with open_text(path) as fh:
        try:
            for n, line in enumerate(fh, 1):
                yield n, line
        except (EOFError, zlib.error, gzip.BadGzipFile, OSError) as e:
            raise ParseError(f"{path}:{n + 1}: truncated or corrupt gzip data after line {n} ({e})") from e


def read_fasta(path: str | Path, *, skip_empty: bool = False, stats: dict | None = None) -> Iterator[Record]:
    """Stream FASTA records. Text before the first ``>`` is an error; so is a record with
    no sequence, unless ``skip_empty`` (then it is counted in ``stats['empty']``)."""
    header, start, chunks = None, 0, []

    def finish():
        seq = "".join(chunks)
        if not seq:
            rid = header.split(None, 1)[0] if header.split() else ""
            if skip_empty:
                if stats is not None:
                    stats["empty"] = stats.get("empty", 0) + 1
                return None
            raise ParseError(f"{path}:{start}: record {rid!r} has no sequence")
        parts = header.split(None, 1)
        if not parts:
            raise ParseError(f"{path}:{start}: empty FASTA header")
        return Record(parts[0], header, seq, start)

    for n, line in _lines(path):
        if line.startswith(">"):
            if header is not None and (rec := finish()) is not None:
                yield rec
            header, start, chunks = line[1:].strip(), n, []
        elif header is None:
            if line.strip() and not line.startswith(";"):
                raise ParseError(f"{path}:{n}: expected a '>' header line before sequence data, got {line.strip()[:40]!r}")
        else:
            chunks.append(line.strip().replace(" ", ""))
    if header is not None and (rec := finish()) is not None:
        yield rec


def read_uniprot(path: str | Path, *, skip_empty: bool = False, stats: dict | None = None) -> Iterator[Record]:
    """Stream UniProt flat-file records. ``id`` is the primary accession (as Biopython's
    ``swiss`` SeqIO parser gives), ``description`` the DE lines joined."""
    entry = None  # (start line, entry name)
    acc: list[str] = []
    de: list[str] = []
    seq: list[str] = []
    in_seq = False
    for n, line in _lines(path):
        code = line[:2]
        if in_seq:
            if code == "//":
                if not seq and not skip_empty:
                    raise ParseError(f"{path}:{entry[0]}: record {entry[1]!r} has an empty sequence")
                if seq:
                    yield Record(acc[0] if acc else entry[1], " ".join(de), "".join(seq), entry[0])
                elif stats is not None:
                    stats["empty"] = stats.get("empty", 0) + 1
                entry, in_seq = None, False
            elif line[:1] not in (" ", "\n", "\r") and line.strip():  # sequence lines are indented
                raise ParseError(f"{path}:{n}: record {entry[1]!r} (line {entry[0]}) has no '//' terminator "
                                 f"before {line.strip()[:40]!r}")
            else:
                seq.append(line.replace(" ", "").strip())
            continue
        if code == "ID":
            if entry is not None:
                raise ParseError(f"{path}:{n}: record {entry[1]!r} (line {entry[0]}) has no '//' terminator")
            name = line[5:].split(None, 1)
            entry, acc, de, seq = (n, name[0] if name else "?"), [], [], []
        elif entry is None:
            if line.strip():
                raise ParseError(f"{path}:{n}: expected an 'ID' line to start a record, got {line.strip()[:40]!r}")
        elif code == "AC":
            acc.extend(a for a in line[5:].replace(";", " ").split())
        elif code == "DE":
            de.append(line[5:].strip())
        elif code == "SQ":
            in_seq = True
        elif code == "//":
            raise ParseError(f"{path}:{n}: record {entry[1]!r} ends without an SQ sequence block")
    if entry is not None:
        raise ParseError(f"{path}: record {entry[1]!r} (line {entry[0]}) is truncated: end of file before '//'")


def read_records(path: str | Path, format: str | None = None, **kw) -> Iterator[Record]:
    """Stream records from FASTA or UniProt flat file (format detected unless given)."""
    format = format or detect_format(path)
    if format == "fasta":
        return read_fasta(path, **kw)
    if format in ("uniprot", "dat", "swiss"):
        return read_uniprot(path, **kw)
    raise UserError(f"unknown format {format!r} (expected 'fasta' or 'uniprot')")

"""UniProt flat files (``.dat``, the format Swiss-Prot and TrEMBL ship in), plain or gzipped:
the streaming record reader and the byte-level block tokenizer for data preparation.

The reader is hand-written for speed (TrEMBL scale) and tested against Biopython's ``swiss``
parser on real files; the block tokenizer is tested against the reader.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from .text import BlockParseError, Format, ParseError, Record, line_starts, numbered_lines


def read_uniprot(path: str | Path, *, skip_empty: bool = False, stats: dict | None = None) -> Iterator[Record]:
    """Stream UniProt flat-file records. ``id`` is the primary accession (as Biopython's
    ``swiss`` SeqIO parser gives), ``description`` the DE lines joined."""
    entry = None  # (start line, entry name)
    acc: list[str] = []
    de: list[str] = []
    seq: list[str] = []
    in_seq = False
    for n, line in numbered_lines(path):
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


# --- byte-level: one block of complete records ------------------------------------------
def _spans(buf: bytes, source: str):
    """Record starts, SQ-block spans, primary accessions and structural errors."""
    a = np.frombuffer(buf, dtype=np.uint8)
    n = len(buf)
    nl = np.flatnonzero(a == 10)
    ls = line_starts(a, nl)
    ls = ls[ls + 5 <= n]
    is_id = (a[ls] == ord("I")) & (a[ls + 1] == ord("D")) & (a[ls + 2] == 32) & (a[ls + 3] == 32) & (a[ls + 4] == 32)
    heads = ls[is_id]
    if len(heads) == 0 or heads[0] != 0:
        first = buf[: heads[0] if len(heads) else n]
        if first.strip():
            line = first.strip().split(b"\n")[0]
            raise ParseError(f"{source}:1: expected an 'ID' line to start a record, got {line[:40].decode('utf-8', 'replace')!r}")
    k = np.searchsorted(nl, heads)
    ends = np.append(heads[1:], n)
    s0, s1, ids, errors = [], [], [], {}
    for i, (s, e) in enumerate(zip(heads.tolist(), ends.tolist())):
        eol = buf.find(b"\n", s, e)
        name = buf[s + 5: eol if eol >= 0 else e].split(None, 1)
        ac = buf.find(b"\nAC   ", s, e)
        sq = buf.find(b"\nSQ   ", s, e)
        term = buf.rfind(b"\n//", s, e)
        acc = buf[ac + 6: buf.find(b"\n", ac + 1, e)].replace(b";", b" ").split() if ac >= 0 and (sq < 0 or ac < sq) else []
        ids.append(acc[0] if acc else (name[0] if name else b"?"))
        if term < 0:
            raise BlockParseError(source, int(k[i]), f"record {ids[-1].decode('utf-8', 'replace')!r} is truncated: "
                                                     f"no '//' terminator before the next record or the end of the file")
        if sq < 0 or sq > term:
            errors[i] = "no SQ sequence block"
            s0.append(term)
            s1.append(term)
            continue
        body = buf.find(b"\n", sq + 1, e)
        s0.append(body + 1 if 0 <= body < term else term + 1)
        s1.append(term + 1)
    return heads, np.array(s0, dtype=np.int64), np.array(s1, dtype=np.int64), k, ids, errors


def uniprot_block_records(buf: bytes, first_block: bool, source: str, table: bytes, ws: bytes):
    """(ids, translated sequences, {record: format error}, locate) of the records in ``buf``;
    ``locate()`` gives (starts, sequence starts, sequence ends, 0-based lines)."""
    heads, s0, s1, k, ids, errors = _spans(buf, source)
    seqs = [buf[x:y].translate(table, ws) for x, y in zip(s0.tolist(), s1.tolist())]
    return ids, seqs, errors, lambda: (heads, s0, s1, k)


UNIPROT = Format("uniprot", (".dat", ".txt", ".swiss", ".sp"), read_uniprot,
                 looks_like=lambda line: line.startswith("ID   "), record_start=b"\nID   ",
                 block_records=uniprot_block_records)

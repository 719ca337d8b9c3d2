"""FASTA (``>id description`` headers, sequence lines), plain or gzipped: the streaming record
reader and the byte-level block tokenizer for data preparation.

The reader is hand-written for speed (TrEMBL scale) and tested against Biopython's ``fasta``
parser on real files; the block tokenizer is tested against the reader.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np

from .blocks import SEP
from .text import Format, ParseError, Record, line_starts, numbered_lines, whitespace_class


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

    for n, line in numbered_lines(path):
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


# --- byte-level: one block of complete records ------------------------------------------
# patterns start with a literal "\n>" so the regex engine can skip ahead with a fast search
_ID = re.compile(rb"\n>[" + whitespace_class(False) + rb"]*([^" + whitespace_class() + rb"]*)")
_HEAD = re.compile(rb"\n>[^\n]*")


def _spans(buf: bytes):
    """Header starts and sequence spans, found with numpy (the careful, slower route)."""
    a = np.frombuffer(buf, dtype=np.uint8)
    n = len(buf)
    nl = np.flatnonzero(a == 10)
    ls = line_starts(a, nl)
    heads = ls[a[ls] == ord(">")]
    k = np.searchsorted(nl, heads)  # newlines before each header = its 0-based line
    head_end = np.where(k < len(nl), nl[np.minimum(k, max(len(nl) - 1, 0))] if len(nl) else n, n)
    return heads, np.minimum(head_end + 1, n), np.append(heads[1:], n).astype(np.int64), k


def fasta_block_records(buf: bytes, first_block: bool, source: str, table: bytes, ws: bytes):
    """(ids, translated sequences, {record: format error}, locate) of the records in ``buf``;
    ``locate()`` gives (starts, sequence starts, sequence ends, 0-based lines)."""
    text = b"\n" + buf  # so the first header also follows a newline
    ids = _ID.findall(text)
    head0 = buf.find(b">") if buf[:1] != b">" else 0
    if head0 and first_block:
        prefix = buf[: head0 if head0 > 0 else len(buf)]
        for k, line in enumerate(prefix.split(b"\n"), 1):
            if line.strip() and not line.startswith(b";"):
                raise ParseError(f"{source}:{k}: expected a '>' header line before sequence data, "
                                 f"got {line.strip()[:40].decode('utf-8', 'replace')!r}")
    # every header line becomes one SEP byte; whitespace goes; residues become ids
    pieces = _HEAD.sub(b">", text).translate(table, ws).split(bytes([SEP]))
    if len(pieces) == len(ids) + 1:
        seqs = pieces[1:]
    else:  # a stray '>' inside sequence data: cut record by record instead
        _, s0, s1, _ = _spans(buf)
        seqs = [buf[x:y].translate(table, ws) for x, y in zip(s0.tolist(), s1.tolist())]
    errors = {i: "empty FASTA header" for i, rid in enumerate(ids) if not rid}
    return ids, seqs, errors, lambda: _spans(buf)


FASTA = Format("fasta", (".fasta", ".fa", ".faa", ".fas", ".fna", ".mpfa", ".pep"), read_fasta,
               looks_like=lambda line: line.startswith(">"), record_start=b"\n>", block_records=fasta_block_records)

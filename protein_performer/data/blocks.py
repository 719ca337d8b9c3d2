"""Fast block-based tokenization of FASTA and UniProt ``.dat`` text for data preparation.

The line-by-line readers in :mod:`protein_performer.io` are the reference (and what small
files use); at TrEMBL scale their per-line Python work is too slow. Here the input is cut
into large blocks that always end at a record boundary, and each block is tokenized with
a few bulk numpy passes: find header / sequence spans, drop whitespace with a byte table,
map residues through the tokenizer's 256-entry lookup table. Only per-record bookkeeping
(the id and two short hashes) runs in Python. Tests hold the output to ``read_fasta`` /
``read_uniprot`` + :meth:`Tokenizer.encode` on the same files.

Block boundaries depend only on the uncompressed text and ``block_size`` (never on the
number of workers or on gzip), so every run cuts a file the same way.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from ..io import ParseError, accession
from ..tokenizer import AMINO_ACIDS, Tokenizer
from .split import SPLITS, split_codes
from ..errors import UserError

# Bytes Python's str.split() treats as whitespace (latin-1), which is what
# read_fasta + Tokenizer.clean drop from sequence lines.
WHITESPACE = np.array([chr(b).isspace() for b in range(256)], dtype=bool)
RECORD_START = {"fasta": b"\n>", "uniprot": b"\nID   "}
MAX_REASONS = 5
# translation sentinels: '>' (a header line becomes one, splitting records), '*', the rest
SEP, STAR, INVALID = 253, 254, 255
_TABLES: dict = {}


def _translation(tokenizer: Tokenizer) -> tuple[bytes, bytes]:
    """``bytes.translate`` table (residue -> id, '*' -> STAR, '>' -> SEP, else INVALID) and the
    whitespace bytes to delete."""
    lut = tokenizer._table
    special = {ord("*"): STAR, ord(">"): SEP}
    table = bytes(int(lut[b]) if lut[b] >= 0 else special.get(b, INVALID) for b in range(256))
    return table, bytes(np.flatnonzero(WHITESPACE).astype(np.uint8))


def _unknown_fix(tokenizer: Tokenizer) -> bytes:
    x = tokenizer.aa_offset + AMINO_ACIDS.index("X") if tokenizer.unknown == "X" else tokenizer.unk_id
    return bytes(x if b >= SEP else b for b in range(256))


def is_gzip(path: str | Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


# --- cutting a file into blocks ---------------------------------------------------------
def _gunzip_chunks(path: Path, chunk: int = 1 << 22) -> Iterator[bytes]:
    """Decompressed text of a (possibly multi-member) gzip file, in pieces; a truncated
    or corrupt file is a ParseError naming it."""
    d = zlib.decompressobj(wbits=31)
    with open(path, "rb") as fh:
        while raw := fh.read(chunk):
            while raw:
                if d.eof:  # a further gzip member follows
                    d = zlib.decompressobj(wbits=31)
                try:
                    out = d.decompress(raw)
                except zlib.error as e:
                    raise ParseError(f"{path}: corrupt gzip data near byte {fh.tell()} ({e})") from e
                if out:
                    yield out
                raw = d.unused_data if d.eof else b""
    if not d.eof:
        raise ParseError(f"{path}: truncated gzip data (the file ends inside a compressed stream)")


def iter_ranges(path: str | Path, format: str, block_size: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """For an uncompressed file: ``(offset, length)`` of the same blocks
    :func:`iter_text_blocks` yields, found by seeking, so workers can read them."""
    marker = RECORD_START[format]
    size = Path(path).stat().st_size
    with open(path, "rb") as fh:
        pos = start
        while pos < size:
            probe = pos + block_size - 1
            cut = -1
            tail = b""
            while probe < size:
                fh.seek(probe)
                piece = fh.read(1 << 16)
                hit = (tail + piece).find(marker)
                if hit >= 0:
                    cut = probe - len(tail) + hit
                    break
                tail = piece[-(len(marker) - 1):]
                probe += len(piece)
            end = size if cut < 0 or pos + block_size >= size else cut + 1
            yield pos, end - pos
            pos = end


def read_range(path: str | Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(length)


def iter_text_blocks(path: str | Path, format: str, block_size: int, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, text)``: consecutive pieces of the uncompressed file, each ending
    just before a record start (or at end of file) and at least ``block_size`` long
    except the last. ``start`` (an offset this function yielded earlier) skips ahead."""
    path = Path(path)
    marker = RECORD_START[format]
    if is_gzip(path):
        source = _gunzip_chunks(path)
    else:
        def source():
            with open(path, "rb") as fh:
                while piece := fh.read(1 << 22):
                    yield piece
        source = source()
    buf = bytearray()
    offset = 0  # uncompressed offset of buf[0]
    for piece in source:
        if offset + len(buf) + len(piece) <= start:  # still before the resume point
            offset += len(piece)
            continue
        buf += piece
        if offset < start:
            del buf[: start - offset]
            offset = start
        while len(buf) > block_size:
            cut = buf.find(marker, block_size - 1)
            if cut < 0:
                break
            yield offset, bytes(buf[: cut + 1])
            del buf[: cut + 1]
            offset += cut + 1
    if buf:
        yield offset, bytes(buf)


# --- tokenizing one block ---------------------------------------------------------------
@dataclass
class BlockResult:
    """What one block turned into. Records are grouped by split (train, valid, test in
    that order, file order within a split); ``tokens`` holds each record's residues
    followed by ``<eos>``."""
    tokens: np.ndarray            # uint8
    lengths: np.ndarray           # int64, residues per record (eos not counted)
    hashes: np.ndarray            # uint64, xxh3 of the record's token ids (for de-duplication)
    splits: np.ndarray            # uint8 index into SPLITS
    records: np.ndarray           # int64, index of each record in the block (file order)
    read: np.ndarray              # int64[3], records read per split
    invalid: np.ndarray           # int64[3], invalid records per split
    id_hashes: np.ndarray         # uint64, xxh3 of each record's id (a repeated id is refused or skipped)
    lines: np.ndarray             # int64, 0-based line of each record's header in the block
    ids: list                     # bytes, each record's id (for messages)
    newlines: int                 # newline count of the block
    nbytes: int                   # size of the block's text
    reasons: list = field(default_factory=list)  # up to MAX_REASONS (relative line, id, why)


def _ws_class(newline: bool) -> bytes:
    return b"".join(re.escape(bytes([b])) for b in np.flatnonzero(WHITESPACE).tolist() if newline or b != 10)


_WS = _ws_class(True)
# patterns start with a literal "\n>" so the regex engine can skip ahead with a fast search
_FASTA_ID = re.compile(rb"\n>[" + _ws_class(False) + rb"]*([^" + _WS + rb"]*)")
_FASTA_HEAD = re.compile(rb"\n>[^\n]*")


def _line_starts(a: np.ndarray, nl: np.ndarray) -> np.ndarray:
    ls = np.concatenate(([0], nl + 1))
    return ls[ls < len(a)]


def _fasta_spans(buf: bytes):
    """Header starts and sequence spans, found with numpy (the careful, slower route)."""
    a = np.frombuffer(buf, dtype=np.uint8)
    n = len(buf)
    nl = np.flatnonzero(a == 10)
    ls = _line_starts(a, nl)
    heads = ls[a[ls] == ord(">")]
    k = np.searchsorted(nl, heads)  # newlines before each header = its 0-based line
    head_end = nl[k] if len(nl) else np.full(len(heads), n)
    head_end = np.where(k < len(nl), nl[np.minimum(k, max(len(nl) - 1, 0))] if len(nl) else n, n)
    return heads, np.minimum(head_end + 1, n), np.append(heads[1:], n).astype(np.int64), k


BOM = b"\xef\xbb\xbf"


def _fasta(buf: bytes, first_block: bool, source: str, table: bytes, ws: bytes):
    text = b"\n" + buf  # so the first header also follows a newline
    ids = _FASTA_ID.findall(text)
    head0 = buf.find(b">") if buf[:1] != b">" else 0
    if head0 and first_block:
        prefix = buf[: head0 if head0 > 0 else len(buf)]
        for k, line in enumerate(prefix.split(b"\n"), 1):
            if line.strip() and not line.startswith(b";"):
                raise ParseError(f"{source}:{k}: expected a '>' header line before sequence data, "
                                 f"got {line.strip()[:40].decode('utf-8', 'replace')!r}")
    # every header line becomes one SEP byte; whitespace goes; residues become ids
    pieces = _FASTA_HEAD.sub(b">", text).translate(table, ws).split(bytes([SEP]))
    if len(pieces) == len(ids) + 1:
        seqs = pieces[1:]
    else:  # a stray '>' inside sequence data: cut record by record instead
        _, s0, s1, _ = _fasta_spans(buf)
        seqs = [buf[x:y].translate(table, ws) for x, y in zip(s0.tolist(), s1.tolist())]
    errors = {i: "empty FASTA header" for i, rid in enumerate(ids) if not rid}
    return ids, seqs, errors, lambda: _fasta_spans(buf)


def _uniprot_spans(buf: bytes, source: str):
    """Record starts, SQ-block spans, primary accessions and structural errors."""
    a = np.frombuffer(buf, dtype=np.uint8)
    n = len(buf)
    nl = np.flatnonzero(a == 10)
    ls = _line_starts(a, nl)
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
            raise ParseError(f"{source}: record {ids[-1].decode('utf-8', 'replace')!r} (line {int(k[i]) + 1} of its block) is "
                             f"truncated: no '//' terminator before the next record or the end of the file")
        if sq < 0 or sq > term:
            errors[i] = "no SQ sequence block"
            s0.append(term)
            s1.append(term)
            continue
        body = buf.find(b"\n", sq + 1, e)
        s0.append(body + 1 if 0 <= body < term else term + 1)
        s1.append(term + 1)
    return heads, np.array(s0, dtype=np.int64), np.array(s1, dtype=np.int64), k, ids, errors


def _uniprot(buf: bytes, source: str, table: bytes, ws: bytes):
    heads, s0, s1, k, ids, errors = _uniprot_spans(buf, source)
    seqs = [buf[x:y].translate(table, ws) for x, y in zip(s0.tolist(), s1.tolist())]
    return ids, seqs, errors, lambda: (heads, s0, s1, k)


def tokenize_block(buf: bytes, format: str, *, tokenizer: Tokenizer = Tokenizer(), valid_fraction: float = 0.0,
                   test_fraction: float = 0.0, first_block: bool = False, source: str = "<block>") -> BlockResult:
    """Tokenize every record of ``buf`` (complete records only). Records with an invalid
    residue (``tokenizer.unknown == 'error'``), no residues or no id are counted as
    invalid, with a few reasons kept for the report."""
    nbytes = len(buf)
    if first_block and buf.startswith(BOM):  # a UTF-8 byte-order mark is not content
        buf = buf[len(BOM):]
    table, ws = _translation(tokenizer)
    if format == "fasta":
        ids, seqs, errors, locate = _fasta(buf, first_block, source, table, ws)
    elif format == "uniprot":
        ids, seqs, errors, locate = _uniprot(buf, source, table, ws)
    else:
        raise UserError(f"unknown format {format!r} (expected 'fasta' or 'uniprot')")
    r = len(seqs)
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=r)
    arr = np.frombuffer(b"".join(seqs), dtype=np.uint8)
    ends = np.cumsum(lens)
    # one trailing '*' (stop codon) is dropped, as Tokenizer.clean does
    star = np.zeros(r, dtype=bool)
    star[lens > 0] = arr[ends[lens > 0] - 1] == STAR
    bad_pos = np.flatnonzero(arr >= SEP)
    if star.any():
        bad_pos = np.setdiff1d(bad_pos, (ends - 1)[star], assume_unique=True)
        for i in np.flatnonzero(star).tolist():
            seqs[i] = seqs[i][:-1]
        lens = lens - star
    invalid = lens == 0
    reasons = dict(errors)
    for i in np.flatnonzero(invalid).tolist():
        reasons.setdefault(i, "no residues")
    if bad_pos.size:
        recs = np.unique(np.searchsorted(ends, bad_pos, side="right")).tolist()
        if tokenizer.unknown == "error":
            invalid[recs] = True
            _, s0, s1, _ = locate()
            for rec in recs[:MAX_REASONS]:
                raw = buf[s0[rec]:s1[rec]].translate(None, ws)
                raw = raw[:-1] if raw.endswith(b"*") else raw
                j = next(j for j, b in enumerate(raw) if table[b] >= SEP)
                reasons.setdefault(rec, f"invalid residue {chr(raw[j])!r} at position {j + 1}")
        else:
            fix = _unknown_fix(tokenizer)
            for rec in recs:
                seqs[rec] = seqs[rec].translate(fix)
    for i in errors:
        invalid[i] = True

    codes = split_codes([accession(i) for i in ids], valid_fraction, test_fraction)
    read = np.bincount(codes, minlength=3).astype(np.int64)
    inv = np.bincount(codes[invalid], minlength=3).astype(np.int64)
    good = np.flatnonzero(~invalid)
    order = good[np.argsort(codes[good], kind="stable")]  # grouped by split, file order within
    kept = [seqs[i] for i in order.tolist()]
    eos = bytes([tokenizer.eos_id])
    tokens = np.frombuffer(eos.join(kept) + eos if kept else b"", dtype=np.uint8)
    hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, kept), dtype=np.uint64, count=len(kept))
    k = np.asarray(locate()[3], dtype=np.int64)
    why = [(int(k[i]), ids[i].decode("utf-8", "replace"), w) for i, w in sorted(reasons.items())][:MAX_REASONS]
    kept_ids = [ids[i] for i in order.tolist()]
    id_hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, kept_ids), dtype=np.uint64, count=len(kept_ids))
    return BlockResult(tokens=tokens, lengths=lens[order], hashes=hashes, splits=codes[order], records=order, read=read,
                       invalid=inv, id_hashes=id_hashes, lines=k[order], ids=kept_ids, newlines=buf.count(b"\n"),
                       nbytes=nbytes, reasons=why)

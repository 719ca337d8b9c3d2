"""The format-independent half of byte-level tokenization: a block of complete records (from
:func:`~protein_performer.formats.text.text_blocks`) to token ids, for data preparation.

The line-by-line readers are the reference (and what small files use); at TrEMBL scale their
per-line Python work is too slow. Each format finds its records' ids and sequence bytes with a
few bulk passes (a format's ``block_records``: :func:`.fasta.fasta_block_records`,
:func:`.uniprot.uniprot_block_records`); here whitespace is
deleted and residues mapped through the tokenizer's 256-entry lookup table with
``bytes.translate``, and invalid records are found with numpy. Only per-record bookkeeping runs
in Python. Tests hold the output to the readers + :meth:`Tokenizer.encode` on the same files.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..tokenizer import AMINO_ACIDS, Tokenizer
from .text import BOM, WHITESPACE

#: reasons kept per block for the report
MAX_REASONS = 5
# translation sentinels: '>' (a FASTA header line becomes one, splitting records), '*', the rest
SEP, STAR, INVALID = 253, 254, 255


@dataclass
class TokenizedBlock:
    """The records of one block in file order. ``sequences`` are token ids (residues only,
    a trailing '*' dropped); those of ``invalid`` records are not meaningful."""
    ids: list                     # bytes, each record's id
    sequences: list               # bytes of token ids
    invalid: np.ndarray           # bool: an invalid residue (unknown='error'), no residues or a format error
    lines: np.ndarray             # int64, 0-based line of each record's start in the block
    newlines: int                 # newline count of the block
    nbytes: int                   # size of the block's text
    reasons: list = field(default_factory=list)  # up to MAX_REASONS (relative line, id, why)


def translation(tokenizer: Tokenizer) -> tuple[bytes, bytes]:
    """``bytes.translate`` table (residue -> id, '*' -> STAR, '>' -> SEP, else INVALID) and the
    whitespace bytes to delete."""
    lut = tokenizer._table
    special = {ord("*"): STAR, ord(">"): SEP}
    table = bytes(int(lut[b]) if lut[b] >= 0 else special.get(b, INVALID) for b in range(256))
    return table, bytes(np.flatnonzero(WHITESPACE).astype(np.uint8))


def _unknown_fix(tokenizer: Tokenizer) -> bytes:
    x = tokenizer.aa_offset + AMINO_ACIDS.index("X") if tokenizer.unknown == "X" else tokenizer.unk_id
    return bytes(x if b >= SEP else b for b in range(256))


def tokenize(buf: bytes, block_records, *, tokenizer: Tokenizer, first_block: bool, source: str) -> TokenizedBlock:
    """Tokenize every record of ``buf`` with a format's ``block_records(buf, first_block, source,
    table, ws) -> (ids, sequences, errors, locate)``. Records with an invalid residue
    (``tokenizer.unknown == 'error'``), no residues or a format error are marked invalid, with a
    few reasons kept for the report; other unknown residues become X or <unk>."""
    nbytes = len(buf)
    if first_block and buf.startswith(BOM):  # a UTF-8 byte-order mark is not content
        buf = buf[len(BOM):]
    table, ws = translation(tokenizer)
    ids, seqs, errors, locate = block_records(buf, first_block, source, table, ws)
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
    k = np.asarray(locate()[3], dtype=np.int64)
    why = [(int(k[i]), ids[i].decode("utf-8", "replace"), w) for i, w in sorted(reasons.items())][:MAX_REASONS]
    return TokenizedBlock(ids=ids, sequences=seqs, invalid=invalid, lines=k, newlines=buf.count(b"\n"),
                          nbytes=nbytes, reasons=why)

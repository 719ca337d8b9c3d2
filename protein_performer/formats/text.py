"""What every input format shares: opening plain or gzipped text, reading bytes that are not
UTF-8, the :class:`Record` readers yield, accessions, and cutting a file into blocks that end
at record starts (the byte-level shard tokenizers' input).

Block boundaries depend only on the uncompressed text, the format's record-start marker and
``block_size`` (never on the number of workers or on gzip), so every run cuts a file the same
way.
"""
from __future__ import annotations

import codecs
import gzip
import io
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..errors import UserError


class ParseError(UserError):
    """A malformed input file; the message names file, record and line."""


class BlockParseError(ParseError):
    """A :class:`ParseError` at ``line`` (0-based) of a block of records: a worker tokenizing the block
    cannot tell the file's line, which :meth:`in_file` names once the caller knows where the block starts."""

    def __init__(self, source: str, line: int, what: str):
        super().__init__(source, line, what)  # the arguments as given: it travels back from a worker process
        self.source, self.line, self.what = source, line, what

    def __str__(self) -> str:
        return f"{self.source}: {self.what} (line {self.line + 1} of a block of records)"

    def in_file(self, lines_before: int) -> ParseError:
        """The error naming the file's line (``lines_before``: the file's lines before the block)."""
        return ParseError(f"{self.source}:{lines_before + self.line + 1}: {self.what}")


def _latin1_fallback(err: UnicodeDecodeError):
    # bytes that are not UTF-8 are read as Latin-1: any file opens, and messages show the
    # character the file holds ('é', not 'Ã©')
    return err.object[err.start:err.end].decode("latin-1"), err.end


codecs.register_error("protein_performer.latin1", _latin1_fallback)
#: UTF-8, a leading byte-order mark dropped, other bytes as Latin-1
TEXT = dict(encoding="utf-8-sig", errors="protein_performer.latin1")
#: a UTF-8 byte-order mark (not content; the byte-level tokenizers drop it)
BOM = b"\xef\xbb\xbf"
#: bytes Python's str.split() treats as whitespace (latin-1): what the readers and
#: Tokenizer.clean drop from sequence lines, and the byte-level tokenizers delete
WHITESPACE = np.array([chr(b).isspace() for b in range(256)], dtype=bool)


@dataclass
class Record:
    id: str
    description: str
    sequence: str
    line: int = 0  # 1-based line where the record starts

    @property
    def accession(self) -> str:
        return accession(self.id)


@dataclass(frozen=True)
class Format:
    """One input format, as the registry (:data:`protein_performer.formats.FORMATS`) holds it:
    its name, the file names it is told by, its record reader and, for the formats data
    preparation reads, its byte-level shard tokenizer (``block_records``, and the bytes a
    record starts after, where blocks are cut)."""
    name: str
    suffixes: tuple[str, ...]
    read: Callable[..., Iterator[Record]]   # (path, *, skip_empty=False, stats=None) -> records
    looks_like: Callable[[str], bool] | None = None   # from the first line, when the name does not tell
    record_start: bytes | None = None
    block_records: Callable | None = None   # (buf, first_block, source, table, ws) -> ids, sequences, errors, locate


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


def is_gzip(path: str | Path) -> bool:
    """From the magic bytes, not the name."""
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def open_text(path: str | Path):
    """Open plain or gzipped text (detected from the magic bytes, not the name) as :data:`TEXT`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if is_gzip(path):
        return io.TextIOWrapper(gzip.open(path, "rb"), **TEXT)
    return open(path, "r", **TEXT)


def numbered_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based number, line); a truncated or corrupt gzip becomes a ParseError with the line."""
    n = 0
    with open_text(path) as fh:
        try:
            for n, line in enumerate(fh, 1):
                yield n, line
        except (EOFError, zlib.error, gzip.BadGzipFile, OSError) as e:
            raise ParseError(f"{path}:{n + 1}: truncated or corrupt gzip data after line {n} ({e})") from e


def whitespace_class(newline: bool = True) -> bytes:
    """A regex character class body of :data:`WHITESPACE` (without ``\\n`` unless ``newline``)."""
    return b"".join(re.escape(bytes([b])) for b in np.flatnonzero(WHITESPACE).tolist() if newline or b != 10)


# --- cutting a file into blocks at record starts ----------------------------------------
def gunzip_chunks(path: str | Path, chunk: int = 1 << 22) -> Iterator[bytes]:
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


def block_ranges(path: str | Path, marker: bytes, block_size: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """For an uncompressed file: ``(offset, length)`` of the same blocks :func:`text_blocks`
    yields, found by seeking, so workers can read them (:func:`read_range`)."""
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


def text_blocks(path: str | Path, marker: bytes, block_size: int, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, text)``: consecutive pieces of the uncompressed file, each ending
    just before a ``marker`` (a newline and a record start) or at end of file, and at least
    ``block_size`` long except the last. ``start`` (an offset this function yielded earlier)
    skips ahead."""
    path = Path(path)
    if is_gzip(path):
        source = gunzip_chunks(path)
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


def line_starts(a: np.ndarray, nl: np.ndarray) -> np.ndarray:
    """Offsets of the lines of byte array ``a`` whose newline offsets are ``nl``."""
    ls = np.concatenate(([0], nl + 1))
    return ls[ls < len(a)]

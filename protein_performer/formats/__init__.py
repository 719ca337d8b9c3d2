"""Input formats, registered once (:data:`FORMATS`): name -> a :class:`~.text.Format` with the
file names it is told by, its record reader and, for the formats data preparation reads, its
byte-level shard tokenizer.

- :mod:`.text`: what all formats share (plain or gzipped text, Latin-1 fallback, Record, accession,
  cutting a file into blocks at record starts)
- :mod:`.fasta`, :mod:`.uniprot` (flat ``.dat`` files), :mod:`.tabular` (CSV / TSV): one module each,
  reader and (FASTA, UniProt) block tokenizer together
- :mod:`.blocks`: the format-independent half of byte-level tokenization

Everything that takes a format name is here, so a new format is one module and one line in
:data:`FORMATS`.
"""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import Iterator

from ..errors import UserError
from ..tokenizer import Tokenizer
from .blocks import TokenizedBlock, tokenize
from .fasta import FASTA
from .tabular import CSV, TSV
from .text import Format, ParseError, Record, accession, block_ranges, open_text, text_blocks
from .uniprot import UNIPROT

FORMATS: dict[str, Format] = {f.name: f for f in (FASTA, UNIPROT, CSV, TSV)}
#: other names a setting may use
ALIASES = {"dat": "uniprot", "swiss": "uniprot"}
#: the formats data preparation reads (those with a byte-level shard tokenizer)
SHARD_FORMATS = tuple(name for name, f in FORMATS.items() if f.block_records is not None)

__all__ = ["FORMATS", "Format", "ParseError", "Record", "TokenizedBlock", "accession", "check_source",
           "detect_format", "format_name", "iter_ranges", "iter_text_blocks", "read_records", "tokenize_block"]


def format_name(format: str, shards: bool = False) -> str:
    """The registered name of ``format`` (aliases resolved); an unknown one (or, with ``shards``,
    one data preparation cannot read) is a one-line error listing the choices."""
    name = ALIASES.get(format, format)
    choices = SHARD_FORMATS if shards else tuple(FORMATS)
    if name not in choices:
        raise UserError(f"unknown format {format!r} (expected {', '.join(map(repr, choices[:-1]))} "
                        f"or {choices[-1]!r})")
    return name


def detect_format(path: str | Path) -> str:
    """A name of :data:`FORMATS`, from the file name (``.gz`` ignored) or else the first line."""
    name = str(path).lower().removesuffix(".gz")
    for f in FORMATS.values():
        if name.endswith(f.suffixes):
            return f.name
    with open_text(path) as fh:
        first = fh.readline()
    for f in FORMATS.values():
        if f.looks_like is not None and f.looks_like(first):
            return f.name
    raise ParseError(f"{path}:1: cannot tell whether this is FASTA or a UniProt flat file")


def read_records(path: str | Path, format: str | None = None, **kw) -> Iterator[Record]:
    """Stream records from any registered format (detected unless given); ``skip_empty`` and
    ``stats`` as every reader takes them."""
    return FORMATS[format_name(format) if format else detect_format(path)].read(path, **kw)


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


# --- byte-level, for data preparation ---------------------------------------------------
def iter_text_blocks(path: str | Path, format: str, block_size: int, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """``(offset, text)`` blocks of the uncompressed file, each ending just before a record
    start (:func:`.text.text_blocks` with the format's marker)."""
    return text_blocks(path, FORMATS[format_name(format, shards=True)].record_start, block_size, start)


def iter_ranges(path: str | Path, format: str, block_size: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """For an uncompressed file: ``(offset, length)`` of the blocks :func:`iter_text_blocks` yields."""
    return block_ranges(path, FORMATS[format_name(format, shards=True)].record_start, block_size, start)


def tokenize_block(buf: bytes, format: str, *, tokenizer: Tokenizer = Tokenizer(), first_block: bool = False,
                   source: str = "<block>") -> TokenizedBlock:
    """Token ids of every record of ``buf`` (complete records only), in file order."""
    f = FORMATS[format_name(format, shards=True)]
    return tokenize(buf, f.block_records, tokenizer=tokenizer, first_block=first_block, source=source)

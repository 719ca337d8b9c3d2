"""The one amino-acid vocabulary used everywhere (data preparation, training, evaluation,
embedding, generation).

Token ids are fixed forever (they are written into prepared shards and checkpoints), so
the table below is append-only; ``VERSION`` changes if it ever has to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from .errors import UserError

VERSION = 1

SPECIAL_TOKENS = ("<pad>", "<mask>", "<cls>", "<eos>", "<unk>")
STANDARD_AA = "ACDEFGHIKLMNPQRSTVWY"
EXTRA_AA = "XBZUO"  # unknown, Asx, Glx, selenocysteine, pyrrolysine
AMINO_ACIDS = STANDARD_AA + EXTRA_AA


class InvalidSequenceError(UserError):
    """A residue the vocabulary does not know, reported with where it was found."""


@dataclass(frozen=True)
class Tokenizer:
    """Maps protein sequences to token ids and back.

    Encoding is case-insensitive, ignores whitespace and strips one trailing ``*`` (a stop
    codon). Any other character raises :class:`InvalidSequenceError` naming the file,
    record and character, unless ``unknown="X"`` maps it to X (``"unk"`` maps it to <unk>).
    """

    unknown: str = "error"  # "error" | "X" | "unk"

    pad_id: int = 0
    mask_id: int = 1
    cls_id: int = 2
    eos_id: int = 3
    unk_id: int = 4
    # the setting that controls ``unknown`` in the command at hand, named in error hints
    # (``data.unknown`` for train / prepare_data / evaluate, ``unknown`` for embed)
    unknown_key: str = field(default="data.unknown", compare=False)

    def __post_init__(self):
        if self.unknown not in ("error", "X", "unk"):
            raise UserError(f"{self.unknown_key} must be 'error', 'X' or 'unk', got {self.unknown!r}")

    # --- vocabulary -------------------------------------------------------------------
    @property
    def tokens(self) -> tuple[str, ...]:
        return SPECIAL_TOKENS + tuple(AMINO_ACIDS)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def aa_offset(self) -> int:
        """Id of the first amino acid; amino acids occupy ``aa_offset .. vocab_size-1``."""
        return len(SPECIAL_TOKENS)

    @property
    def standard_aa_ids(self) -> list[int]:
        return [self.aa_offset + i for i in range(len(STANDARD_AA))]

    def _lookup(self) -> np.ndarray:
        """256-entry byte -> id table; -1 marks bytes that are not residues."""
        table = np.full(256, -1, dtype=np.int16)
        for i, aa in enumerate(AMINO_ACIDS):
            table[ord(aa)] = table[ord(aa.lower())] = self.aa_offset + i
        return table

    # --- encode / decode ----------------------------------------------------------------
    def clean(self, sequence: str, *, source: str = "<string>", record: str = "?") -> str:
        """Uppercase, drop whitespace and a trailing '*', and check every character."""
        seq = "".join(sequence.split())
        # upper-case ASCII only: str.upper would turn e.g. 'ß' into the valid residues 'SS'
        seq = seq.upper() if seq.isascii() else "".join(c.upper() if c.isascii() else c for c in seq)
        if seq.endswith("*"):
            seq = seq[:-1]
        bad = set(seq) - set(AMINO_ACIDS)
        if bad:
            if self.unknown == "error":
                ch = next(c for c in seq if c in bad)
                pos = seq.index(ch) + 1
                raise InvalidSequenceError(
                    f"{source}: record {record!r}: invalid residue {ch!r} at position {pos} "
                    f"(set {self.unknown_key}=X to map unknown residues to X)"
                )
        return seq

    def encode(self, sequence: str, *, add_cls: bool = True, add_eos: bool = True,
               source: str = "<string>", record: str = "?") -> np.ndarray:
        """Sequence -> uint8 ids, optionally wrapped as ``<cls> residues <eos>``. uint8: compact, as
        shards hold them; the model takes ids of any integer dtype, so
        ``model(torch.tensor([tok.encode(seq)]))`` needs no cast."""
        seq = self.clean(sequence, source=source, record=record)
        raw = np.frombuffer(seq.encode("latin-1", errors="replace"), dtype=np.uint8)
        ids = self._table[raw]
        if (ids < 0).any():  # only reachable when unknown != "error"
            ids = ids.copy()
            ids[ids < 0] = self.aa_offset + AMINO_ACIDS.index("X") if self.unknown == "X" else self.unk_id
        parts = ([np.array([self.cls_id])] if add_cls else []) + [ids] + (
            [np.array([self.eos_id])] if add_eos else [])
        return np.concatenate(parts).astype(np.uint8)

    def decode(self, ids: Iterable[int], *, keep_special: bool = False) -> str:
        toks = self.tokens
        out = []
        for i in ids:
            i = int(i)
            if i >= self.aa_offset:
                out.append(toks[i])
            elif keep_special:
                out.append(toks[i])
        return "".join(out)

    @property
    def _table(self) -> np.ndarray:
        # cached on the (frozen) instance
        try:
            return self.__dict__["_cached_table"]
        except KeyError:
            table = self._lookup()
            object.__setattr__(self, "_cached_table", table)
            return table

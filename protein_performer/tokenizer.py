"""The one amino-acid vocabulary used everywhere (data preparation, training, evaluation,
embedding, generation).

Token ids are fixed forever (they are written into prepared shards and checkpoints), so
the table below is append-only; ``VERSION`` changes if it ever has to change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .errors import UserError

VERSION = 1

SPECIAL_TOKENS = ("<pad>", "<mask>", "<cls>", "<eos>", "<unk>")
STANDARD_AA = "ACDEFGHIKLMNPQRSTVWY"
EXTRA_AA = "XBZUO"  # unknown, Asx, Glx, selenocysteine, pyrrolysine
AMINO_ACIDS = STANDARD_AA + EXTRA_AA

#: ESM's alphabet (fair-esm ``Alphabet.from_architecture("ESM-1b")``, ESM-2's vocab.txt), in ESM's id
#: order: a converted ESM model (``convert-esm``) reads these ids and its logits are indexed by them.
#: ``.`` and ``-`` (alignment gaps) and ``<null_1>`` (padding the table to 32) are never encoded here.
ESM_TOKENS = ("<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>")
#: vocabulary name -> (tokens in id order, the residues AMINO_ACIDS in id order from the first residue's id)
VOCABULARIES = {"protein-performer": (SPECIAL_TOKENS + tuple(AMINO_ACIDS), AMINO_ACIDS),
                "esm": (ESM_TOKENS, "LAGVSERTIDPKQNFYMHWCXBUZO")}


class SettingError(UserError):
    """A problem a setting fixes. The message names the setting as the library's argument
    (``unknown``); a command whose config holds it under another key (``data.unknown``) renames
    :attr:`setting` (``commands.settings_under``), so the core never knows a config's layout."""

    def __init__(self, message: str, setting: str):
        super().__init__(message, setting)
        self.message, self.setting = message, setting  # message: "{setting}" where the key goes

    def __str__(self) -> str:
        return self.message.replace("{setting}", self.setting)


class InvalidSequenceError(SettingError):
    """A residue the vocabulary does not know, reported with where it was found."""


@dataclass(frozen=True)
class Tokenizer:
    """Maps protein sequences to token ids and back.

    Encoding is case-insensitive, ignores whitespace and strips one trailing ``*`` (a stop
    codon). Any other character raises :class:`InvalidSequenceError` naming the file,
    record and character, unless ``unknown="X"`` maps it to X (``"unk"`` maps it to <unk>).
    """

    unknown: str = "error"  # "error" | "X" | "unk"

    # the special tokens' ids; None: the vocabulary's (0-4 in protein-performer's own)
    pad_id: int = None
    mask_id: int = None
    cls_id: int = None
    eos_id: int = None
    unk_id: int = None
    #: "protein-performer" (this project's table, VERSION) or "esm" (ESM's 33 tokens, ESM's ids)
    vocabulary: str = "protein-performer"

    def __post_init__(self):
        if self.unknown not in ("error", "X", "unk"):
            raise SettingError(f"{{setting}} must be 'error', 'X' or 'unk', got {self.unknown!r}", "unknown")
        if self.vocabulary not in VOCABULARIES:
            raise UserError(f"vocabulary must be one of {', '.join(VOCABULARIES)}, got {self.vocabulary!r}")
        for name in ("pad", "mask", "cls", "eos", "unk"):
            if getattr(self, f"{name}_id") is None:
                object.__setattr__(self, f"{name}_id", self.tokens.index(f"<{name}>"))

    # --- vocabulary -------------------------------------------------------------------
    @property
    def tokens(self) -> tuple[str, ...]:
        return VOCABULARIES[self.vocabulary][0]

    @property
    def residues(self) -> str:
        """The amino acids (AMINO_ACIDS) in id order: ids ``aa_offset .. aa_offset + len - 1``."""
        return VOCABULARIES[self.vocabulary][1]

    def aa_id(self, aa: str) -> int:
        """The id of amino acid ``aa`` (an upper-case letter of AMINO_ACIDS)."""
        return self.aa_offset + self.residues.index(aa)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def aa_offset(self) -> int:
        """Id of the first amino acid; amino acids occupy ``aa_offset .. aa_offset + 24`` (to
        ``vocab_size-1`` in protein-performer's vocabulary; ESM's has gap tokens and <mask> after them)."""
        return self.tokens.index(self.residues[0])

    @property
    def standard_aa_ids(self) -> list[int]:
        return [self.aa_id(aa) for aa in STANDARD_AA]

    def _lookup(self) -> np.ndarray:
        """256-entry byte -> id table; -1 marks bytes that are not residues."""
        table = np.full(256, -1, dtype=np.int16)
        for aa in AMINO_ACIDS:
            table[ord(aa)] = table[ord(aa.lower())] = self.aa_id(aa)
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
                    f"(set {{setting}}=X to map unknown residues to X)", "unknown")
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
            ids[ids < 0] = self.aa_id("X") if self.unknown == "X" else self.unk_id
        parts = ([np.array([self.cls_id])] if add_cls else []) + [ids] + (
            [np.array([self.eos_id])] if add_eos else [])
        return np.concatenate(parts).astype(np.uint8)

    def decode(self, ids: Iterable[int], *, keep_special: bool = False) -> str:
        toks, first, end = self.tokens, self.aa_offset, self.aa_offset + len(self.residues)
        out = []
        for i in ids:
            i = int(i)
            if first <= i < end:
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

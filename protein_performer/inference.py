"""What every inference command needs: load a model, read sequences, pad a batch.

Why one module: evaluate, embed, generate and probe used to each load checkpoints, read
FASTA / .dat / CSV and treat bad records their own way, so the same file could be
accepted by one command and refused, or silently read differently, by another. Batches
are cut by :func:`protein_performer.data.sampler.token_budget_batches` (one cutter).

Invalid-record policy (:func:`read_sequences`), the same for every command:

- a record with no residues is skipped and counted (``empty``);
- a record with a residue outside the vocabulary is an error naming file, line, record
  and character, or with ``on_invalid="skip"`` skipped and counted (``invalid``);
- a record whose id was seen before with the same sequence is skipped and counted
  (``duplicate``); with a different sequence it is an error naming both lines, or with
  ``on_invalid="skip"`` skipped and counted as ``invalid``.

The first few skipped records of each kind are named in a warning; the rest are counted.
"""
from __future__ import annotations

import csv
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from .device import resolve_device
from .errors import UserError
from .io import ParseError, _lines, read_records
from .tokenizer import InvalidSequenceError, Tokenizer

log = logging.getLogger(__name__)

CSV_SUFFIXES = (".csv", ".tsv")
#: skipped records named per kind before only counting
MAX_MESSAGES = 5
SKIP_KINDS = ("empty", "invalid", "duplicate")


# --- models ----------------------------------------------------------------------------
@dataclass
class LoadedModel:
    """A model ready for inference. ``task`` is the Lightning ``ProteinLM`` when the model
    came from a training checkpoint (objective, amino-acid frequencies), else None."""

    net: torch.nn.Module  # PerformerLM, eval mode, on the device
    tokenizer: Tokenizer
    kernel: str | None  # attention kernel name ("softmax", "exact", ...)
    source: str  # the path it came from, or the class name of an in-memory module
    task: Any = None

    @property
    def causal(self) -> bool:
        return bool(getattr(self.net, "causal", False))

    @property
    def objective(self) -> str:
        """'clm' for a causal model, else 'mlm' (what the model was trained to predict)."""
        return self.task.hparams.objective if self.task is not None else ("clm" if self.causal else "mlm")

    @property
    def aa_frequencies(self) -> torch.Tensor | None:
        """The training amino-acid frequencies (float64 over the vocabulary), if recorded."""
        return self.task.aa_frequencies if self.task is not None else None


def load_model(model: Any, device: str = "cpu") -> LoadedModel:
    """A checkpoint path, a ``ProteinLM``, a ``PerformerLM`` (or a LoadedModel) -> :class:`LoadedModel`.
    A missing path or a file that is not a checkpoint is a one-line error naming it."""
    if isinstance(model, LoadedModel):
        model.net = model.net.to(resolve_device(device)).eval()
        return model
    task, source = None, type(model).__name__
    if isinstance(model, (str, Path)):
        from .tasks import load_checkpoint
        source = str(model)
        if Path(source).is_dir():
            raise UserError(f"checkpoint {source}: is a directory, expected a .ckpt file written by training")
        model = load_checkpoint(source, map_location="cpu")
    if hasattr(model, "model") and hasattr(model, "tokenizer"):  # ProteinLM
        task, net, tokenizer = model.eval(), model.model, model.tokenizer
    else:
        net, tokenizer = model, Tokenizer()
    kernel = next((m.kernel for m in net.modules() if isinstance(getattr(m, "kernel", None), str)), None)
    net = net.to(resolve_device(device)).eval()
    return LoadedModel(net, tokenizer, kernel, source, task)


def weights_sha256(net: torch.nn.Module) -> str:
    """Hash of a model's tensors (parameters and buffers, names included): what identifies
    "the same model" whatever file or path it was loaded from. Non-tensor extra state (the
    attention layers' call counters) is left out: it changes on every forward pass."""
    h = hashlib.sha256()
    for name, t in sorted(net.state_dict().items()):
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def file_sha256(path: str | Path) -> str:
    """Hash of a file's bytes (what identifies an input file)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- sequences ---------------------------------------------------------------------------
@dataclass
class Entry:
    """One record to run: ``where`` is ``file:line`` (or ``<sequences>[i]``) for messages;
    ``tokens`` are ``<cls> residues <eos>`` ids."""

    id: str
    sequence: str
    tokens: np.ndarray
    where: str


def sequence_id(sequence: str) -> str:
    """Stable id for a sequence without a name (CSV files with only a ``seq`` column):
    the probe computes the same id to find the sequence's embedding."""
    seq = "".join(sequence.split()).upper()
    return "seq_" + hashlib.sha1(seq.encode()).hexdigest()[:16]


def is_csv(path: str | Path, fmt: str | None = None) -> bool:
    return fmt in ("csv", "tsv") or (fmt is None and str(path).lower().removesuffix(".gz").endswith(CSV_SUFFIXES))


def _csv_rows(path: str | Path, fmt: str | None) -> Iterator[tuple[str, str, str]]:
    """(id, sequence, where) from a CSV/TSV with a ``seq`` (or ``sequence``) column and
    optionally ``id``; without ids, :func:`sequence_id` names each sequence."""
    tsv = fmt == "tsv" or (fmt is None and str(path).lower().removesuffix(".gz").endswith(".tsv"))
    reader = csv.reader((line for _, line in _lines(path)), delimiter="\t" if tsv else ",", strict=True)
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
            yield (row[id_col].strip() if id_col is not None else sequence_id(seq)), seq, f"{path}:{n}"
    except csv.Error as e:
        raise ParseError(f"{path}:{reader.line_num}: not a readable CSV file ({e})") from e


def _raw(source: Any, fmt: str | None, stats: dict) -> Iterator[tuple[str, str, str]]:
    """(id, sequence, where) from a path or from in-memory sequences."""
    if isinstance(source, (str, Path)):
        if is_csv(source, fmt):
            yield from _csv_rows(source, fmt)
            return
        for rec in read_records(source, fmt, skip_empty=True, stats=stats):
            yield rec.id, rec.sequence, f"{source}:{rec.line}"
        return
    if isinstance(source, dict):
        source = list(source.items())
    for n, s in enumerate(source):
        rid, seq = (str(n), s) if isinstance(s, str) else (str(s[0]), s[1])
        yield rid, seq, f"<sequences>[{n}]"


def read_sequences(source: Any, fmt: str | None = None, *, tokenizer: Tokenizer | None = None,
                   unknown: str = "error", on_invalid: str = "error", stats: dict | None = None,
                   warn: bool = True) -> Iterator[Entry]:
    """Tokenized records of a FASTA / UniProt .dat / CSV / TSV file (gzipped or not), a
    dict id -> sequence, or a list of sequences or (id, sequence) pairs, under the policy
    in this module's docstring. ``stats`` receives the counts of skipped records
    (``empty``, ``invalid``, ``duplicate``); ``warn=False`` names none of them (a second
    pass over the same input)."""
    if on_invalid not in ("error", "skip"):
        raise UserError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    tokenizer = tokenizer or Tokenizer(unknown=unknown)
    stats = {} if stats is None else stats
    for k in SKIP_KINDS:
        stats.setdefault(k, 0)
    shown = dict.fromkeys(SKIP_KINDS, 0)

    def skip(kind: str, message: str):
        stats[kind] += 1
        if warn and shown[kind] < MAX_MESSAGES:
            shown[kind] += 1
            log.warning("skipped (%s): %s", kind, message)

    seen: dict[str, tuple[str, int]] = {}  # id -> (where, hash of the cleaned sequence)
    for rid, seq, where in _raw(source, fmt, stats):
        cleaned = "".join(seq.split()).upper().removesuffix("*")
        if not cleaned:
            skip("empty", f"{where}: record {rid!r} has an empty sequence")
            continue
        h = hash(cleaned)
        if rid in seen:
            first, h0 = seen[rid]
            if h == h0:
                skip("duplicate", f"{where}: record {rid!r} repeats the id and sequence first seen at {first}")
                continue
            msg = f"{where}: record {rid!r} repeats the id first seen at {first} with a different sequence"
            if on_invalid == "error":
                raise ParseError(msg + " (rename one, or pass on_invalid=skip to skip it)")
            skip("invalid", msg)
            continue
        seen[rid] = (where, h)
        try:
            tokens = tokenizer.encode(seq, source=where, record=rid)
        except InvalidSequenceError as e:
            if on_invalid == "error":
                raise
            skip("invalid", str(e))
            continue
        yield Entry(rid, seq, tokens, where)


def skipped_text(stats: dict) -> str:
    """'3 invalid, 1 empty' (or 'none') for messages."""
    return ", ".join(f"{stats[k]} {k}" for k in SKIP_KINDS if stats.get(k)) or "none"


# --- batches ----------------------------------------------------------------------------
def pad_batch(tokens: Iterable[np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token arrays -> (B, L) LongTensor padded with ``pad_id`` on the right, and the
    padding mask (True at padding), or None when no row is padded: exact attention then
    needs no L x L mask and SDPA can use its flash kernel."""
    rows = [torch.as_tensor(np.asarray(t, dtype=np.int64)) for t in tokens]
    lengths = torch.tensor([len(r) for r in rows])
    out = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    if bool((lengths == lengths.max()).all()):
        return out, None
    return out, torch.arange(out.shape[1])[None, :] >= lengths[:, None]

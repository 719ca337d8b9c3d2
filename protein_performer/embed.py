"""Embed proteins with a trained model: pooled and per-residue representations.

Why this module exists: most users embed their proteins and fit a small model on top.
It mirrors ESM's ``extract.py`` (token-budget batches sorted by length, layer selection,
mean / BOS / per-residue outputs, ``<id>.pt`` files) but never truncates: linear
attention embeds any length; exact attention runs long proteins one at a time without a
padding mask, where SDPA's flash kernel keeps memory linear in length.

Layers are numbered as ESM numbers them: 0 is the token embedding, ``depth`` the last
block after the final layer norm; negative indices count from the end (-1 = ``depth``).
Pooling runs over residues only (``<cls>`` and ``<eos>`` excluded), except ``cls``,
which is the ``<cls>`` (BOS) position.

The module itself is callable, so ``protein_performer.embed(ckpt, sequences)`` works
as a notebook one-liner (it calls :func:`embed`).
"""
from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import logging
import os
import shutil
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from .io import ParseError, read_records
from .data.sampler import token_budget_batches
from .device import resolve_device
from .tokenizer import InvalidSequenceError, Tokenizer
from .errors import UserError

log = logging.getLogger(__name__)

POOLINGS = ("mean", "cls", "max")
#: ESM's key for each pooling in ``<id>.pt`` files
PT_KEYS = {"mean": "mean_representations", "cls": "bos_representations", "max": "max_representations"}
CSV_SUFFIXES = (".csv", ".tsv")
#: messages printed per kind of skipped record before only counting
MAX_MESSAGES = 5


# --- small helpers -------------------------------------------------------------------
def sequence_id(sequence: str) -> str:
    """Stable id for a sequence without a name (CSV files with only a ``seq`` column):
    the probe computes the same id to find the sequence's embedding."""
    seq = "".join(sequence.split()).upper()
    return "seq_" + hashlib.sha1(seq.encode()).hexdigest()[:16]


def safe_name(record_id: str) -> str:
    """Id -> HDF5 member / file name: '%' and '/' percent-escaped, '.' and '..' too."""
    name = record_id.replace("%", "%25").replace("/", "%2F")
    return {".": "%2E", "..": "%2E%2E"}.get(name, name)


def resolve_layers(layers: int | Sequence[int], depth: int) -> list[int]:
    """ESM-style absolute layer numbers 0..depth from possibly negative indices."""
    if isinstance(layers, (int, np.integer)):
        layers = [int(layers)]
    out = []
    for layer in layers:
        a = int(layer) + depth + 1 if int(layer) < 0 else int(layer)
        if not 0 <= a <= depth:
            raise UserError(f"layer {layer} does not exist: the model has layers 0..{depth} "
                             f"(0 = embedding, {depth} = last block) or -{depth + 1}..-1")
        if a not in out:
            out.append(a)
    return out


def resolve_pooling(pooling: str | Sequence[str]) -> list[str]:
    pooling = [pooling] if isinstance(pooling, str) else list(pooling)
    for p in pooling:
        if p not in POOLINGS:
            raise UserError(f"pooling {p!r} is not one of {', '.join(POOLINGS)}")
    return list(dict.fromkeys(pooling))


def _dtype(precision: str | int) -> torch.dtype:
    p = str(precision).lower()
    table = {"32": torch.float32, "fp32": torch.float32, "32-true": torch.float32,
             "bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16,
             "16": torch.float16, "fp16": torch.float16, "16-mixed": torch.float16}
    if p not in table:
        raise UserError(f"precision {precision!r}: expected 32, bf16 or 16")
    return table[p]


# --- the model side ------------------------------------------------------------------
def load_model(model: Any, device: str = "cpu"):
    """A checkpoint path, a ProteinLM or a PerformerLM -> (PerformerLM in eval mode,
    tokenizer, attention kernel name or None)."""
    kernel = None
    if isinstance(model, (str, Path)):
        from .tasks import load_checkpoint
        model = load_checkpoint(str(model), map_location="cpu")
    if hasattr(model, "model") and hasattr(model, "tokenizer"):  # ProteinLM
        hp = dict(getattr(model, "hparams", {}) or {})
        kernel = ((hp.get("model") or {}).get("attention") or {}).get("kernel")
        tokenizer, net = model.tokenizer, model.model
    else:
        tokenizer, net = Tokenizer(), model
    if kernel is None:  # a bare PerformerLM: ask its attention layers
        for m in net.modules():
            k = getattr(m, "kernel", None)
            if isinstance(k, str):
                kernel = k
                break
    net = net.to(resolve_device(device)).eval()
    return net, tokenizer, kernel


@dataclass
class Embedder:
    """Runs the model on batches of token arrays and pools the chosen layers.

    ``long_alone``: proteins with more tokens than this are embedded one at a time with
    no padding mask (for exact attention the mask would be an L x L matrix); ``None``
    picks 1024 for exact attention and never for linear kernels.
    """

    model: torch.nn.Module
    layers: list[int]
    pooling: list[str]
    per_residue: bool = False
    precision: str = "32"
    kernel: str | None = None
    long_alone: int | None = None

    def __post_init__(self):
        self.device = next(self.model.parameters()).device
        self.dtype = _dtype(self.precision)
        if self.long_alone is None:
            self.long_alone = 1024 if self.kernel == "exact" else None

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @torch.inference_mode()
    def _forward(self, batch: list[np.ndarray], pad_id: int) -> list[dict]:
        lengths = [len(t) for t in batch]
        L = max(lengths)
        tokens = torch.full((len(batch), L), pad_id, dtype=torch.long)
        for i, t in enumerate(batch):
            tokens[i, : len(t)] = torch.from_numpy(np.asarray(t, dtype=np.int64))
        tokens = tokens.to(self.device)
        padding_mask = tokens == pad_id
        if not padding_mask.any():
            padding_mask = None
        with self._autocast():
            _, hidden = self.model(tokens, padding_mask, return_layers=True)
        n = torch.tensor(lengths, device=self.device)
        pos = torch.arange(L, device=self.device)
        residue = (pos[None, :] >= 1) & (pos[None, :] < (n - 1)[:, None])  # (B, L)
        count = residue.sum(1, keepdim=True).clamp(min=1).float()
        out = [dict(pooled={p: {} for p in self.pooling}, per_residue={}) for _ in batch]
        for layer in self.layers:
            h = hidden[layer].float()
            pooled = {}
            if "mean" in self.pooling:
                pooled["mean"] = (h * residue[..., None]).sum(1) / count
            if "max" in self.pooling:
                pooled["max"] = h.masked_fill(~residue[..., None], float("-inf")).amax(1)
            if "cls" in self.pooling:
                pooled["cls"] = h[:, 0]
            pooled = {k: v.cpu().numpy() for k, v in pooled.items()}
            hc = h.cpu().numpy() if self.per_residue else None
            for i, length in enumerate(lengths):
                for p, v in pooled.items():
                    out[i]["pooled"][p][layer] = v[i].copy()
                if hc is not None:
                    out[i]["per_residue"][layer] = hc[i, 1: length - 1].copy()
        return out

    def embed_tokens(self, tokens: list[np.ndarray], token_budget: int, pad_id: int) -> Iterator[tuple[int, dict]]:
        """Yield (index into ``tokens``, result) in batch order (longest first)."""
        lengths = [len(t) for t in tokens]
        for batch in token_budget_batches(lengths, token_budget):
            if self.long_alone is not None and len(batch) > 1 and lengths[batch[0]] > self.long_alone:
                groups = [[i] for i in batch]
            else:
                groups = [batch]
            for g in groups:
                for i, r in zip(g, self._forward([tokens[i] for i in g], pad_id)):
                    yield i, r


# --- reading inputs ------------------------------------------------------------------

def build_embedder(model: Any, device: str, unknown: str, layers, pooling, per_residue: bool, precision,
                   long_alone: int | None):
    """Load the model and set up an :class:`Embedder` -> (embedder, tokenizer, kernel)."""
    net, tokenizer, kernel = load_model(model, device)
    if unknown != "error":
        tokenizer = Tokenizer(unknown=unknown)
    emb = Embedder(net, resolve_layers(layers, net.depth), resolve_pooling(pooling), per_residue, precision,
                   kernel, long_alone)
    return emb, tokenizer, kernel

@dataclass
class Item:
    id: str
    sequence: str
    source: str  # "file:line" for messages


def _read_csv(path: str | Path) -> Iterator[Item]:
    """Rows of a CSV/TSV with a ``seq`` (or ``sequence``) column and optionally ``id``;
    without ids, :func:`sequence_id` names each sequence."""
    opener = gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open
    delim = "\t" if str(path).lower().removesuffix(".gz").endswith(".tsv") else ","
    with opener(path, "rt", newline="") as fh:
        reader = csv.reader(fh, delimiter=delim)
        header = [h.strip().lower() for h in next(reader, [])]
        seq_col = next((header.index(c) for c in ("seq", "sequence") if c in header), None)
        if seq_col is None:
            raise ParseError(f"{path}:1: CSV header {header} has no 'seq' or 'sequence' column")
        id_col = header.index("id") if "id" in header else None
        for n, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) <= max(seq_col, id_col or 0):
                raise ParseError(f"{path}:{n}: expected {len(header)} columns, got {len(row)}")
            seq = row[seq_col]
            yield Item(row[id_col] if id_col is not None else sequence_id(seq), seq, f"{path}:{n}")


def read_inputs(source: Any, fmt: str | None = None, stats: dict | None = None) -> Iterator[Item]:
    """Items from a FASTA / UniProt .dat / CSV path, a dict id -> sequence, or a list of
    sequences or (id, sequence) pairs. Empty records are counted in ``stats['empty']``."""
    if isinstance(source, (str, Path)):
        name = str(source).lower().removesuffix(".gz")
        if fmt == "csv" or (fmt is None and name.endswith(CSV_SUFFIXES)):
            yield from _read_csv(source)
            return
        for rec in read_records(source, fmt, skip_empty=True, stats=stats):
            yield Item(rec.id, rec.sequence, f"{source}:{rec.line}")
        return
    if isinstance(source, dict):
        source = list(source.items())
    for n, s in enumerate(source):
        if isinstance(s, str):
            yield Item(str(n), s, f"<sequences>[{n}]")
        else:
            rid, seq = s
            yield Item(str(rid), seq, f"<sequences>[{n}]")


@dataclass
class Skips:
    """Counts (and the first few messages) of records not embedded."""

    counts: dict = field(default_factory=lambda: {"duplicate": 0, "invalid": 0, "empty": 0, "already_done": 0})
    shown: dict = field(default_factory=dict)

    def add(self, kind: str, message: str | None = None):
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if message and self.shown.get(kind, 0) < MAX_MESSAGES:
            self.shown[kind] = self.shown.get(kind, 0) + 1
            log.warning("skipped (%s): %s", kind, message)


def _tokenized(items: Iterable[Item], tokenizer: Tokenizer, skips: Skips, done: set, on_invalid: str
               ) -> Iterator[tuple[Item, np.ndarray]]:
    seen: dict[str, str] = {}
    for it in items:
        if it.id in seen:
            skips.add("duplicate", f"{it.source}: record {it.id!r} repeats the id first seen at {seen[it.id]}")
            continue
        seen[it.id] = it.source
        if it.id in done:
            skips.add("already_done")
            continue
        if not "".join(it.sequence.split()).rstrip("*"):
            skips.add("empty", f"{it.source}: record {it.id!r} has an empty sequence")
            continue
        try:
            tokens = tokenizer.encode(it.sequence, source=it.source, record=it.id)
        except InvalidSequenceError as e:
            if on_invalid == "error":
                raise
            skips.add("invalid", str(e))
            continue
        yield it, tokens


def _windows(it: Iterable, size: int) -> Iterator[list]:
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(unit="res", unit_scale=True, desc="embedding", dynamic_ncols=True, file=sys.stderr)


# --- the notebook API ----------------------------------------------------------------
def embed(model: Any, sequences: Any, *, layers: int | Sequence[int] = -1, pooling: str | Sequence[str] = "mean",
          per_residue: bool = False, token_budget: int = 16384, device: str = "cpu", precision: str = "32",
          unknown: str = "error", on_invalid: str = "error", long_alone: int | None = None,
          progress: bool = False) -> dict:
    """Embed sequences and return numpy arrays, laid out like the HDF5 file:

    ``{"ids": [...], "mean": (N, D) float32, "per_residue": {id: (L, D)}, "skipped": {...}}``

    ``model``: checkpoint path, ProteinLM or PerformerLM. ``sequences``: a FASTA / .dat /
    CSV path, a dict id -> sequence, or a list of sequences or (id, sequence) pairs.
    With several ``layers`` each pooled entry (and each per-residue entry) becomes a dict
    keyed by absolute layer number. Rows follow input order; duplicates (by id) and, with
    ``on_invalid="skip"``, invalid sequences are left out and counted in ``skipped``.
    """
    emb, tokenizer, _ = build_embedder(model, device, unknown, layers, pooling, per_residue, precision,
                                            long_alone)
    net, layers, pooling = emb.model, emb.layers, emb.pooling
    skips = Skips()
    stats: dict = {}
    pairs = list(_tokenized(read_inputs(sequences, stats=stats), tokenizer, skips, set(), on_invalid))
    skips.counts["empty"] += stats.get("empty", 0)
    results: list[dict | None] = [None] * len(pairs)
    bar = _progress(progress)
    for i, r in emb.embed_tokens([t for _, t in pairs], token_budget, tokenizer.pad_id):
        results[i] = r
        if bar is not None:
            bar.update(len(pairs[i][1]) - 2)
    if bar is not None:
        bar.close()
    single = len(layers) == 1
    D = net.embed.embedding_dim
    out: dict = {"ids": [it.id for it, _ in pairs], "layers": layers, "skipped": dict(skips.counts)}
    for p in pooling:
        arrs = {layer: (np.stack([r["pooled"][p][layer] for r in results]) if results
                        else np.zeros((0, D), np.float32)) for layer in layers}
        out[p] = arrs[layers[0]] if single else arrs
    if per_residue:
        out["per_residue"] = {it.id: (r["per_residue"][layers[0]] if single else r["per_residue"])
                              for (it, _), r in zip(pairs, results)}
    return out


# --- files: HDF5 and ESM-style <id>.pt ------------------------------------------------
class H5Writer:
    """Writes the HDF5 layout external checks rely on, atomically and resumably.

    ``ids`` (strings, input order), ``<pooling>`` (N x D float32) — or
    ``<pooling>/<layer>`` when several layers — and ``per_residue/<id>`` (L x D) —
    ``per_residue/<layer>/<id>`` with several layers; ids are escaped by
    :func:`safe_name` in member names. All writing goes to ``OUT.partial``, which
    replaces ``OUT`` only when the run finishes; an interrupted run's ``.partial`` (or a
    finished ``OUT``) is picked up and its ids skipped.
    """

    def __init__(self, path: str | Path, layers: list[int], pooling: list[str], per_residue: bool, dim: int,
                 meta: dict):
        import h5py
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.layers, self.pooling, self.per_residue, self.dim = layers, pooling, per_residue, dim
        self.config = {"layers": list(layers), "pooling": list(pooling), "per_residue": bool(per_residue),
                       "dim": int(dim)}
        self.resumed_from = None
        if self.partial.exists():
            try:
                self.f = h5py.File(self.partial, "a")
                self.resumed_from = self.partial
            except OSError as e:
                log.warning("%s: unreadable leftover of an interrupted run (%s); starting again", self.partial, e)
                self.partial.unlink()
        if self.resumed_from is None and self.path.exists():
            shutil.copyfile(self.path, self.partial)
            self.f = h5py.File(self.partial, "a")
            self.resumed_from = self.path
        if self.resumed_from is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.f = h5py.File(self.partial, "w")
            self._create(meta)
        else:
            self._check(meta)
        self.done = set(self._ids())

    def _key(self, pooling: str, layer: int) -> str:
        return pooling if len(self.layers) == 1 else f"{pooling}/{layer}"

    def _res_key(self, layer: int, rid: str) -> str:
        return f"per_residue/{safe_name(rid)}" if len(self.layers) == 1 else f"per_residue/{layer}/{safe_name(rid)}"

    def _create(self, meta: dict):
        import h5py
        self.f.create_dataset("ids", shape=(0,), maxshape=(None,), dtype=h5py.string_dtype(), chunks=(1024,))
        for p in self.pooling:
            for layer in self.layers:
                self.f.create_dataset(self._key(p, layer), shape=(0, self.dim), maxshape=(None, self.dim),
                                      dtype="float32", chunks=(256, self.dim))
        if self.per_residue:
            self.f.require_group("per_residue")
        for k, v in {**self.config, **meta}.items():
            self.f.attrs[k] = v if v is not None else ""

    def _check(self, meta: dict):
        for k, v in self.config.items():
            old = self.f.attrs.get(k)
            old = list(old) if isinstance(old, np.ndarray) else old
            if old is not None and (list(old) if isinstance(v, list) else type(v)(old)) != v:
                raise UserError(f"{self.resumed_from}: written with {k}={old}, now asked {k}={v}; "
                                 f"choose another output file to embed with different settings")
        # rows may be fewer than ids if a crash hit between resizes: keep the consistent prefix
        n = min([self.f["ids"].shape[0]] + [self.f[self._key(p, layer)].shape[0]
                                            for p in self.pooling for layer in self.layers])
        for name in ["ids"] + [self._key(p, layer) for p in self.pooling for layer in self.layers]:
            self.f[name].resize(n, axis=0)
        if self.per_residue:  # drop per-residue entries whose row was never written
            keep = {safe_name(i) for i in self._ids()}
            groups = [self.f["per_residue"]] if len(self.layers) == 1 else \
                [self.f.require_group(f"per_residue/{layer}") for layer in self.layers]
            for g in groups:
                for name in [k for k in g.keys() if k not in keep]:
                    del g[name]

    def _ids(self) -> list[str]:
        return [x.decode() if isinstance(x, bytes) else x for x in self.f["ids"][:]]

    def write_per_residue(self, rid: str, result: dict):
        if not self.per_residue:
            return
        for layer in self.layers:
            key = self._res_key(layer, rid)
            if key in self.f:
                del self.f[key]
            self.f.create_dataset(key, data=result["per_residue"][layer].astype(np.float32))

    def append_rows(self, rows: list[tuple[str, dict]]):
        """Pooled rows in input order; ids last, so a crash leaves no id without a row."""
        rows = [(rid, r) for rid, r in rows if rid not in self.done]
        if not rows:
            return
        n = self.f["ids"].shape[0]
        for p in self.pooling:
            for layer in self.layers:
                ds = self.f[self._key(p, layer)]
                ds.resize(n + len(rows), axis=0)
                ds[n:] = np.stack([r["pooled"][p][layer] for _, r in rows])
        self.f["ids"].resize(n + len(rows), axis=0)
        self.f["ids"][n:] = [rid for rid, _ in rows]
        self.done.update(rid for rid, _ in rows)
        self.f.flush()

    def close(self, complete: bool = True):
        self.f.attrs["complete"] = bool(complete)
        self.f.close()
        if complete:
            os.replace(self.partial, self.path)


class PtWriter:
    """ESM-compatible directory: one ``<id>.pt`` per protein holding ``label``,
    ``mean_representations`` / ``bos_representations`` / ``max_representations`` and,
    with per-residue output, ``representations``, each keyed by absolute layer number.
    Each file is written to a temporary name and renamed, so a file that exists is whole."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.done = {p.stem for p in self.dir.glob("*.pt")}  # escaped names

    def has(self, rid: str) -> bool:
        return safe_name(rid) in self.done

    def write(self, rid: str, result: dict):
        obj: dict = {"label": rid}
        for p, by_layer in result["pooled"].items():
            obj[PT_KEYS[p]] = {layer: torch.from_numpy(v) for layer, v in by_layer.items()}
        if result["per_residue"]:
            obj["representations"] = {layer: torch.from_numpy(v) for layer, v in result["per_residue"].items()}
        path = self.dir / f"{safe_name(rid)}.pt"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(obj, tmp)
        os.replace(tmp, path)
        self.done.add(safe_name(rid))


def embed_file(ckpt: Any, input: str | Path, output: str | Path | None = None, pt_dir: str | Path | None = None, *,
               format: str | None = None, layers: int | Sequence[int] = -1, pooling: str | Sequence[str] = "mean",
               per_residue: bool = False, token_budget: int = 16384, device: str = "cpu", precision: str = "32",
               unknown: str = "error", on_invalid: str = "skip", long_alone: int | None = None,
               sort_window: int = 20000, progress: bool = True) -> dict:
    """Embed every record of ``input`` into ``output`` (HDF5) and/or ``pt_dir``.

    Records are read as a stream and sorted by length in windows of ``sort_window``
    records, so rows keep input order without holding the whole file. Returns counts:
    embedded, residues, seconds, residues_per_s and the skipped kinds.
    """
    if output is None and pt_dir is None:
        raise UserError("nothing to write: give output=OUT.h5 and/or pt_dir=DIR")
    if on_invalid not in ("skip", "error"):
        raise UserError(f"on_invalid must be 'skip' or 'error', got {on_invalid!r}")
    emb, tokenizer, kernel = build_embedder(ckpt, device, unknown, layers, pooling, per_residue, precision,
                                            long_alone)
    net, layers, pooling = emb.model, emb.layers, emb.pooling
    meta = {"checkpoint": str(ckpt) if isinstance(ckpt, (str, Path)) else type(ckpt).__name__,
            "input": str(input), "kernel": kernel or "", "precision": str(precision)}
    h5 = H5Writer(output, layers, pooling, per_residue, net.embed.embedding_dim, meta) if output else None
    pt = PtWriter(pt_dir) if pt_dir else None
    if h5 is not None and h5.resumed_from is not None:
        log.info("resuming %s: %d ids already embedded", h5.resumed_from, len(h5.done))
    skips, stats = Skips(), {}
    items = read_inputs(input, format, stats)

    def is_done(rid: str) -> bool:
        return (h5 is None or rid in h5.done) and (pt is None or pt.has(rid))

    class _Done:  # membership test used by _tokenized without building a set of escaped ids
        def __contains__(self, rid):
            return is_done(rid)

    bar = _progress(progress)
    n_done = residues = 0
    t0 = time.perf_counter()
    complete = False
    try:
        for window in _windows(_tokenized(items, tokenizer, skips, _Done(), on_invalid), sort_window):
            results: list[dict | None] = [None] * len(window)
            for i, r in emb.embed_tokens([t for _, t in window], token_budget, tokenizer.pad_id):
                rid = window[i][0].id
                results[i] = r
                if h5 is not None and rid not in h5.done:
                    h5.write_per_residue(rid, r)
                if pt is not None and not pt.has(rid):
                    pt.write(rid, r)
                n_res = len(window[i][1]) - 2
                residues += n_res
                n_done += 1
                if bar is not None:
                    bar.update(n_res)
            if h5 is not None:
                h5.append_rows([(it.id, r) for (it, _), r in zip(window, results)])
        complete = True
    finally:
        if bar is not None:
            bar.close()
        if h5 is not None:
            h5.close(complete)
    skips.counts["empty"] += stats.get("empty", 0)
    secs = time.perf_counter() - t0
    summary = {"embedded": n_done, "residues": residues, "seconds": round(secs, 3),
               "residues_per_s": round(residues / secs, 1) if secs > 0 else None, **skips.counts}
    log.info("embedded %d proteins (%d residues) in %.1f s, %.0f residues/s; skipped: %s",
             n_done, residues, secs, residues / max(secs, 1e-9),
             ", ".join(f"{v} {k}" for k, v in skips.counts.items()) or "none")
    return summary


class _CallableModule(types.ModuleType):
    """Lets ``protein_performer.embed(...)`` call :func:`embed` although ``embed`` is
    also this module's name (importing a submodule rebinds the package attribute)."""

    def __call__(self, *args, **kwargs):
        return embed(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

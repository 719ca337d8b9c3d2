"""Embed proteins with a trained model: pooled and per-residue representations.

Why this module exists: most users embed their proteins and fit a small model on top.
It mirrors ESM's ``extract.py`` (token-budget batches sorted by length, layer selection,
mean / BOS / per-residue outputs, ``<id>.pt`` files) but never truncates: linear
attention embeds any length; exact attention runs long proteins one at a time without a
padding mask, where SDPA's flash kernel keeps memory linear in length.

Layers are numbered as ESM numbers them: 0 is the token embedding, ``depth`` the last
block after the final layer norm; negative indices count from the end (-1 = ``depth``).
Pooling runs over residues only (``<cls>`` and ``<eos>`` excluded), except ``cls``,
which is the ``<cls>`` (BOS) position, refused for causal models (there it has seen
nothing but itself, so every protein would get the same vector).

Files (:func:`embed_file`) are written only after the whole input has been read and
checked, and record what defines them (checkpoint weights, input file, layers, pooling,
precision, ...): a rerun resumes only when all of it matches. Each finished batch is
saved at once (a kill loses at most one batch) and the final file is assembled in input
order, the same whether or not the run was interrupted.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from .data.sampler import token_budget_batches
from .errors import UserError
from .inference import (LoadedModel, file_sha256, is_csv, load_model, pad_batch, read_sequences, sequence_id,
                        skipped_text, weights_sha256)
from .io import detect_format
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["embed_sequences", "embed_file", "sequence_id", "Embedder"]

POOLINGS = ("mean", "cls", "max")
#: ESM's key for each pooling in ``<id>.pt`` files
PT_KEYS = {"mean": "mean_representations", "cls": "bos_representations", "max": "max_representations"}


# --- settings ----------------------------------------------------------------------------
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

    def batches(self, lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
        """Token-budget batches, longest first; long proteins alone (``long_alone``)."""
        out = []
        for batch in token_budget_batches(lengths, max_tokens):
            if self.long_alone is not None and len(batch) > 1 and lengths[batch[0]] > self.long_alone:
                out += [[i] for i in batch]
            else:
                out.append(batch)
        return out

    @torch.inference_mode()
    def forward(self, batch: list[np.ndarray], pad_id: int) -> list[dict]:
        """One batch -> per protein ``{"pooled": {pooling: {layer: (D,)}}, "per_residue": {layer: (L, D)}}``."""
        lengths = [len(t) for t in batch]
        tokens, padding_mask = pad_batch(batch, pad_id)
        tokens = tokens.to(self.device)
        padding_mask = None if padding_mask is None else padding_mask.to(self.device)
        with self._autocast():
            _, hidden = self.model(tokens, padding_mask, return_layers=True)
        n = torch.tensor(lengths, device=self.device)
        pos = torch.arange(tokens.shape[1], device=self.device)
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


def build_embedder(loaded: LoadedModel, layers, pooling, per_residue: bool, precision, long_alone) -> Embedder:
    pooling = resolve_pooling(pooling)
    if "cls" in pooling and loaded.causal:
        raise UserError(f"pooling=cls: {loaded.source} is a causal (clm) model, whose first token sees only "
                        f"itself, so every protein would get the same vector; use mean or max")
    return Embedder(loaded.net, resolve_layers(layers, loaded.net.depth), pooling, per_residue, precision,
                    loaded.kernel, long_alone)


def _tokenizer(unknown: str) -> Tokenizer:
    return Tokenizer(unknown=unknown, unknown_key="unknown")


# --- the notebook API ----------------------------------------------------------------
def embed_sequences(model: Any, sequences: Any, *, layers: int | Sequence[int] = -1,
                    pooling: str | Sequence[str] = "mean", per_residue: bool = False, max_tokens: int = 16384,
                    device: str = "cpu", precision: str = "32", unknown: str = "error", on_invalid: str = "error",
                    long_alone: int | None = None) -> dict:
    """Embed sequences and return numpy arrays, laid out like the HDF5 file:

    ``{"ids": [...], "mean": (N, D) float32, "per_residue": {id: (L, D)}, "skipped": {...}}``

    ``model``: checkpoint path, ProteinLM or PerformerLM. ``sequences``: a FASTA / .dat /
    CSV path, a dict id -> sequence, or a list of sequences or (id, sequence) pairs.
    With several ``layers`` each pooled entry (and each per-residue entry) becomes a dict
    keyed by absolute layer number. Rows follow input order; skipped records (the policy
    of :mod:`protein_performer.inference`) are counted in ``skipped``. Nothing left to
    embed is an error.
    """
    loaded = load_model(model, device)
    emb = build_embedder(loaded, layers, pooling, per_residue, precision, long_alone)
    stats: dict = {}
    entries = list(read_sequences(sequences, tokenizer=_tokenizer(unknown), on_invalid=on_invalid, stats=stats))
    if not entries:
        raise UserError(f"nothing to embed: no valid sequences (skipped: {skipped_text(stats)})")
    results: list[dict] = [{}] * len(entries)
    for batch in emb.batches([len(e.tokens) for e in entries], max_tokens):
        for k, r in zip(batch, emb.forward([entries[k].tokens for k in batch], loaded.tokenizer.pad_id)):
            results[k] = r
    single = len(emb.layers) == 1
    out: dict = {"ids": [e.id for e in entries], "layers": emb.layers, "skipped": dict(stats)}
    for p in emb.pooling:
        arrs = {layer: np.stack([r["pooled"][p][layer] for r in results]) for layer in emb.layers}
        out[p] = arrs[emb.layers[0]] if single else arrs
    if per_residue:
        out["per_residue"] = {e.id: (r["per_residue"][emb.layers[0]] if single else r["per_residue"])
                              for e, r in zip(entries, results)}
    return out


# --- what defines an output file ----------------------------------------------------------
#: identity keys and how a refusal names them
IDENTITY = {"checkpoint_sha256": "checkpoint (weights sha256)", "input_sha256": "input (file sha256)",
            "format": "format", "unknown": "unknown", "layers": "layers", "pooling": "pooling",
            "per_residue": "per_residue", "precision": "precision", "dim": "dim"}


def _plain(v):
    """HDF5 / JSON attribute -> comparable Python value."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, bytes):
        return v.decode()
    return v.item() if isinstance(v, np.generic) else v


def differences(old: dict, new: dict) -> str:
    """'' when ``old`` (what a file records) matches ``new``, else what differs, on one line."""
    def show(key, v):
        if v is None:
            return "none recorded"
        return f"{v[:12]}..." if key.endswith("sha256") else str(v)

    out = []
    for key, name in IDENTITY.items():
        a, b = _plain(old.get(key)), _plain(new[key])
        if a != b:
            out.append(f"{name} {show(key, a)} (now {show(key, b)})")
    return "; ".join(out)


def _refuse(what: str, diff: str, path: Path):
    raise UserError(f"{what} was written with a different {diff}: write to a new output path, "
                    f"or pass overwrite=true to replace {path}")


class H5Output:
    """Writes the HDF5 layout external checks rely on, resumably.

    ``ids`` (strings, input order), ``<pooling>`` (N x D float32) — or
    ``<pooling>/<layer>`` when several layers — and ``per_residue/<id>`` (L x D) —
    ``per_residue/<layer>/<id>`` with several layers; ids are escaped by
    :func:`safe_name` in member names. Attributes: the identity (:data:`IDENTITY`) plus
    ``checkpoint``, ``input``, ``kernel`` and ``complete``.

    Each finished batch goes to ``OUT.partial/batch-NNNNNNN.npz`` (written under a
    temporary name and renamed, so a batch file that exists is whole), keyed by the
    record's position among the input's valid records. :meth:`finish` assembles ``OUT``
    from them in input order and removes ``OUT.partial``.
    """

    def __init__(self, path: str | Path, identity: dict, attrs: dict, overwrite: bool):
        self.path = Path(path)
        self.journal = self.path.with_name(self.path.name + ".partial")
        self.identity, self.attrs = identity, attrs
        self.layers, self.pooling = identity["layers"], identity["pooling"]
        self.done: set[int] = set()
        self.complete = False
        check_output_path(self.path)
        if self.path.exists() and not overwrite:
            diff = differences(read_h5_identity(self.path), identity)
            if diff:
                _refuse(str(self.path), diff, self.path)
            self.complete = True  # the same embeddings: nothing to do
            return
        if self.journal.exists():
            info = self.journal / "identity.json"
            old = json.loads(info.read_text()) if self.journal.is_dir() and info.is_file() else {}
            diff = differences(old, identity)
            if diff and not overwrite:
                _refuse(f"{self.journal} (left by an interrupted run)", diff, self.journal)
            if overwrite:
                shutil.rmtree(self.journal) if self.journal.is_dir() else self.journal.unlink()
            for f in self._batch_files():  # resume: what the interrupted run finished
                with np.load(f) as z:
                    self.done.update(int(i) for i in z["index"])
        self.n_files = len(self._batch_files())

    def _batch_files(self) -> list[Path]:
        return sorted(self.journal.glob("batch-*.npz")) if self.journal.is_dir() else []

    def _key(self, pooling: str, layer: int) -> str:
        return pooling if len(self.layers) == 1 else f"{pooling}/{layer}"

    def _res_key(self, layer: int, rid: str) -> str:
        return f"per_residue/{safe_name(rid)}" if len(self.layers) == 1 else f"per_residue/{layer}/{safe_name(rid)}"

    def write_batch(self, index: list[int], results: list[dict]):
        """Save one finished batch (``index``: positions among the valid records)."""
        if not self.journal.exists():
            self.journal.mkdir(parents=True)
            (self.journal / "identity.json").write_text(json.dumps(self.identity))
        arrays = {"index": np.asarray(index, dtype=np.int64)}
        for p in self.pooling:
            for layer in self.layers:
                arrays[f"pooled|{p}|{layer}"] = np.stack([r["pooled"][p][layer] for r in results])
        if self.identity["per_residue"]:
            for j, r in enumerate(results):
                for layer in self.layers:
                    arrays[f"res|{layer}|{j}"] = r["per_residue"][layer].astype(np.float32)
        path = self.journal / f"batch-{self.n_files:07d}.npz"
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
        self.n_files += 1
        self.done.update(index)

    def finish(self, ids: list[str]):
        """Assemble ``OUT`` in input order from the saved batches, then drop ``OUT.partial``."""
        import h5py
        if self.complete:
            return
        n, dim = len(ids), self.identity["dim"]
        tmp = self.journal / "assembled.h5"
        written = np.zeros(n, dtype=bool)
        with h5py.File(tmp, "w") as f:
            f.create_dataset("ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
            sets = {(p, layer): f.create_dataset(self._key(p, layer), shape=(n, dim), dtype="float32")
                    for p in self.pooling for layer in self.layers}
            for path in self._batch_files():
                with np.load(path) as z:
                    index = z["index"]
                    order = np.argsort(index)
                    for (p, layer), ds in sets.items():
                        ds[index[order]] = z[f"pooled|{p}|{layer}"][order]
                    if self.identity["per_residue"]:
                        for j, i in enumerate(index):
                            for layer in self.layers:
                                f.create_dataset(self._res_key(layer, ids[i]), data=z[f"res|{layer}|{j}"])
                written[index] = True
            if not written.all():
                raise RuntimeError(f"{self.journal}: {int((~written).sum())} records were never embedded")
            for k, v in {**self.identity, **self.attrs, "complete": True}.items():
                f.attrs[k] = v
        os.replace(tmp, self.path)
        shutil.rmtree(self.journal)


def check_output_path(path: Path):
    """Refuse an output that is a directory or an existing file that is not HDF5."""
    if path.is_dir():
        raise UserError(f"output {path}: is a directory; give a file name such as {path / 'embeddings.h5'}")
    if path.exists():
        read_h5_identity(path)


def read_h5_identity(path: Path) -> dict:
    import h5py
    try:
        with h5py.File(path, "r") as f:
            return dict(f.attrs)
    except OSError:
        raise UserError(f"output {path}: exists and is not an HDF5 file; refusing to replace it "
                        f"(choose another output path)") from None


class PtOutput:
    """ESM-compatible directory: one ``<id>.pt`` per protein holding ``label``,
    ``mean_representations`` / ``bos_representations`` / ``max_representations`` and,
    with per-residue output, ``representations``, each keyed by absolute layer number.
    Each file is written to a temporary name and renamed, so a file that exists is whole.
    ``embed_settings.json`` records the identity; files of another identity are refused
    (``overwrite``: they are deleted first)."""

    def __init__(self, directory: str | Path, identity: dict, overwrite: bool):
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise UserError(f"pt_dir {self.dir}: exists and is not a directory")
        info = self.dir / "embed_settings.json"
        existing = list(self.dir.glob("*.pt")) if self.dir.is_dir() else []
        if existing or info.is_file():
            diff = differences(json.loads(info.read_text()) if info.is_file() else {}, identity)
            if diff and not overwrite:
                _refuse(f"pt_dir {self.dir}", diff, self.dir)
            if overwrite:
                for p in existing:
                    p.unlink()
                existing = []
        self.dir.mkdir(parents=True, exist_ok=True)
        info.write_text(json.dumps(identity))
        self.done = {p.stem for p in existing}  # escaped names

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


# --- the command ------------------------------------------------------------------------
def _windows(it: Iterable, size: int) -> Iterator[list]:
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf


def embed_file(ckpt: Any, input: str | Path, output: str | Path | None = None, pt_dir: str | Path | None = None, *,
               format: str | None = None, layers: int | Sequence[int] = -1, pooling: str | Sequence[str] = "mean",
               per_residue: bool = False, max_tokens: int = 16384, device: str = "cpu", precision: str = "32",
               unknown: str = "error", on_invalid: str = "skip", long_alone: int | None = None,
               sort_records: int = 20000, overwrite: bool = False, progress: bool = True) -> dict:
    """Embed every record of ``input`` into ``output`` (HDF5) and/or ``pt_dir``.

    The input is read twice: once to check every record (and count the work), then as a
    stream sorted by length in windows of ``sort_records`` records. Batches are the same
    in a resumed run as in a clean one, so their numbers are too. Returns counts:
    embedded, residues, seconds, residues_per_s, already_done and the skipped kinds.
    """
    if output is None and pt_dir is None:
        raise UserError("nothing to write: give output=OUT.h5 and/or pt_dir=DIR")
    if output is not None:
        check_output_path(Path(output))
    loaded = load_model(ckpt, device)
    emb = build_embedder(loaded, layers, pooling, per_residue, precision, long_alone)
    tokenizer, pad_id = _tokenizer(unknown), loaded.tokenizer.pad_id

    # pass 1: every record checked before any output exists
    stats: dict = {}
    ids, lengths = [], []
    for e in read_sequences(input, format, tokenizer=tokenizer, on_invalid=on_invalid, stats=stats):
        ids.append(e.id)
        lengths.append(len(e.tokens))
    if not ids:
        raise UserError(f"{input}: no sequences to embed (skipped: {skipped_text(stats)})")
    format = format or ("tsv" if str(input).lower().removesuffix(".gz").endswith(".tsv") else "csv"
                     if is_csv(input) else detect_format(input))
    identity = {"checkpoint_sha256": weights_sha256(loaded.net), "input_sha256": file_sha256(input), "format": format,
                "unknown": unknown, "layers": emb.layers, "pooling": emb.pooling, "per_residue": bool(per_residue),
                "precision": str(emb.dtype).removeprefix("torch."), "dim": int(loaded.net.embed.embedding_dim)}
    attrs = {"checkpoint": loaded.source, "input": str(input), "kernel": loaded.kernel or ""}
    h5 = H5Output(output, identity, attrs, overwrite) if output is not None else None
    pt = PtOutput(pt_dir, identity, overwrite) if pt_dir is not None else None

    def done(i: int) -> bool:
        return (h5 is None or h5.complete or i in h5.done) and (pt is None or pt.has(ids[i]))

    # batches: windows of the whole input (done records included), so they never depend on a resume
    plan = []
    for start in range(0, len(ids), sort_records):
        window = lengths[start:start + sort_records]
        plan.append([[start + k for k in b] for b in emb.batches(window, max_tokens)])
    todo = {i for window in plan for b in window if not all(done(i) for i in b) for i in b}
    already = len(ids) - len(todo)
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(lengths[i] - 2 for i in todo), unit="res", unit_scale=True, desc="embedding",
                   dynamic_ncols=True, file=sys.stderr)
    if h5 is not None and h5.done:
        log.info("resuming %s: %d of %d proteins already embedded", h5.journal, len(h5.done), len(ids))
    n_done = residues = 0
    t0 = time.perf_counter()
    try:
        if todo:  # pass 2
            entries = read_sequences(input, format, tokenizer=tokenizer, on_invalid=on_invalid, warn=False)
            for batches, window in zip(plan, _windows(enumerate(entries), sort_records)):
                for batch in batches:
                    if not any(i in todo for i in batch):
                        continue
                    start = window[0][0]
                    toks = [window[i - start][1].tokens for i in batch]
                    if any(window[i - start][1].id != ids[i] for i in batch):
                        raise UserError(f"{input}: the file changed while it was being embedded")
                    results = emb.forward(toks, pad_id)
                    if h5 is not None and not h5.complete:
                        h5.write_batch(batch, results)
                    for i, r in zip(batch, results):
                        if pt is not None and not pt.has(ids[i]):
                            pt.write(ids[i], r)
                    n_res = sum(lengths[i] - 2 for i in batch)
                    residues += n_res
                    n_done += len(batch)
                    if bar is not None:
                        bar.update(n_res)
        if h5 is not None:
            h5.finish(ids)
    finally:
        if bar is not None:
            bar.close()
    secs = time.perf_counter() - t0
    summary = {"embedded": n_done, "residues": residues, "seconds": round(secs, 3),
               "residues_per_s": round(residues / secs, 1) if secs > 0 and residues else None,
               "already_done": already, **{k: stats[k] for k in ("duplicate", "invalid", "empty")}}
    log.info("embedded %d proteins (%d residues) in %.1f s; %d already done; skipped: %s",
             n_done, residues, secs, already, skipped_text(stats))
    return summary

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

Files (:func:`embed_file`) are written only after every setting and the whole input have
been checked, and record what defines them (the model's weights and config, input file,
layers, pooling, precision, ...): a rerun resumes only when all of it matches. Each
finished batch is saved at once (a kill loses at most one batch), keyed by protein (its
position in the input), so a rerun with another ``max_tokens`` or ``sort_records`` embeds
only the proteins still missing; the final file is assembled in input order, the same
whether or not the run was interrupted. One process writes an output at a time (a lock
beside it), and an ``overwrite`` removes only what an earlier embed run recorded writing.
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
from .device import resolve_device
from .errors import UserError
from .files import WrittenFiles, atomic_path, exclusive_lock, file_sha256, remove_path
from .hub.load import LoadedModel, load_model, weights_sha256
from .sequences import is_csv, read_sequences, sequence_id, skipped_text
from .data.collate import pad_batch
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


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def resolve_layers(layers: int | Sequence[int], depth: int | None) -> list[int]:
    """ESM-style absolute layer numbers 0..depth from possibly negative indices (``depth``
    None: only check that ``layers`` is one integer or a non-empty list of them)."""
    if _is_int(layers):
        layers = [int(layers)]
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers \
            or not all(_is_int(x) for x in layers):
        raise UserError(f"layers={_show(layers)}: expected an integer or a non-empty list of integers "
                        f"(0 = token embedding, -1 = last block), e.g. layers=[-1] or layers=[-2,-1]")
    out = []
    for layer in layers:
        a = int(layer) + depth + 1 if int(layer) < 0 and depth is not None else int(layer)
        if depth is not None and not 0 <= a <= depth:
            raise UserError(f"layer {layer} does not exist: the model has layers 0..{depth} "
                            f"(0 = embedding, {depth} = last block) or -{depth + 1}..-1")
        if a not in out:
            out.append(a)
    return out


def resolve_pooling(pooling: str | Sequence[str]) -> list[str]:
    pooling = [pooling] if isinstance(pooling, str) else pooling
    if not isinstance(pooling, Sequence) or not pooling:
        raise UserError(f"pooling={_show(pooling)}: expected one or more of {', '.join(POOLINGS)}, "
                        f"e.g. pooling=[mean] (without it the output would hold only ids)")
    for p in pooling:
        if p not in POOLINGS:
            raise UserError(f"pooling {p!r} is not one of {', '.join(POOLINGS)}")
    return list(dict.fromkeys(pooling))


def _show(v) -> str:
    """A setting as the user typed it (``[]``, ``[1.7]``), for messages."""
    return json.dumps(list(v) if isinstance(v, (list, tuple)) else v, default=str)


def check_settings(*, layers, pooling, per_residue, max_tokens, precision, unknown, on_invalid, long_alone,
                   sort_records, overwrite, progress, format, device="cpu") -> None:
    """Every setting of :func:`embed_file` checked before anything is loaded or written: one
    line naming the key (the layer range is checked once the model's depth is known)."""
    resolve_layers(layers, None)
    resolve_pooling(pooling)
    _dtype(precision)
    _tokenizer(unknown)
    for key, v in dict(per_residue=per_residue, overwrite=overwrite, progress=progress).items():
        if not isinstance(v, (bool, np.bool_)):
            raise UserError(f"{key}={_show(v)}: expected true or false")
    for key, v, none_ok in (("max_tokens", max_tokens, False), ("sort_records", sort_records, False),
                            ("long_alone", long_alone, True)):
        if not (v is None and none_ok) and not (_is_int(v) and v >= 1):
            raise UserError(f"{key}={_show(v)}: expected a positive integer" + (" or null" if none_ok else ""))
    if on_invalid not in ("error", "skip"):
        raise UserError(f"on_invalid={_show(on_invalid)}: expected error or skip")
    if format not in (None, "fasta", "uniprot", "csv", "tsv"):
        raise UserError(f"format={_show(format)}: expected fasta, uniprot, csv, tsv or null (detected)")
    try:
        resolve_device(device)
    except RuntimeError:
        raise UserError(f"device={_show(device)}: expected auto, cpu, cuda or cuda:N") from None


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


def _tokenizer(unknown: str, like: Tokenizer = Tokenizer()) -> Tokenizer:
    """The model's tokenizer (its vocabulary: a model converted from ESM reads ESM's ids) with ``unknown``."""
    return Tokenizer(unknown=unknown, unknown_key="unknown", vocabulary=like.vocabulary)


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
    of :mod:`protein_performer.sequences`) are counted in ``skipped``. Nothing left to
    embed is an error.
    """
    loaded = load_model(model, device)
    emb = build_embedder(loaded, layers, pooling, per_residue, precision, long_alone)
    stats: dict = {}
    entries = list(read_sequences(sequences, tokenizer=_tokenizer(unknown, loaded.tokenizer), on_invalid=on_invalid, stats=stats))
    if not entries:
        raise UserError(f"nothing to embed: no valid sequences (skipped: {skipped_text(stats)})")
    results: list[dict] = [{}] * len(entries)
    for batch in emb.batches([len(e.tokens) for e in entries], max_tokens):
        for k, r in zip(batch, emb.forward([entries[k].tokens for k in batch], loaded.tokenizer.pad_id)):
            check_finite(r, entries[k].id, entries[k].where, precision)
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
IDENTITY = {"checkpoint_sha256": "checkpoint (weights sha256)", "model_config": "model config",
            "input_sha256": "input (file sha256)", "format": "format", "unknown": "unknown", "layers": "layers",
            "pooling": "pooling", "per_residue": "per_residue", "precision": "precision", "dim": "dim"}


def model_config(net: torch.nn.Module) -> str:
    """The settings that define the model (kernel, causal, sizes, ...) as canonical JSON. With
    the weights, what makes two loads "the same model": an exported directory whose config.json
    was edited loads the very same tensors into another model."""
    config = getattr(net, "config", None)
    return json.dumps(config.to_dict() if config is not None else {}, sort_keys=True)


def _plain(v):
    """HDF5 / JSON attribute -> comparable Python value."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, bytes):
        return v.decode()
    return v.item() if isinstance(v, np.generic) else v


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def differences(old: dict, new: dict) -> str:
    """'' when ``old`` (what a file records) matches ``new``, else what differs, on one line."""
    def show(key, v):
        if v is None:
            return "none recorded"
        return f"{v[:12]}..." if key.endswith("sha256") else str(v)

    out = []
    for key, name in IDENTITY.items():
        a, b = _plain(old.get(key)), _plain(new[key])
        if a == b:
            continue
        try:  # the model config: name the settings that differ
            fa, fb = _flat(json.loads(a)), _flat(json.loads(b))
            out += [f"{name} {k} {fa.get(k)} (now {fb.get(k)})" for k in sorted(set(fa) | set(fb))
                    if fa.get(k) != fb.get(k)]
        except (TypeError, ValueError, AttributeError):
            out.append(f"{name} {show(key, a)} (now {show(key, b)})" if key != "model_config" else
                       f"{name} none recorded")
    return "; ".join(out)


def _refuse(what: str, diff: str, path: Path):
    raise UserError(f"{what} was written with a different {diff}: write to a new output path, "
                    f"or pass overwrite=true to replace {path}")


def lock_path(output: str | Path) -> Path:
    """The lock that gives ``output`` one writer at a time (beside it: it outlives the run, harmlessly)."""
    return Path(f"{output}.lock")


class H5Output:
    """Writes the HDF5 layout external checks rely on, resumably.

    ``ids`` (strings, input order), ``<pooling>`` (N x D float32) — or
    ``<pooling>/<layer>`` when several layers — and ``per_residue/<id>`` (L x D) —
    ``per_residue/<layer>/<id>`` with several layers; ids are escaped by
    :func:`safe_name` in member names. Attributes: the identity (:data:`IDENTITY`) plus
    ``checkpoint``, ``input``, ``kernel`` and ``complete``.

    The journal ``OUT.partial/`` holds ``identity.json`` and one ``batch-NNNNNNN.npz`` per
    finished batch (written beside and renamed, so a batch file that exists is whole; plain
    arrays, read with ``allow_pickle=False``): ``index``, the positions of its proteins among
    the input's valid records, and their arrays. Each protein is saved once, whatever the
    batches of the run that resumes; :meth:`finish` assembles ``OUT`` in input order (a
    protein found twice is taken once) and removes the journal. The constructor only checks;
    :meth:`open` (once every output has been checked) is the first change on disk.
    """

    def __init__(self, path: str | Path, identity: dict, attrs: dict, overwrite: bool, n: int):
        self.path = Path(path)
        self.journal = self.path.with_name(self.path.name + ".partial")
        self.identity, self.attrs, self.n = identity, attrs, n
        self.layers, self.pooling = identity["layers"], identity["pooling"]
        self.done: set[int] = set()
        self.complete = self.path.exists() and not overwrite
        if self.complete:
            diff = differences(read_h5_identity(self.path), identity)
            if diff:
                _refuse(str(self.path), diff, self.path)
        self.drop_journal = False
        if os.path.lexists(self.journal):
            diff = differences(self._journal_identity(), identity)
            if diff and not overwrite and not self.complete:
                _refuse(f"{self.journal} (left by an interrupted run)", diff, self.journal)
            # overwrite, or the leftover of the run that completed OUT: ours to remove
            self.drop_journal = overwrite or (self.complete and not diff)
            if not self.drop_journal and not self.complete:
                for f in self._batch_files():  # resume: what the interrupted run finished
                    with self._load(f) as z:
                        self.done.update(self._index(z, f).tolist())

    def _journal_identity(self) -> dict:
        info = self.journal / "identity.json"
        old = None
        if self.journal.is_dir() and not self.journal.is_symlink() and info.is_file():
            with contextlib.suppress(ValueError):
                old = json.loads(info.read_text(encoding="utf-8", errors="replace"))
        if not isinstance(old, dict):
            raise UserError(f"{self.journal}: exists and is not a journal left by embed (no readable "
                            f"identity.json); refusing to touch it: move it or choose another output")
        return old

    def _batch_files(self) -> list[Path]:
        return sorted(self.journal.glob("batch-*.npz")) if self.journal.is_dir() else []

    def _bad(self, path: Path, why: str):
        return UserError(f"{path}: not a readable journal batch of this input ({why}); pass overwrite=true "
                         f"to embed {self.path} again from the start")

    def _load(self, path: Path):
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise self._bad(path, type(e).__name__) from None

    def _array(self, z, key: str, path: Path) -> np.ndarray:
        """One array of a batch file: plain numbers only (an object array is refused, never unpickled)."""
        try:
            a = z[key]
        except (KeyError, OSError, ValueError) as e:
            raise self._bad(path, f"{key}: {type(e).__name__}") from None
        if a.dtype.kind not in "iuf":
            raise self._bad(path, f"{key}: dtype {a.dtype}")
        return a

    def _index(self, z, path: Path) -> np.ndarray:
        index = self._array(z, "index", path)
        if index.ndim != 1 or index.dtype.kind not in "iu" or \
                (index.size and not (0 <= index.min() and index.max() < self.n)):
            raise self._bad(path, "bad index")
        return index.astype(np.int64)

    def open(self):
        if self.drop_journal:
            remove_path(self.journal)
        files = self._batch_files()
        self.n_files = int(files[-1].stem.split("-")[1]) + 1 if files else 0

    def _key(self, pooling: str, layer: int) -> str:
        return pooling if len(self.layers) == 1 else f"{pooling}/{layer}"

    def _res_key(self, layer: int, rid: str) -> str:
        return f"per_residue/{safe_name(rid)}" if len(self.layers) == 1 else f"per_residue/{layer}/{safe_name(rid)}"

    def write_batch(self, index: list[int], results: list[dict]):
        """Save the proteins of one batch not saved before (``index``: positions among the valid records)."""
        if not index:
            return
        if not self.journal.exists():
            with atomic_path(self.journal) as tmp:
                tmp.mkdir()
                (tmp / "identity.json").write_text(json.dumps(self.identity))
        arrays = {"index": np.asarray(index, dtype=np.int64)}
        for p in self.pooling:
            for layer in self.layers:
                arrays[f"pooled|{p}|{layer}"] = np.stack([r["pooled"][p][layer] for r in results])
        if self.identity["per_residue"]:
            for j, r in enumerate(results):
                for layer in self.layers:
                    arrays[f"res|{layer}|{j}"] = r["per_residue"][layer].astype(np.float32)
        with atomic_path(self.journal / f"batch-{self.n_files:07d}.npz") as tmp, open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        self.n_files += 1
        self.done.update(index)

    def finish(self, ids: list[str]):
        """Assemble ``OUT`` in input order from the saved batches, then drop ``OUT.partial``."""
        import h5py
        if self.complete:
            return
        n, dim = len(ids), self.identity["dim"]
        # assembled inside the journal (ours), so a kill at any point leaves nothing beside OUT
        tmp = self.journal / "assembled.h5"
        written = np.zeros(n, dtype=bool)
        with h5py.File(tmp, "w") as f:
            f.create_dataset("ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
            sets = {(p, layer): f.create_dataset(self._key(p, layer), shape=(n, dim), dtype="float32")
                    for p in self.pooling for layer in self.layers}
            for path in self._batch_files():
                with self._load(path) as z:
                    index = self._index(z, path)
                    new = np.flatnonzero(~written[index])
                    new = new[np.argsort(index[new])]  # h5py writes rows in increasing order
                    if not len(new):
                        continue
                    for (p, layer), ds in sets.items():
                        ds[index[new]] = self._array(z, f"pooled|{p}|{layer}", path)[new]
                    if self.identity["per_residue"]:
                        for j in new:
                            for layer in self.layers:
                                f.create_dataset(self._res_key(layer, ids[index[j]]),
                                                 data=self._array(z, f"res|{layer}|{j}", path))
                    written[index[new]] = True
            if not written.all():
                raise RuntimeError(f"{self.journal}: {int((~written).sum())} records were never embedded")
            for k, v in {**self.identity, **self.attrs, "complete": True}.items():
                f.attrs[k] = v
        os.replace(tmp, self.path)
        remove_path(self.journal)


def check_output_path(path: Path):
    """Refuse an output that is a directory or an existing file that embed did not write."""
    if path.is_dir():
        raise UserError(f"output {path}: is a directory; give a file name such as {path / 'embeddings.h5'}")
    if path.exists() and "checkpoint_sha256" not in read_h5_identity(path):  # a user's own HDF5 file
        raise UserError(f"output {path}: an HDF5 file that embed did not write (no embed attributes); "
                        f"refusing to replace it, overwrite or not: choose another output path")


def read_h5_identity(path: Path) -> dict:
    import h5py
    try:
        with h5py.File(path, "r") as f:
            return dict(f.attrs)
    except OSError:
        raise UserError(f"output {path}: exists and is not an HDF5 file; refusing to replace it "
                        f"(choose another output path)") from None


def check_output_paths(output, pt_dir, input, ckpt) -> None:
    """Before anything is loaded: no output below a regular file, an HDF5 output that is a file
    (new, or HDF5), a pt_dir that is a folder, and no output (or its journal / lock) that is the
    input or the checkpoint."""
    sources = {Path(x).resolve(): what for x, what in ((input, "input"), (ckpt, "ckpt"))
               if isinstance(x, (str, Path))}
    for key, path in (("output", output), ("pt_dir", pt_dir)):
        if path is None:
            continue
        path = Path(path)
        above = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if above is not None:
            raise UserError(f"{key} {path}: {above} is a file, not a folder")
        mine = [path] + ([path.with_name(path.name + ".partial"), lock_path(path)] if key == "output" else [])
        for p in mine:
            if p.resolve() in sources:
                raise UserError(f"{key} {path}: {p} is the {sources[p.resolve()]} itself; choose another {key}")
    if output is not None:
        check_output_path(Path(output))
    if pt_dir is not None and Path(pt_dir).exists() and not Path(pt_dir).is_dir():
        raise UserError(f"pt_dir {pt_dir}: exists and is not a directory")
    if output is not None and pt_dir is not None and Path(output).resolve() == Path(pt_dir).resolve():
        raise UserError(f"output {output} and pt_dir {pt_dir} are the same path; give two")


def check_name(entry, key: str, pt: bool) -> None:
    """Per-residue members and ``<id>.pt`` files are named by the id: refuse, naming the
    record, an id that cannot name one (before anything is written)."""
    if not entry.id:
        raise UserError(f"{entry.where}: record has an empty id, and {key} names each protein by its id: "
                        f"give it one (or drop the id column: ids are then derived from the sequences)")
    if pt:
        size = len(f"{safe_name(entry.id)}.pt".encode())
        if size > NAME_MAX:
            raise UserError(f"{entry.where}: record {entry.id[:40] + '...'!r}: its id makes a {size}-byte file "
                            f"name in pt_dir, over the {NAME_MAX}-byte limit; shorten it or use output=OUT.h5")


#: the longest file name (bytes) of the usual file systems (ext4, xfs, btrfs, APFS, NTFS)
NAME_MAX = 255


class PtOutput:
    """ESM-compatible directory: one ``<id>.pt`` per protein holding ``label``,
    ``mean_representations`` / ``bos_representations`` / ``max_representations`` and,
    with per-residue output, ``representations``, each keyed by absolute layer number.

    Every file embed puts there is recorded first in ``.protein-performer-written.json``
    (:class:`~protein_performer.files.WrittenFiles`; all of a run's names at its start, one
    journal write however many proteins): ``overwrite`` removes those and nothing else, and a
    ``.pt`` a user put there is never replaced (refused before work starts). Files
    are written in ``.protein-performer-tmp/`` (recorded) and renamed into place, so a file that
    exists is whole and a kill leaves nothing unrecorded. ``embed_settings.json`` records the
    identity; files of another identity are refused (``overwrite``: removed first). The
    constructor only checks; :meth:`open` is the first change on disk."""

    WRITTEN, SETTINGS, STAGING, LOCK = (".protein-performer-written.json", "embed_settings.json",
                                        ".protein-performer-tmp", ".protein-performer.lock")

    def __init__(self, directory: str | Path, identity: dict, overwrite: bool, names: list[str]):
        self.dir, self.identity, self.overwrite = Path(directory), identity, overwrite
        self.written = WrittenFiles(self.dir / self.WRITTEN)
        self.settings, self.staging = self.dir / self.SETTINGS, self.dir / self.STAGING
        self.files = [self.dir / f"{n}.pt" for n in names]
        for p in [self.settings, self.staging] + self.files:
            if os.path.lexists(p) and p not in self.written:
                raise UserError(f"pt_dir {p}: exists and was not written by embed (not recorded in "
                                f"{self.WRITTEN}); refusing to replace it: move it or choose another pt_dir")
        self.old = {}
        if self.settings.is_file():
            with contextlib.suppress(ValueError):
                self.old = json.loads(self.settings.read_text())
        mine = [k for k in self.written.paths if k.endswith(".pt") and (self.dir / k).is_file()]
        self.diff = differences(self.old, identity) if mine else ""  # settings matter once files exist
        if self.diff and not overwrite:
            _refuse(f"pt_dir {self.dir}", self.diff, self.dir)
        self.done = set() if overwrite else {k[: -len(".pt")] for k in mine}  # escaped names

    def open(self):
        if self.overwrite:
            self.written.remove_all()  # only what earlier embed runs recorded writing
        self.written.record(self.settings, self.staging, *(p for p in self.files if p.stem not in self.done))
        remove_path(self.staging)  # what a killed run left half-written
        self.staging.mkdir()
        if self.overwrite or differences(self.old, self.identity):
            self._put(self.settings, lambda p: p.write_text(json.dumps(self.identity)))

    def _put(self, path: Path, write):
        tmp = self.staging / path.name  # the staging folder is ours: a kill leaves nothing beside
        write(tmp)
        os.replace(tmp, path)

    def close(self):
        remove_path(self.staging)

    def has(self, rid: str) -> bool:
        return safe_name(rid) in self.done

    def write(self, items: list[tuple[str, dict]]):
        """Write ``(id, result)`` pairs (their names were recorded by :meth:`open`)."""
        for rid, result in items:
            path = self.dir / f"{safe_name(rid)}.pt"
            obj: dict = {"label": rid}
            for p, by_layer in result["pooled"].items():
                obj[PT_KEYS[p]] = {layer: torch.from_numpy(v) for layer, v in by_layer.items()}
            if result["per_residue"]:
                obj["representations"] = {layer: torch.from_numpy(v) for layer, v in result["per_residue"].items()}
            self._put(path, lambda tmp: torch.save(obj, tmp))
            self.done.add(safe_name(rid))


def check_finite_weights(loaded: LoadedModel) -> None:
    for name, t in loaded.net.state_dict().items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UserError(f"checkpoint {loaded.source}: {name} holds NaN or inf values, so every embedding "
                            f"would be NaN")


def check_finite(result: dict, rid: str, where: str, precision) -> None:
    """A protein whose embedding holds NaN / inf is an error naming it, before anything of it is saved."""
    arrays = [v for by_layer in result["pooled"].values() for v in by_layer.values()]
    arrays += list(result["per_residue"].values())
    if not all(np.isfinite(a).all() for a in arrays):
        hint = "" if _dtype(precision) == torch.float32 else f" (precision={precision} overflowed? try precision=32)"
        raise UserError(f"{where}: record {rid!r}: the model's embedding holds NaN or inf values{hint}; "
                        f"nothing was written for it")


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

    Every setting, path and record is checked before anything is written. The input is read
    twice: once to check every record (and count the work), then as a stream sorted by length
    in windows of ``sort_records`` records. A batch with any protein still missing runs whole
    (the same numbers as in a clean run); only the missing proteins are saved. Returns counts:
    embedded, residues, seconds, residues_per_s, already_done and the skipped kinds.
    """
    check_settings(layers=layers, pooling=pooling, per_residue=per_residue, max_tokens=max_tokens,
                   precision=precision, unknown=unknown, on_invalid=on_invalid, long_alone=long_alone,
                   sort_records=sort_records, overwrite=overwrite, progress=progress, format=format, device=device)
    if output is None and pt_dir is None:
        raise UserError("nothing to write: give output=OUT.h5 and/or pt_dir=DIR")
    check_output_paths(output, pt_dir, input, ckpt)
    loaded = load_model(ckpt, device)
    check_finite_weights(loaded)
    emb = build_embedder(loaded, layers, pooling, per_residue, precision, long_alone)
    tokenizer, pad_id = _tokenizer(unknown, loaded.tokenizer), loaded.tokenizer.pad_id

    # pass 1: every record checked before any output exists
    stats: dict = {}
    ids, lengths = [], []
    name_key = "pt_dir" if pt_dir is not None else "per_residue" if per_residue else None
    for e in read_sequences(input, format, tokenizer=tokenizer, on_invalid=on_invalid, stats=stats):
        if name_key:
            check_name(e, name_key, pt_dir is not None)
        ids.append(e.id)
        lengths.append(len(e.tokens))
    if not ids:
        raise UserError(f"{input}: no sequences to embed (skipped: {skipped_text(stats)})")
    format = format or ("tsv" if str(input).lower().removesuffix(".gz").endswith(".tsv") else "csv"
                     if is_csv(input) else detect_format(input))
    identity = {"checkpoint_sha256": weights_sha256(loaded.net), "model_config": model_config(loaded.net),
                "input_sha256": file_sha256(input), "format": format, "unknown": unknown, "layers": emb.layers,
                "pooling": emb.pooling, "per_residue": bool(per_residue),
                "precision": str(emb.dtype).removeprefix("torch."), "dim": int(loaded.net.embed.embedding_dim)}
    attrs = {"checkpoint": loaded.source, "input": str(input), "kernel": loaded.kernel or ""}
    with contextlib.ExitStack() as stack:  # one writer per output; every output checked before any is touched
        h5 = pt = None
        if output is not None:
            stack.enter_context(exclusive_lock(lock_path(output), what=f"output {output}"))
            h5 = H5Output(output, identity, attrs, overwrite, len(ids))
        if pt_dir is not None:
            stack.enter_context(exclusive_lock(Path(pt_dir) / PtOutput.LOCK, what=f"pt_dir {pt_dir}"))
            pt = PtOutput(pt_dir, identity, overwrite, [safe_name(i) for i in ids])
        for out in (h5, pt):
            if out is not None:
                out.open()
        if pt is not None:
            stack.callback(pt.close)
        return _embed(emb, input, format, tokenizer, on_invalid, ids, lengths, stats, h5, pt, pad_id,
                      max_tokens, sort_records, precision, progress)


def _embed(emb: Embedder, input, format, tokenizer, on_invalid, ids, lengths, stats, h5, pt, pad_id, max_tokens,
           sort_records, precision, progress) -> dict:
    """Pass 2 of :func:`embed_file`: the proteins not yet in every output, then the HDF5 file."""
    def done(i: int) -> bool:
        return (h5 is None or h5.complete or i in h5.done) and (pt is None or pt.has(ids[i]))

    # batches: windows of the whole input (done records included), so they never depend on a resume
    plan = []
    for start in range(0, len(ids), sort_records):
        window = lengths[start:start + sort_records]
        plan.append([[start + k for k in b] for b in emb.batches(window, max_tokens)])
    todo = {i for i in range(len(ids)) if not done(i)}
    already = len(ids) - len(todo)
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(lengths[i] - 2 for i in todo), unit="res", unit_scale=True, desc="embedding",
                   dynamic_ncols=True, file=sys.stderr)
    if already:
        log.info("resuming: %d of %d proteins already embedded", already, len(ids))
    n_done = residues = 0
    t0 = time.perf_counter()
    try:
        if todo:  # pass 2
            entries = read_sequences(input, format, tokenizer=tokenizer, on_invalid=on_invalid, warn=False)
            for batches, window in zip(plan, _windows(enumerate(entries), sort_records)):
                start = window[0][0]
                for batch in batches:
                    new = [i for i in batch if i in todo]
                    if not new:
                        continue
                    if any(window[i - start][1].id != ids[i] for i in batch):
                        raise UserError(f"{input}: the file changed while it was being embedded")
                    results = dict(zip(batch, emb.forward([window[i - start][1].tokens for i in batch], pad_id)))
                    for i in new:
                        check_finite(results[i], ids[i], window[i - start][1].where, precision)
                    if h5 is not None and not h5.complete:
                        index = [i for i in new if i not in h5.done]
                        h5.write_batch(index, [results[i] for i in index])
                    if pt is not None:
                        pt.write([(ids[i], results[i]) for i in new if not pt.has(ids[i])])
                    n_res = sum(lengths[i] - 2 for i in new)
                    residues += n_res
                    n_done += len(new)
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

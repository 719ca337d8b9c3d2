"""The two entry points: :func:`embed_sequences` (arrays in memory, for a notebook) and
:func:`embed_file` (the ``embed`` command: checked, resumable files, on one device or many)."""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..data.sampler import MAX_TOKENS
from ..errors import UserError
from ..files import exclusive_lock, file_sha256
from ..hub.load import LoadedModel, load_model, weights_sha256
from ..output_guard import OutputGuard
from ..formats import detect_format
from ..sequences import read_sequences, skipped_text
from .embedder import Embedder, build_embedder, check_finite, check_finite_weights
from .h5 import H5Output, check_path
from .identity import check_name, journal_path, lock_path, model_config, safe_name
from .plan import Outputs, Plan, Work
from ..data.buckets import check_buckets
from .pt_dir import PtOutput
from .settings import check_embed_settings, several, tokenizer

log = logging.getLogger(__name__)


# --- the notebook API ----------------------------------------------------------------
def embed_sequences(model: Any, sequences: Any, *, layers: int | Sequence[int] = -1,
                    pooling: str | Sequence[str] = "mean", per_residue: bool = False, max_tokens: int = MAX_TOKENS,
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
    entries = list(read_sequences(sequences, tokenizer=tokenizer(unknown, loaded.tokenizer), on_invalid=on_invalid,
                                  stats=stats))
    if not entries:
        raise UserError(f"nothing to embed: no valid sequences (skipped: {skipped_text(stats)})")
    for e in entries:
        emb.check_length(e)
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


# --- the command ------------------------------------------------------------------------
def embed_file(ckpt: Any, input: str | Path, output: str | Path | None = None, pt_dir: str | Path | None = None, *,
               format: str | None = None, layers: int | Sequence[int] = -1, pooling: str | Sequence[str] = "mean",
               per_residue: bool = False, max_tokens: int = MAX_TOKENS, device: str = "cpu", precision: str = "32",
               unknown: str = "error", on_invalid: str = "skip", long_alone: int | None = None,
               sort_records: int = 20000, overwrite: bool = False, progress: bool = True,
               trainer: dict | None = None, buckets=None) -> dict | None:
    """Embed every record of ``input`` into ``output`` (HDF5) and/or ``pt_dir``.

    Every setting, path and record is checked before anything is written. The input is read
    twice: once to check every record (and count the work), then as a stream sorted by length
    in windows of ``sort_records`` records. A batch with any protein still missing runs whole
    (the same numbers as in a clean run); only the missing proteins are saved. ``trainer``:
    ``{"devices": N, "num_nodes": M}`` runs N processes per machine through Lightning's predict
    loop under DDP (:mod:`~protein_performer.embed.ddp`), each on its share of the batches, with
    the same files as one process. Returns counts: embedded, residues, seconds, residues_per_s,
    already_done and the skipped kinds (None in the processes Lightning starts beside process 0).
    """
    settings = check_embed_settings(layers=layers, pooling=pooling, per_residue=per_residue, max_tokens=max_tokens,
                              precision=precision, unknown=unknown, on_invalid=on_invalid, long_alone=long_alone,
                              sort_records=sort_records, overwrite=overwrite, progress=progress, format=format,
                              device=device, trainer=trainer)
    if output is None and pt_dir is None:
        raise UserError("nothing to write: give output=OUT.h5 and/or pt_dir=DIR")
    check_output_paths(output, pt_dir, input, ckpt, overwrite)  # the output guard; a foreign HDF5 file refused
    pl_trainer = None
    if several(settings):
        from .ddp import embed_on_devices, make_trainer
        pl_trainer = make_trainer(settings, device)
        if pl_trainer.global_rank != 0:  # a process Lightning started: process 0 hands it its share
            loaded = load_model(ckpt, "cpu")
            emb = build_embedder(loaded, layers, pooling, per_residue, precision, long_alone)
            return embed_on_devices(pl_trainer, emb, loaded.tokenizer.pad_id, None)
    loaded = load_model(ckpt, "cpu" if pl_trainer else device)
    check_finite_weights(loaded)
    emb = build_embedder(loaded, layers, pooling, per_residue, precision, long_alone)
    tok = tokenizer(unknown, loaded.tokenizer)
    stats: dict = {}
    ids, lengths = _check_records(input, format, tok, on_invalid, stats, emb, pt_dir is not None)
    emb.buckets = check_buckets(buckets, max(lengths), "buckets")  # batches padded to these lengths: the same numbers
    format = format or detect_format(input)
    identity = _identity(loaded, emb, input, format, unknown)
    attrs = {"checkpoint": loaded.source, "input": str(input), "kernel": loaded.kernel or ""}
    with contextlib.ExitStack() as stack:  # one writer per output; every output checked before any is touched
        h5, pt = _open_outputs(stack, output, pt_dir, identity, attrs, overwrite, ids)
        plan = Plan.make(emb, ids, lengths, max_tokens, sort_records,
                         done=lambda i: (h5 is None or h5.complete or i in h5.done) and (pt is None or pt.has(ids[i])))
        read = functools.partial(read_sequences, input, format, tokenizer=tok, on_invalid=on_invalid, warn=False)
        work = Work(plan, str(input), read, Outputs(h5, pt, ids, precision))
        return _run(work, emb, loaded.tokenizer.pad_id, pl_trainer, progress, stats)


def check_output_paths(output, pt_dir, input, ckpt, overwrite: bool = False) -> None:
    """Before anything is loaded, through the output guard (:mod:`protein_performer.output_guard`):
    two outputs that are two paths, no output below a regular file, a pt_dir that is a folder, no
    output (or its journal / lock) that is, or lies inside, the input or the checkpoint, and an
    existing ``output`` only if embed wrote it (:func:`~protein_performer.embed.h5.check_path`:
    a foreign file is refused, overwrite or not)."""
    if output is not None and pt_dir is not None and Path(output).resolve() == Path(pt_dir).resolve():
        raise UserError(f"output {output} and pt_dir {pt_dir} are the same path; give two")
    guard = OutputGuard("embed", {k: v for k, v in (("input", input), ("ckpt", ckpt)) if isinstance(v, (str, Path))},
                        overwrite=overwrite)
    if output is not None:
        guard.file("output", output, ours=lambda p: check_path(p) is None)
        guard.folder_path("output (its journal)", journal_path(output), holds=False)
        guard.overlap("output (its lock)", lock_path(output))
    guard.folder_path("pt_dir", pt_dir)  # the files in it: its own journal's rules (PtOutput)


def _check_records(input, format, tok, on_invalid, stats: dict, emb: Embedder, pt: bool):
    """Pass 1: every record read and checked (ids that name files included, lengths against the
    model's positions) before any output exists; the ids and token counts of the valid ones."""
    ids, lengths = [], []
    name_key = "pt_dir" if pt else "per_residue" if emb.per_residue else None
    for e in read_sequences(input, format, tokenizer=tok, on_invalid=on_invalid, stats=stats):
        if name_key:
            check_name(e, name_key, pt)
        emb.check_length(e)
        ids.append(e.id)
        lengths.append(len(e.tokens))
    if not ids:
        raise UserError(f"{input}: no sequences to embed (skipped: {skipped_text(stats)})")
    return ids, lengths


def _identity(loaded: LoadedModel, emb: Embedder, input, format: str, unknown: str) -> dict:
    """What defines the outputs (:data:`~protein_performer.embed.identity.IDENTITY`)."""
    return {"checkpoint_sha256": weights_sha256(loaded.net), "model_config": model_config(loaded.net),
            "input_sha256": file_sha256(input), "format": format, "unknown": unknown, "layers": emb.layers,
            "pooling": emb.pooling, "per_residue": bool(emb.per_residue),
            "precision": str(emb.dtype).removeprefix("torch."), "dim": int(loaded.net.embed.embedding_dim)}


def _open_outputs(stack: contextlib.ExitStack, output, pt_dir, identity: dict, attrs: dict, overwrite: bool,
                  ids: list[str]) -> tuple[H5Output | None, PtOutput | None]:
    """Lock and check every output, then open them (the first change on disk)."""
    h5 = pt = None
    if output is not None:
        stack.enter_context(exclusive_lock(lock_path(output), what=f"output {output}", remove=True))
        h5 = H5Output(output, identity, attrs, overwrite, len(ids))
    if pt_dir is not None:
        stack.enter_context(exclusive_lock(Path(pt_dir) / PtOutput.LOCK, what=f"pt_dir {pt_dir}"))
        pt = PtOutput(pt_dir, identity, overwrite, [safe_name(i) for i in ids])
    for out in (h5, pt):
        if out is not None:
            out.open()
    if pt is not None:
        stack.callback(pt.close)
    return h5, pt


@contextlib.contextmanager
def _progress_bar(show: bool, total: int, world: int):
    if not show:
        yield None
        return
    from ..training.progress import progress_bar  # tqdm's bar on a terminal; in a log, a plain line every 50 batches or 30 s
    desc = "embedding" if world == 1 else f"embedding (process 0 of {world})"
    with progress_bar(total, desc, "residues", stream=sys.stderr,
                      tqdm_kw={"unit": "res", "unit_scale": True, "dynamic_ncols": True}) as bar:
        yield bar


def _run(work: Work, emb: Embedder, pad_id: int, pl_trainer, progress: bool, stats: dict) -> dict:
    """Pass 2 (the proteins not yet in every output, here or on every device), then the HDF5 file."""
    plan, out = work.plan, work.outputs
    world = pl_trainer.world_size if pl_trainer is not None else 1
    already = len(plan.ids) - len(plan.todo)
    if already:
        log.info("resuming: %d of %d proteins already embedded", already, len(plan.ids))
    t0 = time.perf_counter()
    with _progress_bar(progress and bool(plan.todo), plan.residues(0, world), world) as bar:
        out.progress = None if bar is None else bar.update
        if plan.todo and pl_trainer is not None:
            from .ddp import embed_on_devices
            embedded, residues = embed_on_devices(pl_trainer, emb, pad_id, work)
        else:
            for job in work.jobs():
                out.put(job, emb.forward(job.tokens, pad_id))
            embedded, residues = out.embedded, out.residues
        if out.h5 is not None:
            out.h5.finish(plan.ids)
    secs = time.perf_counter() - t0
    log.info("embedded %d proteins (%d residues) in %.1f s; %d already done; skipped: %s",
             embedded, residues, secs, already, skipped_text(stats))
    return {"embedded": embedded, "residues": residues, "seconds": round(secs, 3),
            "residues_per_s": round(residues / secs, 1) if secs > 0 and residues else None,
            "already_done": already, **{k: stats[k] for k in ("duplicate", "invalid", "empty")}}

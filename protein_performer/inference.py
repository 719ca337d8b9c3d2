"""What every inference command needs: load a model, read sequences, pad a batch.

Why one module: evaluate, embed, generate and probe used to each load checkpoints, read
FASTA / .dat / CSV and treat bad records their own way, so the same file could be
accepted by one command and refused, or silently read differently, by another. Batches
are cut by :func:`protein_performer.data.sampler.token_budget_batches` (one cutter).

Sequences are read by :mod:`protein_performer.sequences` (re-exported here): one
invalid-record policy for every command, described there.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from .device import resolve_device
from .errors import UserError
from .pretrained import CONFIG, is_pretrained_dir, load_pretrained, read_config
from .sequences import (CSV_SUFFIXES, SKIP_KINDS, Entry, is_csv, read_sequences, sequence_id,  # noqa: F401
                        skipped_text)
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)



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
    frequencies: list[float] | None = None  # training amino-acid frequencies of an exported model

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
        if self.task is not None:
            return self.task.aa_frequencies
        return None if self.frequencies is None else torch.tensor(self.frequencies, dtype=torch.float64)


def load_model(model: Any, device: str = "cpu") -> LoadedModel:
    """A checkpoint path, an exported model directory (``scripts/export.py``), a ``ProteinLM``,
    a ``PerformerLM`` (or a LoadedModel) -> :class:`LoadedModel`. A missing path, a file
    that is not a checkpoint or a broken directory is a one-line error naming it."""
    if isinstance(model, LoadedModel):
        model.net = model.net.to(resolve_device(device)).eval()
        return model
    task, source, frequencies = None, type(model).__name__, None
    if isinstance(model, (str, Path)):
        source = str(model)
        if is_pretrained_dir(source):
            model, _ = load_pretrained(source)
            frequencies = read_config(Path(source) / CONFIG).get("aa_frequencies")
        elif Path(source).is_dir():
            raise UserError(f"checkpoint {source}: is a directory without {CONFIG}; expected a .ckpt file "
                            f"written by training or a directory written by scripts/export.py")
        else:
            from .tasks import load_checkpoint
            model = load_checkpoint(source, map_location="cpu")
    if hasattr(model, "model") and hasattr(model, "tokenizer"):  # ProteinLM
        task, net, tokenizer = model.eval(), model.model, model.tokenizer
    else:
        net = model  # the tokenizer of its vocabulary (a model converted from ESM has ESM's ids)
        tokenizer = Tokenizer(vocabulary=getattr(getattr(net, "config", None), "vocabulary", "protein-performer"))
    kernel = next((m.kernel for m in net.modules() if isinstance(getattr(m, "kernel", None), str)), None)
    net = net.to(resolve_device(device)).eval()
    return LoadedModel(net, tokenizer, kernel, source, task, frequencies)


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

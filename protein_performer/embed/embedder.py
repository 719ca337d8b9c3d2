"""The model side of embedding: token-budget batches, one forward pass per batch, the chosen
layers pooled over residues (padding and batch partners never leak into a protein's vector)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..data.collate import pad_batch
from ..data.sampler import token_budget_batches
from ..device import precision_dtype
from ..errors import UserError
from ..hub.load import LoadedModel
from ..model.pooling import masked_mean, residue_mask
from ..tokenizer import Tokenizer
from .settings import resolve_layers, resolve_pooling


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
    tokenizer: Tokenizer | None = None  # whose <pad>, <cls> and <eos> are not residues (None: the model's vocabulary)
    buckets: list[int] | None = None    # batches padded to these lengths (data/buckets.py; None: to the longest)

    def __post_init__(self):
        self.dtype = precision_dtype(self.precision)
        if self.tokenizer is None:
            self.tokenizer = Tokenizer(vocabulary=self.model.config.vocabulary)
        if self.long_alone is None:
            self.long_alone = 1024 if self.kernel == "exact" else None

    @property
    def device(self) -> torch.device:
        """Where the model is now (Lightning moves it to each process's device)."""
        return next(self.model.parameters()).device

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def check_length(self, entry) -> None:
        """A record longer than a learned-position model's positions: one line naming its file, line and
        record, raised while the records are checked (before any output is written, not mid-run)."""
        n = len(entry.tokens)
        if self.model.pos_embed is not None and n > self.model.max_positions:
            raise UserError(f"{entry.where}: record {entry.id!r} has {n} tokens (<cls> and <eos> included), more "
                            f"than the model's learned positions (model.max_positions={self.model.max_positions}); "
                            f"leave it out or use a model with rotary positions")

    def batches(self, lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
        """Token-budget batches, longest first; long proteins alone (``long_alone``)."""
        out = []
        for batch in token_budget_batches(lengths, max_tokens, buckets=self.buckets):
            if self.long_alone is not None and len(batch) > 1 and lengths[batch[0]] > self.long_alone:
                out += [[i] for i in batch]
            else:
                out.append(batch)
        return out

    @torch.inference_mode()
    def forward(self, batch: list[np.ndarray], pad_id: int) -> list[dict]:
        """One batch -> per protein ``{"pooled": {pooling: {layer: (D,)}}, "per_residue": {layer: (L, D)}}``."""
        device = self.device
        lengths = [len(t) for t in batch]
        tokens, padding_mask = pad_batch(batch, pad_id, self.buckets)
        tokens = tokens.to(device)
        padding_mask = None if padding_mask is None else padding_mask.to(device)
        with self._autocast():
            _, hidden = self.model(tokens, padding_mask, return_layers=True)
        residue = residue_mask(tokens, self.tokenizer)  # (B, L): every protein is <cls> residues <eos>
        out = [dict(pooled={p: {} for p in self.pooling}, per_residue={}) for _ in batch]
        for layer in self.layers:
            h = hidden[layer].float()
            pooled = {}
            if "mean" in self.pooling:
                pooled["mean"] = masked_mean(h, residue)
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
                    loaded.kernel, long_alone, loaded.tokenizer)


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
        hint = "" if precision_dtype(precision) == torch.float32 else f" (precision={precision} overflowed? try precision=32)"
        raise UserError(f"{where}: record {rid!r}: the model's embedding holds NaN or inf values{hint}; "
                        f"nothing was written for it")

"""The settings of an embed run, checked before anything is loaded or written: one line
naming the key (the layer range is checked once the model's depth is known)."""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from ..device import precision_dtype, resolve_device
from ..errors import UserError
from ..tokenizer import Tokenizer

POOLINGS = ("mean", "cls", "max")
#: the keys of ``trainer`` (several devices: Lightning's predict loop under DDP)
TRAINER_KEYS = {"devices": 1, "num_nodes": 1}


def show(v) -> str:
    """A setting as the user typed it (``[]``, ``[1.7]``), for messages."""
    return json.dumps(list(v) if isinstance(v, (list, tuple)) else v, default=str)


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def resolve_layers(layers: int | Sequence[int], depth: int | None) -> list[int]:
    """ESM-style absolute layer numbers 0..depth from possibly negative indices (``depth``
    None: only check that ``layers`` is one integer or a non-empty list of them)."""
    if is_int(layers):
        layers = [int(layers)]
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers \
            or not all(is_int(x) for x in layers):
        raise UserError(f"layers={show(layers)}: expected an integer or a non-empty list of integers "
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
        raise UserError(f"pooling={show(pooling)}: expected one or more of {', '.join(POOLINGS)}, "
                        f"e.g. pooling=[mean] (without it the output would hold only ids)")
    for p in pooling:
        if p not in POOLINGS:
            raise UserError(f"pooling {p!r} is not one of {', '.join(POOLINGS)}")
    return list(dict.fromkeys(pooling))


def tokenizer(unknown: str, like: Tokenizer = Tokenizer()) -> Tokenizer:
    """The model's tokenizer (its vocabulary: a model converted from ESM reads ESM's ids) with ``unknown``."""
    return Tokenizer(unknown=unknown, vocabulary=like.vocabulary)


def trainer_settings(trainer: dict | None, device: str) -> dict:
    """``trainer`` with its defaults, checked: ``devices`` (processes per machine; -1: every
    GPU) and ``num_nodes``; several of them need a device kind, not one device."""
    trainer = dict(trainer or {})
    unknown = sorted(set(trainer) - set(TRAINER_KEYS))
    if unknown:
        raise UserError(f"trainer.{unknown[0]}: not an embed setting; trainer takes {', '.join(TRAINER_KEYS)}")
    out = {**TRAINER_KEYS, **trainer}
    if not (is_int(out["devices"]) and (out["devices"] >= 1 or out["devices"] == -1)):
        raise UserError(f"trainer.devices={show(out['devices'])}: expected a positive integer or -1 (every GPU)")
    if not (is_int(out["num_nodes"]) and out["num_nodes"] >= 1):
        raise UserError(f"trainer.num_nodes={show(out['num_nodes'])}: expected a positive integer")
    if several(out) and str(device) not in ("auto", "cpu", "cuda"):
        raise UserError(f"device={show(device)} names one device; with trainer.devices={show(out['devices'])} "
                        f"give the kind (device=cuda, cpu or auto): each process gets its own")
    return out


def several(trainer: dict) -> bool:
    """More than one process: the run goes through Lightning's predict loop under DDP."""
    return trainer["devices"] != 1 or trainer["num_nodes"] != 1


def check_embed_settings(*, layers, pooling, per_residue, max_tokens, precision, unknown, on_invalid, long_alone,
                   sort_records, overwrite, progress, format, device="cpu", trainer=None) -> dict:
    """Every setting of :func:`~protein_performer.embed.run.embed_file` checked; returns the
    trainer settings with their defaults."""
    resolve_layers(layers, None)
    resolve_pooling(pooling)
    precision_dtype(precision)
    tokenizer(unknown)
    for key, v in dict(per_residue=per_residue, overwrite=overwrite, progress=progress).items():
        if not isinstance(v, (bool, np.bool_)):
            raise UserError(f"{key}={show(v)}: expected true or false")
    for key, v, none_ok in (("max_tokens", max_tokens, False), ("sort_records", sort_records, False),
                            ("long_alone", long_alone, True)):
        if not (v is None and none_ok) and not (is_int(v) and v >= 1):
            raise UserError(f"{key}={show(v)}: expected a positive integer" + (" or null" if none_ok else ""))
    if on_invalid not in ("error", "skip"):
        raise UserError(f"on_invalid={show(on_invalid)}: expected error or skip")
    if format not in (None, "fasta", "uniprot", "csv", "tsv"):
        raise UserError(f"format={show(format)}: expected fasta, uniprot, csv, tsv or null (detected)")
    try:
        resolve_device(device)
    except RuntimeError:
        raise UserError(f"device={show(device)}: expected auto, cpu, cuda or cuda:N") from None
    return trainer_settings(trainer, device)

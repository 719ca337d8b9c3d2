"""Start from another model's weights under another attention, and distil it from a teacher.

Why: a softmax-pretrained model (ESM-2 through ``convert-esm``, or an exact-softmax model trained
here) keeps its weights under linear attention, but its outputs drift; a short fine-tune recovers
them. ``init_from`` gives the weights and the architecture (``model.attention`` picks the student's
attention); :class:`Distiller` adds to the masked-LM loss the KL divergence from the teacher's
logits and, per layer, the relative squared error of the attention outputs (Hedgehog's layer-wise
matching, on the attention layer's output). The teacher is frozen, runs under ``no_grad`` and is
not part of the checkpoint.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..model import PerformerLM
from ..objectives import IGNORE
from ..tokenizer import VOCABULARIES, Tokenizer

#: state_dict entries that belong to one attention kernel (feature-map parameters and buffers, the
#: call counter): the student has its own kernel's, whatever the source had
KERNEL_STATE = (".attn.feature_map.", ".attn._extra_state")


def kernel_state(name: str) -> bool:
    return any(s in name for s in KERNEL_STATE)


def student_config(source: PerformerLM, attention: dict, causal: bool, where: str) -> dict:
    """The source's architecture with the student's ``attention`` (the model dict ProteinLM takes)."""
    if source.config.causal != causal:
        raise UserError(f"{where}: a {'causal' if source.config.causal else 'bidirectional'} model; the "
                        f"objective needs a {'causal' if causal else 'bidirectional'} one")
    config = source.config.to_dict()
    config.pop("vocab_size")  # ProteinLM sets it from the vocabulary
    config.pop("causal")
    config["attention"] = dict(attention)
    return config


def set_by_overrides(overrides: list[str]) -> list[str]:
    """The ``model.*`` architecture keys a command line sets (``model.dim=64``, ``+model.depth=4``, and
    the keys of a ``model/size=35m`` option), in its order; ``model.attention.*`` and ``model.name``
    are not architecture (an ``init_from`` swap picks the attention)."""
    keys: list[str] = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "model/size" and value not in ("", "null"):
            from omegaconf import OmegaConf

            from ..resources import conf_dir
            size = conf_dir() / "model" / "size" / f"{value}.yaml"
            found = [str(k) for k in OmegaConf.load(size).keys()] if size.is_file() else []
        elif key.startswith("model.") and not key.startswith(("model.attention.", "model.name")):
            found = [key.removeprefix("model.")]
        else:
            found = []
        keys += [k for k in found if k not in keys]
    return keys


def check_architecture(source: PerformerLM, model_cfg: dict, overrides: list[str], where: str) -> None:
    """``init_from`` takes the architecture of its model: a command line that also sets an
    architecture key to another value (``model.dim=64`` on a dim-32 checkpoint) is one line naming
    every conflicting key, where it would otherwise be dropped silently."""
    have = source.config.to_dict()
    aliases = {"max_len": "max_positions"}
    conflicts = []
    for key in set_by_overrides(overrides):
        name = aliases.get(key, key)
        if name in have and name != "attention" and key in model_cfg and model_cfg[key] != have[name]:
            conflicts.append((key, model_cfg[key], have[name]))
    if conflicts:
        asked = ", ".join(f"model.{k}={v}" for k, v, _ in conflicts)
        its = ", ".join(f"model.{k}={h}" for k, _, h in conflicts)
        raise UserError(f"{where}: its model has {its}, but the command line sets {asked}; init_from takes the "
                        f"architecture of its model (model.attention.* picks the attention): drop "
                        f"{'these overrides' if len(conflicts) > 1 else 'this override'}, or train from scratch "
                        f"without init_from")


def load_start(model: PerformerLM, source: PerformerLM, where: str) -> None:
    """Copy every weight of ``source`` into ``model`` except those of the attention kernel; any other
    difference (a missing or extra tensor, another shape) is a one-line error naming ``where``."""
    state = {k: v for k, v in source.state_dict().items() if not kernel_state(k)}
    own = model.state_dict()
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            raise UserError(f"{where}: {k} has shape {tuple(v.shape)}, the student needs {tuple(own[k].shape)}")
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not kernel_state(k)]
    if missing or result.unexpected_keys:
        raise UserError(f"{where}: does not fit the student ({', '.join((missing + result.unexpected_keys)[:3])})")


def data_to_model_ids(vocabulary: str) -> torch.Tensor | None:
    """protein-performer's ids (what the data pipeline writes) -> the model's vocabulary's ids, by
    token; None for protein-performer's own vocabulary (a model converted from ESM reads ESM's)."""
    if vocabulary == Tokenizer().vocabulary:
        return None
    data, model = VOCABULARIES[Tokenizer().vocabulary][0], VOCABULARIES[vocabulary][0]
    return torch.tensor([model.index(t) for t in data])


def remap_frequencies(freqs: list[float], table: torch.Tensor | None, size: int) -> list[float]:
    """Amino-acid frequencies indexed by data ids -> indexed by the model's ids."""
    if table is None:
        return freqs
    out = [0.0] * size
    for i, f in enumerate(freqs):
        out[int(table[i])] = f
    return out


@contextmanager
def attention_outputs(model: PerformerLM):
    """Collect each block's attention output (B, L, dim) during the forward calls inside."""
    outputs: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_hook(lambda m, args, out: outputs.append(out)) for b in model.blocks]
    try:
        yield outputs
    finally:
        for h in hooks:
            h.remove()


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Mean over the scored positions of KL(teacher || student) of the token distributions."""
    s = F.log_softmax(student_logits[scored].float(), -1)
    t = F.log_softmax(teacher_logits[scored].float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean() if scored.any() else student_logits.sum() * 0


def attention_mismatch(student: list[torch.Tensor], teacher: list[torch.Tensor],
                       padding_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over layers of ||a_s - a_t||^2 / ||a_t||^2 over the non-padding positions."""
    keep = None if padding_mask is None else ~padding_mask.bool()
    errors = []
    for s, t in zip(student, teacher, strict=True):
        s, t = (s.float(), t.float()) if keep is None else (s[keep].float(), t[keep].float())
        errors.append((s - t).pow(2).sum() / t.pow(2).sum().clamp(min=1e-12))
    return torch.stack(errors).mean()


class Distiller:
    """The frozen teacher and the weights of the two distillation terms."""

    def __init__(self, teacher: PerformerLM, weight: float, attention_weight: float, where: str):
        for key, w in (("distill.weight", weight), ("distill.attention_weight", attention_weight)):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
                raise UserError(f"{key} must be a non-negative number, got {w!r}")
        self.teacher = teacher.eval().requires_grad_(False)
        self.weight, self.attention_weight, self.where = float(weight), float(attention_weight), where

    def check(self, student: PerformerLM) -> None:
        t, s = self.teacher.config, student.config
        for key in ("vocab_size", "vocabulary", "causal", "depth", "dim"):
            if getattr(t, key) != getattr(s, key):
                raise UserError(f"distill.teacher={self.where}: its {key} is {getattr(t, key)!r}, the student's "
                                f"{getattr(s, key)!r}")

    def loss(self, student: PerformerLM, inputs: torch.Tensor, padding_mask: torch.Tensor | None,
             labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The student's logits and the distillation terms on one batch: {"kl", "attention", "loss"}
        (``loss`` = weight * kl + attention_weight * attention)."""
        self.teacher.to(inputs.device)
        want_attention = self.attention_weight > 0
        with torch.no_grad(), attention_outputs(self.teacher) as t_att:
            t_logits = self.teacher(inputs, padding_mask)
        if want_attention:
            with attention_outputs(student) as s_att:
                logits = student(inputs, padding_mask)
        else:
            logits, s_att = student(inputs, padding_mask), None
        terms = {"kl": kl_to_teacher(logits, t_logits, labels != IGNORE)}
        terms["attention"] = attention_mismatch(s_att, t_att, padding_mask) if want_attention else logits.sum() * 0
        terms["loss"] = self.weight * terms["kl"] + self.attention_weight * terms["attention"]
        return logits, terms

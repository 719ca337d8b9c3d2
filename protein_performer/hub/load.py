"""Open a model: an exported directory (no Lightning, no pickle), a training checkpoint, or a
module in memory -> :class:`LoadedModel`, what every inference command works with.

Why one loader: evaluate, embed, generate, probe and score used to each load checkpoints their
own way, so the same file could be accepted by one command and refused by another."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..device import resolve_device
from ..errors import UserError, one_line
from ..files import FINETUNE_CONFIG, MODEL_CONFIG
from ..model import ModelConfig, PerformerEncoder, PerformerLM
from ..model.config import migrate
from ..model.heads import TERMINUS, FineTuneNet
from ..tokenizer import VERSION, VOCABULARIES, Tokenizer


CONFIG, WEIGHTS, VOCAB, TOKENIZER_CONFIG, CARD = (
    MODEL_CONFIG, "model.safetensors", "vocab.txt", "tokenizer_config.json", "README.md")


REMOTE_CODE = ("configuration_protein_performer.py", "modeling_protein_performer.py")


#: the export's list of the files it wrote: what ``overwrite`` may replace
JOURNAL = ".protein_performer_export.json"


MODEL_TYPE = "protein_performer"


#: config.json keys of the model (ModelConfig's); ``causal`` follows from the objective
MODEL_KEYS = tuple(f.name for f in fields(ModelConfig))


#: ... of which these must be there (the rest have defaults that cannot silently change the model)
REQUIRED = ("objective", "vocab_size", "tokenizer_version", "dim", "depth", "heads", "ff_mult", "position",
            "attention")


#: the transformers class and auto class of an exported language model, by objective ...
ARCHITECTURES = {"mlm": ("ProteinPerformerForMaskedLM", "AutoModelForMaskedLM"),
                 "clm": ("ProteinPerformerForCausalLM", "AutoModelForCausalLM")}
#: ... and of an exported fine-tuned model, by task (hf_code/modeling_protein_performer.py defines them all)
HEAD_ARCHITECTURES = {
    "classification": ("ProteinPerformerForSequenceClassification", "AutoModelForSequenceClassification"),
    "regression": ("ProteinPerformerForSequenceClassification", "AutoModelForSequenceClassification"),
    "residue": ("ProteinPerformerForTokenClassification", "AutoModelForTokenClassification"),
}


# FINETUNE_CONFIG (files.py): what ``finetune`` writes beside its model.safetensors (encoder + head): task,
# classes, head, encoder config


def is_pretrained_dir(path) -> bool:
    """True for a directory with a config.json: what ``load_pretrained`` opens (a .ckpt is a
    file). A directory that is incomplete still counts, so that loading it names what is wrong."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file()


def load_pretrained(path, device="cpu") -> tuple[PerformerLM, Tokenizer]:
    """An exported directory -> (PerformerLM in eval mode on ``device``, Tokenizer). Any missing,
    malformed or inconsistent file is a one-line UserError naming it."""
    d = Path(path)
    if not d.is_dir():
        raise UserError(f"{d}: no such directory (an exported model is a directory with {CONFIG} and {WEIGHTS})")
    config = read_config(d / CONFIG)
    model = build_model(config, d / CONFIG)
    tokenizer = Tokenizer(vocabulary=model.config.vocabulary)
    _check_vocab(d / VOCAB, tokenizer)
    load_weights(model, d / WEIGHTS)
    return model.to(resolve_device(device)).eval(), tokenizer


def read_config(path: Path) -> dict:
    """config.json, checked: a protein-performer model of this code's vocabulary."""
    if not path.is_file():
        raise UserError(f"{path}: no such file (not an exported protein-performer model)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({one_line(e)})") from e
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(config).__name__}")
    if config.get("model_type") != MODEL_TYPE:
        raise UserError(f"{path}: model_type is {config.get('model_type')!r}, not {MODEL_TYPE!r}")
    missing = [k for k in REQUIRED if k not in config]
    if isinstance(config.get("attention"), dict) and "kernel" not in config["attention"]:
        missing.append("attention.kernel")
    if missing:
        raise UserError(f"{path}: missing key(s) {', '.join(missing)}")
    if not isinstance(config["attention"], dict):
        raise UserError(f"{path}: attention must be a JSON object, got {config['attention']!r}")
    if config["objective"] not in ARCHITECTURES:
        raise UserError(f"{path}: objective must be 'mlm' or 'clm', got {config['objective']!r}")
    if config["tokenizer_version"] != VERSION:
        raise UserError(f"{path}: tokenizer version {config['tokenizer_version']!r}, this code has {VERSION}")
    if config.get("vocabulary", "protein-performer") not in VOCABULARIES:
        raise UserError(f"{path}: vocabulary {config['vocabulary']!r}: choose one of {', '.join(VOCABULARIES)}")
    tok = Tokenizer(vocabulary=config.get("vocabulary", "protein-performer"))
    if config["vocab_size"] != tok.vocab_size:
        raise UserError(f"{path}: vocab_size {config['vocab_size']!r}, the tokenizer has {tok.vocab_size}")
    return config


def build_model(config: dict, path: Path) -> PerformerLM:
    """The (untrained) PerformerLM that config.json describes."""
    model = migrate({k: v for k, v in config.items() if k in MODEL_KEYS or k == "config_version"}, str(path))
    try:
        return PerformerLM(ModelConfig.from_dict(model, causal=config["objective"] == "clm"))
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: bad model settings ({one_line(e)})") from e


def load_weights(model: PerformerLM, path: Path) -> None:
    """model.safetensors into ``model``: exactly its tensors (parameters and buffers), shapes checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({one_line(e)})") from e
    expected = _exported_state(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing:
        raise UserError(f"{path}: missing tensor(s) {_some(missing)} that config.json's model has")
    if unexpected:
        raise UserError(f"{path}: unexpected tensor(s) {_some(unexpected)} that config.json's model lacks")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise UserError(f"{path}: {name} has shape {tuple(t.shape)}, config.json's model needs "
                            f"{tuple(expected[name].shape)}")
    model.load_state_dict(tensors, strict=False)  # strict would ask for the (unexported) _extra_state


def _exported_state(model: PerformerLM) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers. Left out: each attention layer's ``_extra_state``, the
    training counters of the redraw schedule (a loaded model is for inference or fine-tuning)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _check_vocab(path: Path, tokenizer: Tokenizer = Tokenizer()) -> None:
    if path.is_file() and path.read_text(encoding="utf-8").splitlines() != list(tokenizer.tokens):
        raise UserError(f"{path}: the vocabulary differs from this code's tokenizer (version {VERSION})")


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def checkpoint_step(path) -> int | None:
    """The optimizer step of a training checkpoint (read without unpickling: ``weights_only``,
    memory-mapped, so the weights are not read again) or of an exported directory; None when
    not recorded or not readable."""
    p = Path(path)
    if is_pretrained_dir(p):
        step = read_config(p / CONFIG).get("global_step")
    else:
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - informative only; the loader names a bad file
            return None
        step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
    return int(step) if isinstance(step, int) else None


log = logging.getLogger(__name__)


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
            from ..training.task import load_checkpoint
            model = load_checkpoint(source, map_location="cpu")
    if hasattr(model, "model") and hasattr(model, "tokenizer"):  # ProteinLM
        task, net, tokenizer = model.eval(), model.model, model.tokenizer
    else:
        net = model  # the tokenizer of its vocabulary (a model converted from ESM has ESM's ids)
        tokenizer = Tokenizer(vocabulary=getattr(getattr(net, "config", None), "vocabulary", "protein-performer"))
    kernel = next((m.kernel for m in net.modules() if isinstance(getattr(m, "kernel", None), str)), None)
    net = net.to(resolve_device(device)).eval()
    return LoadedModel(net, tokenizer, kernel, source, task, frequencies)


def load_finetuned(path, device="cpu") -> tuple[FineTuneNet, dict]:
    """A finetune output folder (finetune.json) or its export (config.json with a task head) ->
    (the fine-tuned network in eval mode, its settings: task, classes, num_outputs, pooling,
    dropout, target_scale, model, ensemble: the fine-tuned share of an output mix with the probe, or
    None). A missing or inconsistent file is one line naming it."""
    d = Path(path)
    if (d / FINETUNE_CONFIG).is_file():
        where = d / FINETUNE_CONFIG
        try:
            meta = json.loads(where.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{where}: not valid JSON ({one_line(e)})") from e
    elif (d / CONFIG).is_file():
        where, config = d / CONFIG, read_config(d / CONFIG)
        if "finetune_task" not in config:
            raise UserError(f"{where}: a language model without a task head (load_pretrained opens it)")
        labels = [config["id2label"][str(i)] for i in range(config["num_labels"])] if "id2label" in config else []
        meta = {"task": config["finetune_task"], "classes": [] if config["finetune_task"] == "regression" else labels,
                "num_outputs": config.get("num_labels"), "pooling": config.get("pooling", "mean"),
                "window": config.get("head_window", 0),
                "dropout": config.get("classifier_dropout", 0.0), "target_scale": config.get("target_scale"),
                "ensemble": config.get("ensemble_share"),
                "model": {k: v for k, v in config.items() if k in MODEL_KEYS or k == "config_version"}}
        if config.get("pooling") == "termini" and config.get("pooling_ends") != TERMINUS:
            raise UserError(f"{where}: pooling_ends={config.get('pooling_ends')!r}; this version's termini head "
                            f"reads {TERMINUS} residues at each end")
    else:
        raise UserError(f"{d}: neither a finetune output ({FINETUNE_CONFIG}) nor an exported model ({CONFIG})")
    try:
        config = ModelConfig.from_dict(migrate(meta["model"], str(where)))
        build = lambda: FineTuneNet(PerformerEncoder(config), meta["task"], int(meta["num_outputs"]),  # noqa: E731
                                    meta["pooling"], float(meta["dropout"]), int(meta.get("window") or 0))
        net = build()
        if meta.get("ensemble") is not None:  # finetune's output-space ensemble: the probe's network beside it
            net.attach_probe(build(), float(meta["ensemble"]))
    except UserError as e:
        raise UserError(f"{where}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where}: bad fine-tuned model settings ({one_line(e)})") from e
    load_weights(net, d / WEIGHTS)
    return net.to(device).eval(), meta


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

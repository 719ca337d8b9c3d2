"""Write a model as an exported directory (the layout is described in :mod:`protein_performer.hub`):
from a training checkpoint (``export``) or from any PerformerLM (``write_model_dir``, which
convert-esm uses too), checked by loading it back, swapped into place only when whole.

``export`` of a ``finetune`` output writes the encoder and its task head the same way: config.json
then also holds the head (``finetune_task``, ``pooling``, ``num_labels``, ``id2label``,
``problem_type``, ``target_scale``), model.safetensors the fine-tuned network's tensors
(``encoder.*``, ``head.*``), and transformers opens it with AutoModelForSequenceClassification or
AutoModelForTokenClassification; :func:`~protein_performer.hub.load.load_finetuned` opens either folder."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..errors import UserError, one_line
from ..files import WrittenFiles, remove_path
from ..model import ModelConfig, PerformerLM
from ..model.heads import FineTuneNet
from ..tokenizer import VERSION, Tokenizer
from .card import TOKENIZER_LINE, model_card
from .load import (ARCHITECTURES, CARD, CONFIG, FINETUNE_CONFIG, HEAD_ARCHITECTURES, JOURNAL, MODEL_TYPE, REMOTE_CODE,
                   TOKENIZER_CONFIG, VOCAB, WEIGHTS, _exported_state, _some, checkpoint_step, load_finetuned,
                   load_pretrained)


#: a real protein (ubiquitin), scored by export to check the written directory
CHECK_SEQUENCE = "MQIFVKTLTGKTITLEVEPSDTIENVKAKIQDKEGIPPDQQRLIFAGKQLEDGRTLSDYNIQKESTLHLVLRLRGG"


def export(ckpt_path, output_dir, metrics=None, overwrite: bool = False) -> Path:
    """Write the directory for checkpoint ``ckpt_path`` to ``output_dir`` and return its path.

    ``metrics``: a metrics.json of scripts/evaluate.py for this checkpoint, whose held-out
    figures go into the model card (otherwise the card says "not evaluated"). The directory
    is written beside ``output_dir`` (``.<name>.export.tmp``), loaded back and checked to
    give the checkpoint's logits, and only then renamed into place. An existing non-empty
    ``output_dir`` is refused unless ``overwrite``, and even then replaced only when it is
    an export this tool wrote (:data:`JOURNAL` lists its files) holding nothing else. One
    export per output at a time (a lock beside it); a rerun after a kill finishes or undoes
    what the killed run left beside the output."""
    from ..output_guard import OutputGuard
    from ..training.task import load_checkpoint  # reading a Lightning checkpoint needs Lightning; loading does not

    out, ckpt_path = Path(output_dir), Path(ckpt_path)
    # the output guard: not an input, inside one or holding one (the folder is replaced whole);
    # what it holds is replaced only if export wrote it (write_model_dir)
    OutputGuard("export", {"ckpt": ckpt_path, "metrics": metrics}).folder_path("output", out, holds=False)
    if (ckpt_path / FINETUNE_CONFIG).is_file():  # a finetune output: the encoder and its task head
        if metrics:
            raise UserError(f"metrics={metrics}: a finetune output's card takes the test figures of its own "
                            f"metrics.json; leave metrics unset")
        test = ckpt_path / "metrics.json"
        if not test.is_file():  # finetune writes metrics.json last: without it, its other files may be half
            raise UserError(f"ckpt={ckpt_path}: an unfinished finetune output (no metrics.json: finetune was cut "
                            f"short in its final writes); rerun the same finetune command to complete it")
        net, meta = load_finetuned(ckpt_path)
        card = finetuned_card(config := finetuned_config(net, meta),
                              json.loads(test.read_text(encoding="utf-8")))
        return write_model_dir(out, net, config, card, overwrite=overwrite)
    module = load_checkpoint(str(ckpt_path))
    step = checkpoint_step(ckpt_path)
    config = export_config(module.model.config, dict(module.hparams), step)
    evaluation = read_metrics(Path(metrics), config) if metrics else None
    card = model_card(config, module.model, step, _run_config(ckpt_path), evaluation)
    return write_model_dir(out, module.model, config, card, overwrite=overwrite)


def write_model_dir(out: Path, model: PerformerLM | FineTuneNet, config: dict, card: str, overwrite: bool = False) -> Path:
    """Write ``model`` as an exported directory ``out`` (export and convert-esm share this): one writer
    per output (a lock beside it), what a killed run left beside it finished or undone, an existing
    non-empty ``out`` replaced only with ``overwrite`` and only when export wrote it; the files go to
    ``.<name>.export.tmp``, are loaded back and checked to give ``model``'s logits, then renamed."""
    from ..files import exclusive_lock
    out = Path(out)
    if not out.name or out.name in (".", "..") or Path.cwd().resolve().is_relative_to(out.resolve()):
        raise UserError(f"output {out}: is the current folder or one above it; "
                        f"an export is a folder of its own that replaces what is there: give it a new name "
                        f"(output=my_model)")
    tmp, old = (out.with_name(f".{out.name}.export.{what}") for what in ("tmp", "old"))
    with exclusive_lock(out.with_name(f".{out.name}.export.lock"), what=f"output {out}", remove=True):
        _recover(out, tmp, old)
        if out.is_dir() and any(out.iterdir()):
            if not overwrite:
                raise UserError(f"output {out}: exists and is not empty (overwrite=true replaces it)")
            check_replaceable(out)
        try:
            tmp.mkdir()
            written = WrittenFiles(tmp / JOURNAL)
            for name in (CONFIG, WEIGHTS, VOCAB, TOKENIZER_CONFIG, *REMOTE_CODE, CARD):
                written.record(tmp / name)
            (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            _write_weights(model, tmp / WEIGHTS)
            shutil.copymode(tmp / CONFIG, tmp / WEIGHTS)  # safetensors writes owner-only; share like the rest
            _write_tokenizer(tmp, Tokenizer(vocabulary=getattr(model, "encoder", model).config.vocabulary))
            for name in REMOTE_CODE:
                shutil.copyfile(Path(__file__).parent / "hf_code" / name, tmp / name)
            (tmp / CARD).write_text(card, encoding="utf-8")
            _check_export(tmp, model)
        except BaseException:
            remove_path(tmp)
            raise
        if out.is_dir():  # an empty directory or an earlier export: swapped out, removed once replaced
            os.replace(out, old)
        os.replace(tmp, out)
        remove_path(old)
    return out


def _recover(out: Path, tmp: Path, old: Path) -> None:
    """What a killed export left beside ``out``: its unfinished directory goes; an earlier
    export swapped out but not yet replaced goes back (or goes, when the new one is in place)."""
    for d in (tmp, old):
        if d.exists() and not (d.is_dir() and ((d / JOURNAL).is_file() or not any(d.iterdir()))):
            raise UserError(f"{d}: is in the way of output {out} and is not a directory written by export; "
                            f"move it away")
    remove_path(tmp)
    if old.exists():
        if out.exists():
            remove_path(old)
        else:
            os.replace(old, out)


def check_replaceable(out: Path) -> None:
    """One line unless ``out`` is an export this tool wrote that holds only the files it wrote:
    ``overwrite`` never deletes a folder, or a file in it, that export did not write."""
    if not (out / JOURNAL).is_file():
        raise UserError(f"output {out}: not a directory written by export (no {JOURNAL}); "
                        f"overwrite=true replaces only an earlier export, choose another output")
    written = WrittenFiles(out / JOURNAL)
    other = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                   if p.name != JOURNAL and p not in written and not (p.is_dir() and any(p.iterdir())))
    if other:
        raise UserError(f"output {out}: holds {_some(other)}, not written by export; overwrite=true would "
                        f"delete it: move it away or choose another output")


def export_config(model: ModelConfig, hparams: dict, step: int | None) -> dict:
    """config.json: the whole model config (defaults written out, so that the directory means
    the same thing to later code whose defaults have changed) and the task's hyperparameters."""
    objective = hparams["objective"]
    arch = ARCHITECTURES[objective][0]
    tok = Tokenizer(vocabulary=model.vocabulary)
    freqs = hparams.get("aa_frequencies")
    config = {
        "model_type": MODEL_TYPE,
        "architectures": [arch],
        # both auto classes, so that the wrong one says which to use (the model class checks)
        "auto_map": {"AutoConfig": "configuration_protein_performer.ProteinPerformerConfig",
                     "AutoModel": "modeling_protein_performer.ProteinPerformerModel",  # the backbone
                     **{a: f"modeling_protein_performer.{c}" for c, a in ARCHITECTURES.values()}},
        "objective": objective,
        **model.to_dict(),
        "tokenizer_version": hparams.get("tokenizer_version", VERSION),
        "pad_token_id": tok.pad_id, "mask_token_id": tok.mask_id, "bos_token_id": tok.cls_id,
        "eos_token_id": tok.eos_id,
        "aa_frequencies": None if freqs is None else [float(f) for f in freqs],
        "global_step": step,
        "torch_dtype": "float32",
        "protein_performer_version": _package_version(),
    }
    return json.loads(json.dumps(config))  # plain JSON types (tuples -> lists), or fail here


def read_metrics(path: Path, config: dict) -> dict:
    """A single-checkpoint metrics.json of scripts/evaluate.py, checked to be about this model."""
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"metrics {path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"metrics {path}: not valid JSON ({one_line(e)})") from e
    if isinstance(m, dict) and "checkpoints" in m:
        raise UserError(f"metrics {path}: holds several checkpoints; give the metrics.json of this one "
                        f"(evaluate.py writes one per checkpoint in a subdirectory)")
    if not isinstance(m, dict) or not all(k in m for k in ("perplexity", "accuracy", "num_tokens")):
        raise UserError(f"metrics {path}: not a metrics.json of scripts/evaluate.py (needs perplexity, "
                        f"accuracy, num_tokens)")
    ev = m.get("evaluation") or {}
    for key, ours in (("objective", config["objective"]), ("attention_kernel", config["attention"]["kernel"])):
        if ev.get(key) not in (None, ours):
            raise UserError(f"metrics {path}: evaluated a model with {key} {ev[key]!r}, this checkpoint has {ours!r}")
    if m.get("step") is not None and config["global_step"] is not None and m["step"] != config["global_step"]:
        raise UserError(f"metrics {path}: figures for step {m['step']}, this checkpoint is at step "
                        f"{config['global_step']}")
    return m


def _run_config(ckpt_path: Path) -> dict | None:
    """The training run's config.yaml (written by train.py next to checkpoints/), if there is one."""
    run_dir = ckpt_path.resolve().parent.parent
    path = run_dir / "config.yaml"
    if ckpt_path.resolve().parent.name != "checkpoints" or not path.is_file():
        return None
    import yaml
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UserError(f"run config {path}: not valid YAML ({one_line(e)})") from e
    return cfg if isinstance(cfg, dict) else None


def _write_weights(model: PerformerLM, path: Path) -> None:
    from safetensors.torch import save_file
    state = {k: v.detach().cpu().contiguous() for k, v in _exported_state(model).items()}
    save_file(state, str(path), metadata={"format": "pt"})


def _write_tokenizer(d: Path, tokenizer: Tokenizer = Tokenizer()) -> None:
    (d / VOCAB).write_text("\n".join(tokenizer.tokens) + "\n", encoding="utf-8")
    config = {"tokenizer_class": "EsmTokenizer", "cls_token": "<cls>", "eos_token": "<eos>", "pad_token": "<pad>",
              "mask_token": "<mask>", "unk_token": "<unk>", "model_max_length": 1_000_000_000,
              "clean_up_tokenization_spaces": False, "protein_performer_tokenizer_version": VERSION}
    (d / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _check_export(d: Path, model: PerformerLM | FineTuneNet) -> None:
    """Load the written directory back and demand the checkpoint's logits (to float32 round-off:
    a forgotten buffer or setting changes them by far more)."""
    if isinstance(model, FineTuneNet):
        (loaded, _), tok = load_finetuned(d), model.tokenizer
    else:
        loaded, tok = load_pretrained(d)
    ids = torch.as_tensor(tok.encode(CHECK_SEQUENCE), dtype=torch.long)[None, :getattr(model, "encoder", model).max_positions]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        same = torch.allclose(model(ids), loaded(ids), rtol=1e-6, atol=1e-6)
    model.train(was_training)
    if not same:
        raise RuntimeError(f"{d}: the exported model does not reproduce the checkpoint's logits (a bug)")


def _package_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("protein-performer")
    except PackageNotFoundError:
        return None


# --- fine-tuned heads -------------------------------------------------------------------------
def finetuned_config(net: FineTuneNet, meta: dict) -> dict:
    """config.json of a fine-tuned model: the encoder's (as :func:`export_config`) and the head's,
    in transformers' terms (num_labels, id2label, problem_type) and protein-performer's
    (finetune_task, pooling, target_scale: regression outputs are standardized)."""
    enc = net.encoder.config
    config = export_config(enc, {"objective": "clm" if enc.causal else "mlm"}, None)
    arch, _ = HEAD_ARCHITECTURES[meta["task"]]
    labels = meta["classes"] or ["value"]
    config.update({
        "architectures": [arch],
        # both auto classes, so that the wrong one says which to use (the model class checks)
        "auto_map": {"AutoConfig": config["auto_map"]["AutoConfig"],
                     **{a: f"modeling_protein_performer.{c}" for c, a in HEAD_ARCHITECTURES.values()}},
        "finetune_task": meta["task"], "pooling": meta["pooling"], "classifier_dropout": meta["dropout"],
        "pooling_ends": getattr(net.head, "ends", 0),
        "head_window": int(meta.get("window") or 0),
        "target_scale": meta["target_scale"], "num_labels": len(labels),
        "id2label": {str(i): c for i, c in enumerate(labels)}, "label2id": {c: i for i, c in enumerate(labels)},
        "problem_type": "regression" if meta["task"] == "regression" else "single_label_classification",
        "ensemble_share": net.share if net.probe is not None else None,
        "finetune": {k: meta.get(k) for k in ("freeze", "lora", "source")},
    })
    return json.loads(json.dumps(config))


def finetuned_card(config: dict, metrics: dict | None) -> str:
    """README.md of a fine-tuned model: the task, its test figures (finetune's metrics.json), use."""
    task, arch = config["finetune_task"], config["architectures"][0]
    auto = HEAD_ARCHITECTURES[task][1]
    what = {"classification": f"one of {config['num_labels']} classes per protein ({config['pooling']} pooling)",
            "regression": f"a value per protein ({config['pooling']} pooling; logits are standardized: "
                          f"prediction = logits * {config['target_scale'][1]:.6g} + {config['target_scale'][0]:.6g})",
            "residue": f"one of {config['num_labels']} classes per residue"}[task]
    shown = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    lines = ["---", "library_name: transformers", "tags: [protein, protein-language-model, performer, protein-performer]",
             "---", "", f"# protein-performer fine-tuned model: {task}", "",
             f"`{arch}`: {what}, over a protein-performer encoder ({config['attention']['kernel']} attention, dim "
             f"{config['dim']}, depth {config['depth']}) fine-tuned by `protein-performer finetune` "
             f"(freeze {config['finetune']['freeze']}" + (", LoRA merged into the weights" if config["finetune"]["lora"]
                                                           else "") + ")."
             + (f" An output-space ensemble: the logits are the log of {config['ensemble_share']:g} of the fine-tuned "
                f"network's probabilities (regression: values) and {1 - config['ensemble_share']:g} of a linear probe's "
                "on the frozen pretrained encoder, which the weights hold too (`probe.*`): two encoder passes per "
                "batch." if config.get("ensemble_share") else ""), "",
             "Labels: " + ", ".join(f"{i} = `{c}`" for i, c in config["id2label"].items()) + ".", "", "## Test split", ""]
    lines += ([f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in shown.items()]
              or ["Not recorded (no metrics.json in the finetune output)."])
    lines += ["", "## Use", "", "```python", f"from transformers import EsmTokenizer, {auto}", TOKENIZER_LINE,
              f"model = {auto}.from_pretrained(\"path/to/this/directory\", trust_remote_code=True)",
              "logits = model(**tokenizer([\"MKTAYIAKQR\"], return_tensors=\"pt\")).logits", "```", "",
              "With protein-performer: `protein_performer.hub.load.load_finetuned(\"path/to/this/directory\")`. "
              "The transformers code gives protein-performer's logits (tested to 1e-5).", "", "## Licence", "",
              "- code (`*.py` here and protein-performer): MIT; weights: state the licence of the pretraining and "
              "label data before publishing."]
    return "\n".join(lines) + "\n"

"""Share a trained model as a directory anyone can open: ``export`` a checkpoint, ``load_pretrained`` it.

A Lightning checkpoint is a pickle: opening one runs code and needs this project's classes.
An exported directory (Hugging Face layout) holds only JSON, text and safetensors:

    config.json         model settings (every default written out), objective, vocabulary size,
                        tokenizer version, the training set's amino-acid frequencies (the
                        perplexity baseline), training step, and transformers' model_type,
                        architectures and auto_map
    model.safetensors   every parameter and persistent buffer of PerformerLM. The random-feature
                        projections and FAVOR++'s rho are buffers that training redrew and
                        updated: they cannot be recomputed from the settings, so they are stored.
                        The output head is the embedding matrix itself (tied in the forward pass,
                        not a copy), so it is stored once, as ``embed.weight``.
    vocab.txt, tokenizer_config.json
                        the vocabulary, one token per line (id = line number); transformers
                        opens it as an EsmTokenizer (same token names, <cls> residues <eos>)
    configuration_protein_performer.py, modeling_protein_performer.py
                        self-contained transformers code (from protein_performer/hf_code), for
                        ``AutoModelFor{MaskedLM,CausalLM}.from_pretrained(dir, trust_remote_code=True)``
    README.md           model card: kernel, size, training data and steps, held-out figures

``load_pretrained`` needs neither Lightning nor transformers and never unpickles.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import fields
from pathlib import Path

import torch

from .attention.feature_maps import REGISTRY, is_random
from .device import resolve_device
from .errors import UserError, one_line
from .files import WrittenFiles, remove_path
from .model import ModelConfig, PerformerLM
from .tokenizer import VERSION, VOCABULARIES, Tokenizer

CONFIG, WEIGHTS, VOCAB, TOKENIZER_CONFIG, CARD = (
    "config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json", "README.md")
REMOTE_CODE = ("configuration_protein_performer.py", "modeling_protein_performer.py")
#: the export's list of the files it wrote: what ``overwrite`` may replace
JOURNAL = ".protein_performer_export.json"
MODEL_TYPE = "protein_performer"
#: config.json keys of the model (ModelConfig's); ``causal`` follows from the objective
MODEL_KEYS = tuple(f.name for f in fields(ModelConfig))
#: ... of which these must be there (the rest have defaults that cannot silently change the model)
REQUIRED = ("objective", "vocab_size", "tokenizer_version", "dim", "depth", "heads", "ff_mult", "position",
            "attention")
ARCHITECTURES = {"mlm": ("ProteinPerformerForMaskedLM", "AutoModelForMaskedLM"),
                 "clm": ("ProteinPerformerForCausalLM", "AutoModelForCausalLM")}
#: a real protein (ubiquitin), scored by export to check the written directory
CHECK_SEQUENCE = "MQIFVKTLTGKTITLEVEPSDTIENVKAKIQDKEGIPPDQQRLIFAGKQLEDGRTLSDYNIQKESTLHLVLRLRGG"


def is_pretrained_dir(path) -> bool:
    """True for a directory with a config.json: what ``load_pretrained`` opens (a .ckpt is a
    file). A directory that is incomplete still counts, so that loading it names what is wrong."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file()


# --- loading ----------------------------------------------------------------------------------
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
    model = {k: v for k, v in config.items() if k in MODEL_KEYS}
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


# --- export -----------------------------------------------------------------------------------
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
    from .files import refuse_overlap
    from .tasks import load_checkpoint  # reading a Lightning checkpoint needs Lightning; loading does not

    out, ckpt_path = Path(output_dir), Path(ckpt_path)
    refuse_overlap({"output": out}, {"ckpt": ckpt_path, "metrics": metrics})
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out}: exists and is not a directory")
    module = load_checkpoint(str(ckpt_path))
    step = checkpoint_step(ckpt_path)
    config = export_config(module.model.config, dict(module.hparams), step)
    evaluation = read_metrics(Path(metrics), config) if metrics else None
    card = model_card(config, module.model, step, _run_config(ckpt_path), evaluation)
    return write_model_dir(out, module.model, config, card, overwrite=overwrite)


def write_model_dir(out: Path, model: PerformerLM, config: dict, card: str, overwrite: bool = False) -> Path:
    """Write ``model`` as an exported directory ``out`` (export and convert-esm share this): one writer
    per output (a lock beside it), what a killed run left beside it finished or undone, an existing
    non-empty ``out`` replaced only with ``overwrite`` and only when export wrote it; the files go to
    ``.<name>.export.tmp``, are loaded back and checked to give ``model``'s logits, then renamed."""
    from .files import exclusive_lock
    tmp, old = (out.with_name(f".{out.name}.export.{what}") for what in ("tmp", "old"))
    with exclusive_lock(out.with_name(f".{out.name}.export.lock"), what=f"output {out}"):
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
            _write_tokenizer(tmp, Tokenizer(vocabulary=model.config.vocabulary))
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


def _check_export(d: Path, model: PerformerLM) -> None:
    """Load the written directory back and demand the checkpoint's logits (to float32 round-off:
    a forgotten buffer or setting changes them by far more)."""
    loaded, tok = load_pretrained(d)
    ids = torch.as_tensor(tok.encode(CHECK_SEQUENCE), dtype=torch.long)[None, :model.max_positions]
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


# --- model card -------------------------------------------------------------------------------



def model_card(config: dict, model: PerformerLM, step: int | None, run: dict | None, metrics: dict | None) -> str:
    """README.md: what the model is, what it was trained on, how well it does (only measured
    figures), what it is for and under which licences."""
    obj, att = config["objective"], config["attention"]
    arch, auto = ARCHITECTURES[obj]
    n_params = sum(p.numel() for p in model.parameters())
    n_buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    kernel = REGISTRY[att["kernel"]].label if att["kernel"] in REGISTRY else att["kernel"]
    random = att["kernel"] in REGISTRY and is_random(att["kernel"], att["relu_projection"])
    features = f", {att['nb_features']} random features per head" if random else ""
    kind = "masked-language-model (bidirectional)" if obj == "mlm" else "autoregressive (causal)"
    data = _training_data(run)
    lines = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {'fill-mask' if obj == 'mlm' else 'text-generation'}",
        "tags: [protein, protein-language-model, performer, linear-attention, protein-performer]",
        "---",
        "",
        f"# protein-performer {obj} model: {att['kernel']} attention",
        "",
        f"A {kind} protein language model trained with protein-performer, "
        f"with {kernel} attention{features}.",
        "",
        "## Model",
        "",
        "| | |", "|---|---|",
        f"| objective | {obj} ({'15 % of residues masked, 80/10/10' if obj == 'mlm' else 'next residue'}) |",
        f"| attention | `{att['kernel']}`: {kernel}{features} |",
        f"| size | {n_params:,} parameters ({n_params / 1e6:.2f} M; output head tied to the embedding)"
        + (f", plus {n_buffers:,} values of random-feature buffers" if n_buffers else "") + " |",
        f"| shape | dim {config['dim']}, depth {config['depth']}, heads {config['heads']}, "
        f"feed-forward {config['ff_mult']} x dim, {config['position']} positions"
        + (f" (up to {config['max_positions']})" if config["position"] == "learned" else "") + " |",
        f"| vocabulary | {config['vocab_size']} tokens (`vocab.txt`): <pad> <mask> <cls> <eos> <unk>, "
        f"20 standard amino acids, X B Z U O; a protein is `<cls> residues <eos>` |",
        "",
        "## Training",
        "",
        f"- steps: {step if step is not None else 'unknown'} optimizer steps",
        f"- data: {data['what']}",
    ]
    lines += [f"- {s}" for s in _run_settings(run)]
    lines += ["", "## Evaluation", ""] + _evaluation(metrics, obj)
    lines += ["", "## Intended use", "",
              "Research on protein sequence models: "
              + ("per-residue and per-protein embeddings (hidden states), masked-residue prediction, "
                 "scoring substitutions, fine-tuning." if obj == "mlm" else
                 "sequence log-likelihoods, embeddings, sampling new sequences (RNN-mode decoding in "
                 "protein-performer), fine-tuning."),
              "Not for clinical, diagnostic or other safety-relevant decisions: the only quality figures "
              "are the ones above, and no downstream (structure or function) evaluation is recorded here. "
              "Generated or predicted sequences are hypotheses, not validated proteins.",
              "", "## Use", "", "With protein-performer installed (no Lightning, no pickle):", "", "```python",
              "import torch, protein_performer",
              "model, tokenizer = protein_performer.load_pretrained(\"path/to/this/directory\")  # PerformerLM, eval mode",
              "ids = torch.as_tensor(tokenizer.encode(\"MKTAYIAKQR\"))[None]",
              "logits = model(ids)  # (1, L, vocab)",
              "hidden = model.encoder(ids)  # (1, L, dim), the final norm's output", "```", "",
              "With transformers only (torch and transformers >= 4.57; the model code is in this directory, "
              "self-contained, hence `trust_remote_code=True`):", "", "```python",
              f"from transformers import AutoTokenizer, {auto}",
              "tokenizer = AutoTokenizer.from_pretrained(\"path/to/this/directory\")  # upper-case residues",
              f"model = {auto}.from_pretrained(\"path/to/this/directory\", trust_remote_code=True)",
              "batch = tokenizer([\"MKTAYIAKQR\", \"MQIFVK\"], return_tensors=\"pt\", padding=True)",
              "logits = model(**batch).logits", "```", "",
              "The transformers code reproduces protein-performer's logits (tested to 1e-5) and returns hidden "
              "states with `output_hidden_states=True`; `AutoModel` opens the backbone alone (hidden states, "
              "for embeddings or a task head); it has no cache and no `generate()`"
              + (": sample with protein-performer's `scripts/generate.py`." if obj == "clm" else "."),
              "", "## Licence", "",
              f"- training data: {data['licence']}",
              "- code (`*.py` here and protein-performer): MIT.",
              "- weights: derived from the training data above; state their licence in this card's metadata "
              "(`license:`) before publishing."]
    return "\n".join(lines) + "\n"


def _training_data(run: dict | None) -> dict:
    """What the run trained on and the licence of that data, as far as its config tells."""
    data = (run or {}).get("data") or {}
    source = data.get("path") or data.get("url")
    if not source:
        return {"what": "not recorded (no run config.yaml next to the checkpoint's directory)",
                "licence": "unknown to the export: state it before publishing."}
    name = Path(str(source)).name
    uniprot = "CC BY 4.0 (UniProt data, https://www.uniprot.org/help/license; cite: The UniProt Consortium, " \
              "UniProt: the Universal Protein Knowledgebase)."
    if name == "swissprot_sample_20k.fasta.gz":
        return {"what": f"`{name}`, protein-performer's bundled sample of 20,000 UniProtKB/Swiss-Prot proteins "
                        "(release 2014-01, lengths 30-35,213), minus a validation split",
                "licence": uniprot}
    if any(s in str(source).lower() for s in ("uniprot", "sprot", "trembl", "uniref")):
        return {"what": f"`{name}` (UniProtKB)", "licence": uniprot}
    return {"what": f"`{name}`", "licence": f"unknown to the export (`{name}` is the user's file): state it "
                                             "before publishing."}


def _run_settings(run: dict | None) -> list[str]:
    if not run:
        return []
    data, optim, trainer = run.get("data") or {}, run.get("optim") or {}, run.get("trainer") or {}
    out = []
    if data.get("max_tokens"):
        out.append(f"batches: {data['max_tokens']:,} padded tokens each")
    elif data.get("batch_size"):
        out.append(f"batches: {data['batch_size']} proteins each")
    if data.get("max_len"):
        out.append(f"crops: at most {data['max_len']:,} tokens"
                   + (f", growing with the step ({data['crop_schedule']})" if data.get("crop_schedule") else ""))
    if optim.get("lr"):
        out.append(f"optimizer: AdamW, peak learning rate {optim['lr']}, warm-up {optim.get('warmup_steps')} steps")
    if trainer.get("precision"):
        out.append(f"precision: {trainer['precision']}")
    return out


def _evaluation(m: dict | None, objective: str) -> list[str]:
    if m is None:
        return ["Not evaluated: no held-out figures were given at export. Run protein-performer's "
                "`scripts/evaluate.py` and export again with `metrics=.../metrics.json`."]

    def f(v, pct=False):
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return "–"
        return f"{100 * v:.2f} %" if pct else f"{v:.3f}"
    ev = m.get("evaluation") or {}
    scored = ev.get("scored") or ("masked residues" if objective == "mlm" else "every residue")
    data = Path(str(m.get("data"))).name if m.get("data") else "a held-out set"
    out = [f"Held-out proteins: `{data}`, {m.get('num_sequences', '?')} proteins, {m['num_tokens']:,} scored "
           f"tokens ({scored}), measured by `scripts/evaluate.py` at step {m.get('step', '?')}. Baseline: "
           f"{ev.get('baseline') or 'the training amino-acid frequencies'}.", "",
           "| | model | amino-acid frequency baseline |", "|---|---|---|",
           f"| perplexity | {f(m['perplexity'])} | {f(m.get('baseline_perplexity'))} |",
           f"| accuracy | {f(m['accuracy'], True)} | {f(m.get('baseline_accuracy'), True)} |"]
    buckets = {k: b for k, b in (m.get("buckets") or {}).items() if b.get("num_sequences")}
    if buckets:
        out += ["", "By protein length (residues):", "",
                "| length | proteins | perplexity | baseline | accuracy |", "|---|---|---|---|---|"]
        out += [f"| {k} | {b['num_sequences']} | {f(b.get('perplexity'))} | {f(b.get('baseline_perplexity'))} | "
                f"{f(b.get('accuracy'), True)} |" for k, b in buckets.items()]
    return out

"""The model card (README.md of an exported directory): what the model is, what it was trained on,
how well it does (only measured figures), what it is for, under which licences."""
from __future__ import annotations

import math
from pathlib import Path

from ..attention.feature_maps import REGISTRY, is_random
from ..model import PerformerLM
from .load import ARCHITECTURES

#: the cards' tokenizer line: transformers' own class, no remote code (AutoTokenizer reads config.json
#: first, whose model type is this project's, and stops at a "[y/N]" prompt to run the directory's code)
TOKENIZER_LINE = "tokenizer = EsmTokenizer.from_pretrained(\"path/to/this/directory\")  # upper-case residues"


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
    if att.get("local_heads"):
        features += (f"; {att['local_heads']} of {config['heads']} heads exact softmax within "
                     f"{att['local_window']} positions (local heads)")
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
              f"from transformers import EsmTokenizer, {auto}",
              TOKENIZER_LINE,
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
        name = {"muon": "Muon on the hidden weight matrices, AdamW on the rest"}.get(optim.get("optimizer"), "AdamW")
        out.append(f"optimizer: {name}, peak learning rate {optim['lr']}, warm-up {optim.get('warmup_steps')} steps")
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

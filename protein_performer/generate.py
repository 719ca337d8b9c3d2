"""Sample proteins from a causal (objective=clm) model, decoding it as an RNN.

A causal linear-attention model carries a fixed-size state (S, Z) per layer and head, so
every new token costs the same time and memory whatever its position; exact-softmax
models carry a growing KV cache. Both go through :meth:`PerformerLM.step`, which also
handles rotary (offset by the state's position) and learned positions.

Sequences start as ``<cls> prompt``, fed in one call (the chunked causal path, which returns
the state after it); then each step feeds one token and samples the next from the model's
distribution after temperature, top-k and top-p filtering. Padding, <mask>,
<cls> and <unk> are never sampled; <eos> is suppressed until ``min_length`` residues
(prompt included) exist. A sequence stops at <eos> or at ``max_length`` residues (prompt
included); a batch stops when all of its sequences have.

Every sample is scored as it is drawn: the log-likelihood of each generated token (the
residues after the prompt, and the <eos> if one was drawn) under the model's own,
unfiltered distribution at temperature 1. :func:`composition_report` compares the
amino-acid composition of the generated residues with the training set's
(``hparams.aa_frequencies`` of the checkpoint).

    from protein_performer.generate import generate, load_generator
    model, loaded = load_generator("model.ckpt")
    samples = generate(model, num_samples=8, max_length=200, top_p=0.9, seed=0)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .device import resolve_device
from .hub.load import load_model
from .errors import UserError
from .files import write_json, write_text
from .output_guard import OutputGuard
from .tokenizer import AMINO_ACIDS, STANDARD_AA, Tokenizer


class GenerationError(UserError):
    """A bad generation request (checkpoint, prompt or setting), with a one-line message."""


@dataclass
class Sample:
    """One generated protein.

    ``sequence``: residues, prompt included. ``tokens``: every token of the sequence
    (``<cls>``, residues, and ``<eos>`` if one was drawn). ``log_likelihood``: summed
    log-probability (nats) of the ``num_scored`` generated tokens under the unfiltered
    model. ``logits`` (only with ``return_logits``): the step logits that predicted
    ``tokens[1:]``, shape (len(tokens) - 1, V).
    """

    sequence: str
    prompt: str
    tokens: list[int]
    stopped_at_eos: bool
    log_likelihood: float
    num_scored: int
    logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_generated(self) -> int:
        return len(self.sequence) - len(self.prompt)

    @property
    def mean_log_likelihood(self) -> float:
        return self.log_likelihood / self.num_scored if self.num_scored else float("nan")


# --- sampling primitives ------------------------------------------------------------------
def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the nucleus (top-p).

    top_k: keep the k largest logits (ties with the k-th are kept); 0 disables.
    top_p: keep the smallest set of most probable tokens whose total probability reaches
    top_p (the most probable token is always kept); 1.0 disables. Apply after temperature.
    """
    if top_k and top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs           # probability of the better tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens (B,) from logits (B, V): temperature, then top-k, then top-p; temperature
    0 picks the argmax (greedy)."""
    if temperature == 0:
        return logits.argmax(-1)
    filtered = filter_logits(logits.float() / temperature, top_k, top_p)
    return torch.multinomial(filtered.softmax(-1), 1, generator=generator).squeeze(-1)


def check_generate_settings(max_length: int, min_length: int, temperature: float, top_k: int, top_p: float,
                   num_samples: int, batch_size: int | None) -> None:
    """Raise :class:`GenerationError` with one line for any invalid setting."""
    if num_samples < 1:
        raise GenerationError(f"num_samples must be >= 1, got {num_samples}")
    if max_length < 1:
        raise GenerationError(f"max_length must be >= 1, got {max_length}")
    if not 0 <= min_length <= max_length:
        raise GenerationError(f"min_length must be between 0 and max_length={max_length}, got {min_length}")
    if temperature < 0 or not math.isfinite(temperature):
        raise GenerationError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise GenerationError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise GenerationError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if batch_size is not None and batch_size < 1:
        raise GenerationError(f"batch_size must be >= 1, got {batch_size}")


def encode_prompt(prompt: str | None, tokenizer: Tokenizer) -> list[int]:
    """Prompt residues -> ids (no <cls>/<eos>); an invalid residue raises one line."""
    if not prompt:
        return []
    prompt = "".join(str(prompt).split()).upper()
    bad = [(i, c) for i, c in enumerate(prompt) if c not in AMINO_ACIDS]
    if bad:
        i, c = bad[0]
        raise GenerationError(f"prompt: invalid residue {c!r} at position {i + 1} "
                              f"(allowed: {AMINO_ACIDS})")
    return [int(t) for t in tokenizer.encode(prompt, add_cls=False, add_eos=False)]


# --- decoding -------------------------------------------------------------------------------
@torch.no_grad()
def _generate_batch(model, tokenizer: Tokenizer, prefix: list[int], batch: int, max_length: int,
                    min_length: int, temperature: float, top_k: int, top_p: float,
                    generator: torch.Generator | None, device, return_logits: bool, progress) -> list[Sample]:
    n_prompt = len(prefix) - 1                                   # residues in the prompt
    banned = torch.zeros(tokenizer.vocab_size, dtype=torch.bool, device=device)
    banned[[tokenizer.pad_id, tokenizer.mask_id, tokenizer.cls_id, tokenizer.unk_id]] = True
    no_eos = banned.clone()
    no_eos[tokenizer.eos_id] = True

    state = model.init_state(batch, device)
    prefix_t = torch.tensor(prefix, dtype=torch.long, device=device)
    step_logits: list[torch.Tensor] = []
    if len(prefix) > 1:                                          # prefill <cls> and prompt[:-1] in one call
        logits, state = model.step(prefix_t[None, :-1].expand(batch, -1), state)
        if return_logits:
            step_logits += logits.float().cpu().unbind(1)

    generated = torch.full((batch, max(max_length - n_prompt, 0)), tokenizer.pad_id, dtype=torch.long,
                           device=device)  # preallocated: no per-token copy that grows with position
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    eos_hit = torch.zeros(batch, dtype=torch.bool, device=device)
    n_gen = torch.zeros(batch, dtype=torch.long, device=device)  # generated tokens, eos included
    loglik = torch.zeros(batch, dtype=torch.float64, device=device)
    cur = prefix_t[-1].expand(batch)
    n_res = n_prompt
    while n_res < max_length:
        logits, state = model.step(cur, state)
        if return_logits:
            step_logits.append(logits.float().cpu())
        logits = logits.float()
        mask = banned if n_res >= min_length else no_eos
        nxt = sample_next(logits.masked_fill(mask, float("-inf")), temperature, top_k, top_p, generator)
        active = ~finished
        logp = torch.log_softmax(logits, -1).gather(-1, nxt[:, None]).squeeze(-1)  # raw model, T = 1
        loglik += torch.where(active, logp.double(), torch.zeros_like(loglik))
        n_gen += active.long()
        is_eos = (nxt == tokenizer.eos_id) & active
        eos_hit |= is_eos
        finished |= is_eos
        generated[:, n_res - n_prompt] = nxt
        n_res += 1
        if progress is not None:
            progress.update(int(active.sum()))
        if bool(finished.all()):
            break
        cur = nxt

    out = []
    gen_cpu, n_gen_cpu, eos_cpu, ll_cpu = generated.cpu(), n_gen.cpu(), eos_hit.cpu(), loglik.cpu()
    all_logits = torch.stack(step_logits, dim=1) if return_logits and step_logits else None
    for b in range(batch):
        g = gen_cpu[b, : int(n_gen_cpu[b])].tolist()
        tokens = prefix + g
        residues = g[:-1] if bool(eos_cpu[b]) else g
        seq = tokenizer.decode(prefix[1:] + residues)
        lg = all_logits[b, : len(tokens) - 1] if all_logits is not None else None
        out.append(Sample(sequence=seq, prompt=tokenizer.decode(prefix[1:]), tokens=tokens,
                          stopped_at_eos=bool(eos_cpu[b]), log_likelihood=float(ll_cpu[b]),
                          num_scored=int(n_gen_cpu[b]), logits=lg))
    return out


def generate(model, num_samples: int = 1, max_length: int = 100, min_length: int = 0,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, prompt: str | None = None,
             seed: int | None = None, batch_size: int | None = None, device=None,
             tokenizer: Tokenizer | None = None, progress: bool = False,
             return_logits: bool = False) -> list[Sample]:
    """Sample ``num_samples`` proteins from a causal :class:`PerformerLM` in RNN mode.

    The model is put in eval mode (no dropout, no projection redraw). ``batch_size``
    sequences are decoded together (default: all). ``seed`` makes the samples
    reproducible for the same settings, batch size and device. See the module docstring
    for the length, eos and scoring rules.
    """
    tokenizer = tokenizer or Tokenizer()
    check_generate_settings(max_length, min_length, temperature, top_k, top_p, num_samples, batch_size)
    if not getattr(model, "causal", False):
        raise GenerationError("generation needs a causal model (trained with objective=clm); "
                              "this one is bidirectional (objective=mlm)")
    prompt_ids = encode_prompt(prompt, tokenizer)
    if len(prompt_ids) >= max_length:  # not an empty sample scored nan: the user asked for generated residues
        raise GenerationError(f"prompt has {len(prompt_ids)} residues, max_length={max_length} leaves none to generate "
                              f"(max_length counts the prompt): give max_length above {len(prompt_ids)}")
    if getattr(model, "pos_embed", None) is not None and max_length > model.max_positions:
        raise GenerationError(f"max_length={max_length} exceeds the model's learned positions "
                              f"(model.max_positions={model.max_positions}); generate shorter proteins")
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    model.eval()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(seed))
    bs = batch_size or num_samples
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=num_samples * max(max_length - len(prompt_ids), 0) or None, unit="tok",
                   desc="generating", dynamic_ncols=True)
    samples: list[Sample] = []
    try:
        while len(samples) < num_samples:
            b = min(bs, num_samples - len(samples))
            samples += _generate_batch(model, tokenizer, [tokenizer.cls_id] + prompt_ids, b, max_length,
                                       min_length, temperature, top_k, top_p, generator, device,
                                       return_logits, bar)
    finally:
        if bar is not None:
            bar.close()
    return samples


# --- reports and output -----------------------------------------------------------------------
def residue_frequencies(sequences: Sequence[str]) -> dict[str, float]:
    """Frequency of every amino acid (standard and extra) over all residues of ``sequences``."""
    counts = {aa: 0 for aa in AMINO_ACIDS}
    for s in sequences:
        for c in s:
            counts[c] += 1
    total = sum(counts.values())
    return {aa: (n / total if total else 0.0) for aa, n in counts.items()}


def composition_report(samples: Sequence[Sample], aa_frequencies: Sequence[float] | None,
                       tokenizer: Tokenizer | None = None) -> dict:
    """Amino-acid composition of the generated residues (prompts excluded) against the
    training frequencies (over the vocabulary, as stored in the checkpoint), with the total
    variation distance and KL(generated || training) in nats."""
    tokenizer = tokenizer or Tokenizer()
    gen = residue_frequencies([s.sequence[len(s.prompt):] for s in samples])
    report: dict = {"generated": gen, "training": None, "total_variation": None, "kl_generated_training": None}
    if aa_frequencies is not None:
        freqs = list(aa_frequencies)
        train = {aa: float(freqs[tokenizer.aa_offset + i]) for i, aa in enumerate(AMINO_ACIDS)}
        z = sum(train.values()) or 1.0
        train = {aa: f / z for aa, f in train.items()}
        report["training"] = train
        report["total_variation"] = 0.5 * sum(abs(gen[a] - train[a]) for a in AMINO_ACIDS)
        report["kl_generated_training"] = sum(gen[a] * math.log(gen[a] / max(train[a], 1e-12))
                                              for a in AMINO_ACIDS if gen[a] > 0)
    return report


def likelihood_summary(samples: Sequence[Sample]) -> dict:
    """Mean per-token log-likelihood: token-weighted over all samples, and the mean and
    median of the per-sample means; plus lengths and how many stopped at eos."""
    scored = [s for s in samples if s.num_scored]
    total_tokens = sum(s.num_scored for s in scored)
    per_sample = sorted(s.mean_log_likelihood for s in scored)
    lengths = sorted(len(s.sequence) for s in samples)
    return {
        "mean_log_likelihood_per_token": (sum(s.log_likelihood for s in scored) / total_tokens
                                          if total_tokens else float("nan")),
        "perplexity": (math.exp(-sum(s.log_likelihood for s in scored) / total_tokens)
                       if total_tokens else float("nan")),
        "mean_of_sample_means": sum(per_sample) / len(per_sample) if per_sample else float("nan"),
        "median_of_sample_means": per_sample[len(per_sample) // 2] if per_sample else float("nan"),
        "scored_tokens": total_tokens,
        "num_samples": len(samples),
        "stopped_at_eos": sum(s.stopped_at_eos for s in samples),
        "median_length": lengths[len(lengths) // 2] if lengths else 0,
        "min_length": lengths[0] if lengths else 0,
        "max_length": lengths[-1] if lengths else 0,
    }


def _header_value(v) -> str:
    return "none" if v is None or v == "" else str(v).replace(" ", "_")


def write_fasta(path: str, samples: Sequence[Sample], settings: dict, width: int = 60) -> None:
    """FASTA with one record per sample; every header carries the sample's length, stop
    reason and mean log-likelihood, then the generation settings as key=value. Written
    beside, then renamed: an existing file is replaced only by a whole one."""
    common = " ".join(f"{k}={_header_value(v)}" for k, v in settings.items())
    lines = []
    for i, s in enumerate(samples):
        lines.append(f">sample_{i} length={len(s.sequence)} stop={'eos' if s.stopped_at_eos else 'max_length'} "
                     f"mean_loglik={s.mean_log_likelihood:.4f} {common}\n")
        lines += [s.sequence[j:j + width] + "\n" for j in range(0, len(s.sequence), width)]
        if not s.sequence:
            lines.append("\n")
    write_text(path, "".join(lines))


def report_path(output: str) -> str:
    """Where the JSON report of FASTA ``output`` goes: ``OUT.json`` for ``OUT.fasta``, and
    ``OUT.report.json`` when the output itself ends in .json (never the FASTA itself)."""
    stem, suffix = os.path.splitext(output)
    return stem + (".report.json" if suffix.lower() == ".json" else ".json")


def format_report(report: dict, summary: dict) -> str:
    """Human-readable lines: likelihood summary and the composition table."""
    lines = [f"samples: {summary['num_samples']}, stopped at eos: {summary['stopped_at_eos']}, "
             f"length median {summary['median_length']} (min {summary['min_length']}, max {summary['max_length']})",
             f"mean per-token log-likelihood: {summary['mean_log_likelihood_per_token']:.4f} nats "
             f"(perplexity {summary['perplexity']:.3f}) over {summary['scored_tokens']} generated tokens"]
    train = report["training"]
    lines.append("aa   generated  training" if train else "aa   generated")
    for aa in STANDARD_AA:
        g = report["generated"][aa]
        lines.append(f"{aa}    {g:9.4f}  {train[aa]:8.4f}" if train else f"{aa}    {g:9.4f}")
    extra = sum(report["generated"][a] for a in AMINO_ACIDS if a not in STANDARD_AA)
    lines.append(f"XBZUO {extra:8.4f}" + (f"  {sum(train[a] for a in AMINO_ACIDS if a not in STANDARD_AA):8.4f}"
                                           if train else ""))
    if train:
        lines.append(f"total variation distance {report['total_variation']:.4f}, "
                     f"KL(generated||training) {report['kl_generated_training']:.4f} nats")
    else:
        lines.append("the checkpoint has no training amino-acid frequencies to compare with")
    return "\n".join(lines)


# --- checkpoint + end-to-end ------------------------------------------------------------------
def load_generator(ckpt: str, device="cpu"):
    """Load a causal model: (PerformerLM in eval mode, its LoadedModel). One-line errors for
    a missing/unreadable file and for a non-causal (mlm) model."""
    if not ckpt:
        raise GenerationError("no checkpoint given: pass ckpt=PATH")
    loaded = load_model(str(ckpt), device=device)
    if loaded.objective != "clm" or not loaded.causal:
        raise GenerationError(f"checkpoint {ckpt}: trained with objective={loaded.objective}; "
                              "generation needs a causal model (objective=clm)")
    return loaded.net, loaded


def run(ckpt: str, output: str, num_samples: int = 10, max_length: int = 256, min_length: int = 0,
        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, prompt: str | None = None,
        seed: int | None = 0, batch_size: int | None = None, device: str | None = "auto",
        progress: bool = True, overwrite: bool = False) -> dict:
    """Everything ``scripts/generate.py`` does: load, sample, write ``output`` (FASTA) and
    :func:`report_path` (settings, per-sample scores, composition vs
    training), print the report. Returns the JSON payload. An existing ``output`` or report is
    replaced only with ``overwrite`` (:class:`~protein_performer.output_guard.OutputGuard`)."""
    if not output:
        raise GenerationError("no output given: pass output=OUT.fasta")
    json_path = report_path(output)
    guard = OutputGuard("generate", {"ckpt": ckpt or None}, overwrite=overwrite)
    guard.file("output", output)
    guard.file("output (its report)", json_path)
    guard.sweep()
    check_generate_settings(max_length, min_length, temperature, top_k, top_p, num_samples, batch_size)
    try:
        dev = resolve_device(device)
    except ValueError as e:
        raise GenerationError(str(e)) from e
    model, loaded = load_generator(ckpt, device=dev)
    tokenizer = loaded.tokenizer
    prompt = "".join(str(prompt).split()).upper() if prompt else ""
    encode_prompt(prompt, tokenizer)  # validate before any work
    samples = generate(model, num_samples=num_samples, max_length=max_length, min_length=min_length,
                       temperature=temperature, top_k=top_k, top_p=top_p, prompt=prompt, seed=seed,
                       batch_size=batch_size, device=dev, tokenizer=tokenizer, progress=progress)
    settings = dict(ckpt=os.path.basename(str(ckpt)), temperature=temperature, top_k=top_k, top_p=top_p,
                    min_length=min_length, max_length=max_length, prompt=prompt or None, seed=seed,
                    batch_size=batch_size or num_samples)
    write_fasta(output, samples, settings)
    freqs = loaded.aa_frequencies
    report = composition_report(samples, None if freqs is None else freqs.tolist(), tokenizer)
    summary = likelihood_summary(samples)
    payload = {"settings": {**settings, "ckpt": str(ckpt), "num_samples": num_samples, "device": str(dev)},
               "summary": summary, "composition": report,
               "samples": [{"id": f"sample_{i}", "length": len(s.sequence), "stopped_at_eos": s.stopped_at_eos,
                            "mean_log_likelihood": s.mean_log_likelihood, "log_likelihood": s.log_likelihood,
                            "scored_tokens": s.num_scored} for i, s in enumerate(samples)]}
    write_json(json_path, payload, indent=2)
    print(format_report(report, summary))
    print(f"wrote {len(samples)} proteins to {output} and the report to {json_path}")
    return payload


__all__ = ["Sample", "GenerationError", "filter_logits", "sample_next", "generate", "residue_frequencies",
           "composition_report", "likelihood_summary", "write_fasta", "load_generator", "run",
           "encode_prompt", "check_generate_settings", "format_report", "report_path", "resolve_device"]

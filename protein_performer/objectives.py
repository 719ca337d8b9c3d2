"""Training objectives and the one way the project scores a model.

* ``mask_tokens`` / ``clm_labels``: what training sees (masked-LM corruption 80/10/10;
  next-token labels, ``<eos>`` included).
* ``scored_example``: what validation and evaluation score, one protein at a time, so
  the masks of a protein depend only on (seed, the protein), never on its batch: masked-LM
  scores the selected residues, causal LM every residue given the ones before it (not
  ``<eos>``, so the model and the amino-acid baseline score the same positions).
* ``score_rows`` + ``Scores``: float64 sums per row (NLL, correct, count and the same for
  the amino-acid-frequency baseline) and the figures made from them. Training validation,
  ``evaluate`` and ``compare`` all go through these two, so a perplexity means the same
  thing everywhere: exp(summed NLL / scored tokens).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .errors import UserError
from .tokenizer import Tokenizer

IGNORE = -100
#: the masked-LM selection rate (BERT's): the one default of every ``mask_prob``
MASK_PROB = 0.15
SUMS = ("nll", "correct", "count", "base_nll", "base_correct")


def check_objective(objective: str) -> str:
    if objective not in ("mlm", "clm"):
        raise UserError(f"objective must be 'mlm' or 'clm', got {objective!r}")
    return objective


def train_mask_rate(mask_prob: float, train_mask_prob: float | None) -> float:
    """The training batches' masking rate: ``train_mask_prob``, or ``mask_prob`` when None; a rate outside
    (0, 1] is refused (one line) rather than masking everything or nothing."""
    rate = mask_prob if train_mask_prob is None else train_mask_prob
    if train_mask_prob is not None and not 0 < float(train_mask_prob) <= 1:
        raise UserError(f"objective.train_mask_prob must be in (0, 1] or null, got {train_mask_prob}")
    return rate


def mask_tokens(tokens: torch.Tensor, tokenizer: Tokenizer, generator: torch.Generator | None = None,
                mask_prob: float = MASK_PROB) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT-style corruption. Each residue is selected with ``mask_prob``; a selected residue
    becomes <mask> 80 % of the time, a random standard amino acid 10 %, itself 10 %.
    Returns (inputs, labels) where labels are IGNORE except at selected positions."""
    residue = tokens >= tokenizer.aa_offset
    u = torch.rand(tokens.shape, generator=generator)
    selected = residue & (u < mask_prob)
    labels = torch.where(selected, tokens, torch.full_like(tokens, IGNORE))
    action = torch.rand(tokens.shape, generator=generator)
    inputs = tokens.clone()
    inputs[selected & (action < 0.8)] = tokenizer.mask_id
    rand_ids = torch.tensor(tokenizer.standard_aa_ids)[
        torch.randint(len(tokenizer.standard_aa_ids), tokens.shape, generator=generator)]
    swap = selected & (action >= 0.8) & (action < 0.9)
    inputs[swap] = rand_ids[swap].to(inputs.dtype)
    return inputs, labels


def clm_labels(tokens: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token prediction: inputs are tokens[:-1], labels tokens[1:] with padding ignored."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[labels == pad_id] = IGNORE
    return inputs, labels


def protein_generator(seed: int, tokens) -> torch.Generator:
    """A generator seeded from (seed, the protein's tokens) alone."""
    h = hashlib.sha256(f"protein-performer-eval:{int(seed)}:".encode() + np.asarray(tokens, np.uint8).tobytes())
    return torch.Generator().manual_seed(int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1))


def scored_example(tokens, objective: str, tokenizer: Tokenizer, seed: int = 0,
                   mask_prob: float = MASK_PROB) -> tuple[torch.Tensor, torch.Tensor]:
    """One protein's (or crop's) model inputs and labels for scoring (IGNORE where not
    scored), reproducible from (seed, the tokens) alone."""
    t = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    if check_objective(objective) == "mlm":
        inputs, labels = mask_tokens(t[None], tokenizer, protein_generator(seed, tokens), mask_prob)
        return inputs[0], labels[0]
    inputs, labels = t[:-1], t[1:].clone()
    labels[labels < tokenizer.aa_offset] = IGNORE  # residues only (not <eos>)
    return inputs, labels


def score_rows(logits: torch.Tensor, labels: torch.Tensor, frequencies: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    """Float64 sums per row of a (B, L, V) batch over positions whose label != IGNORE:
    ``nll``, ``correct``, ``count`` and, given amino-acid ``frequencies`` over the
    vocabulary, the baseline's ``base_nll`` / ``base_correct`` (the Performer paper's
    empirical baseline: every residue predicted from the frequencies alone)."""
    scored = labels != IGNORE
    safe = labels.masked_fill(~scored, 0)
    logp = torch.log_softmax(logits.double(), -1)
    nll = -logp.gather(-1, safe[..., None])[..., 0]
    out = {"nll": torch.where(scored, nll, 0.0).sum(-1),
           "correct": ((logits.argmax(-1) == labels) & scored).sum(-1).double(),
           "count": scored.sum(-1).double()}
    if frequencies is not None:
        logf = frequencies.to(logits.device, torch.float64).clamp(min=1e-12).log()
        out["base_nll"] = torch.where(scored, -logf[safe], 0.0).sum(-1)
        out["base_correct"] = ((labels == int(frequencies.argmax())) & scored).sum(-1).double()
    return out


@dataclass
class Scores:
    """Sums from which token-weighted figures are exact across batches, ranks and buckets."""
    nll: float = 0.0
    correct: float = 0.0
    count: float = 0.0
    base_nll: float = 0.0
    base_correct: float = 0.0
    sequences: int = 0

    def add(self, other: "Scores | dict") -> "Scores":
        other = asdict(other) if isinstance(other, Scores) else other
        for k, v in other.items():
            setattr(self, k, getattr(self, k) + (float(v) if k != "sequences" else int(v)))
        return self

    def metrics(self, baseline: bool = True) -> dict:
        """perplexity = exp(summed NLL / scored tokens), accuracy, loss, counts and the
        baseline's; None where nothing was scored (or there is no baseline)."""
        n = self.count
        out = {"perplexity": None, "accuracy": None, "loss": None, "num_tokens": int(n),
               "num_sequences": int(self.sequences), "baseline_perplexity": None, "baseline_accuracy": None}
        if n:
            out["loss"] = self.nll / n
            out["perplexity"] = math.exp(min(out["loss"], 700.0))
            out["accuracy"] = self.correct / n
            if baseline:
                out["baseline_perplexity"] = math.exp(min(self.base_nll / n, 700.0))
                out["baseline_accuracy"] = self.base_correct / n
        return out

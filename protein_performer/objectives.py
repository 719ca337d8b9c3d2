"""Training objectives: masked-LM corruption (80/10/10) and the token-weighted loss,
perplexity and accuracy shared by training, validation and evaluation."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .tokenizer import Tokenizer

IGNORE = -100


def mask_tokens(tokens: torch.Tensor, tokenizer: Tokenizer, generator: torch.Generator | None = None,
                mask_prob: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
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


@dataclass
class TokenStats:
    """Sums that make token-weighted metrics exact across batches and ranks."""
    nll: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor

    @property
    def loss(self) -> float:
        return (self.nll / self.count.clamp(min=1)).item()

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))

    @property
    def accuracy(self) -> float:
        return (self.correct / self.count.clamp(min=1)).item()


def token_stats(logits: torch.Tensor, labels: torch.Tensor) -> TokenStats:
    """Summed NLL, number correct and number scored over positions whose label != IGNORE."""
    flat_logits = logits.reshape(-1, logits.size(-1)).float()
    flat_labels = labels.reshape(-1)
    nll = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE, reduction="sum")
    scored = flat_labels != IGNORE
    correct = (flat_logits.argmax(-1) == flat_labels) & scored
    return TokenStats(nll, correct.sum(), scored.sum())


def unigram_baseline(frequencies: torch.Tensor, labels: torch.Tensor) -> TokenStats:
    """The empirical baseline of the Performer paper: predict every residue from amino-acid
    frequencies alone (``frequencies`` over the whole vocabulary, summing to 1)."""
    logits = frequencies.clamp(min=1e-12).log().expand(*labels.shape, -1)
    return token_stats(logits, labels)

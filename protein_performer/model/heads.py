"""Heads over :class:`~protein_performer.model.PerformerEncoder`'s hidden states (B, L, dim).

The language model's head is tied to the token embedding; the task heads (a value per
protein, a label per residue) are what fine-tuning adds on top of a pretrained encoder, and
:class:`FineTuneNet` is the two together (what ``finetune`` trains and ``export`` writes).
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError
from ..tokenizer import Tokenizer
from .pooling import end_masks, masked_mean, residue_mask


class LMHead(nn.Module):
    """Logits ``hidden @ E^T + bias``: E is the token embedding, passed in at the call rather
    than held, so that the matrix exists (and is stored) once."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, embedding_weight, self.bias)


class EsmLMHead(LMHead):
    """ESM's LM head (fair-esm's RobertaLMHead, transformers' EsmLMHead): dense -> GELU (erf) ->
    LayerNorm, then the tied projection ``@ E^T + bias``: what a model converted from ESM-2 needs."""

    def __init__(self, dim: int, vocab_size: int, eps: float = 1e-5):
        super().__init__(vocab_size)  # bias first: still the model's first parameter
        self.dense, self.norm = nn.Linear(dim, dim), nn.LayerNorm(dim, eps=eps)

    def forward(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(F.gelu(self.dense(hidden))), embedding_weight)


class SequenceClassificationHead(nn.Module):
    """One output vector per protein: the mean of the hidden states over its residues, then
    dropout and a linear layer. ``num_outputs`` classes (logits), or 1 for a regression."""

    def __init__(self, dim: int, num_outputs: int, dropout: float = 0.0):
        super().__init__()
        self.drop, self.out = nn.Dropout(dropout), nn.Linear(dim, num_outputs)

    def forward(self, hidden: torch.Tensor, residues: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, L, dim), residues (B, L) True where to pool (:func:`residue_mask`; None:
        every position) -> (B, num_outputs)."""
        return self.out(self.drop(masked_mean(hidden, residues)))

    def probe_features(self, hidden: torch.Tensor, residues: torch.Tensor | None = None) -> torch.Tensor:
        """(B, in_features): what the linear layer reads before any training (a linear probe's features)."""
        return masked_mean(hidden, residues)


#: pooling=termini: the residues at each end of a protein whose mean the head reads too (N-terminal
#: signal and transit peptides run 15 to 80 residues; docs/downstream.md, "pooling=termini")
TERMINUS = 50


class LayerMeansHead(nn.Module):
    """One output vector per protein from every layer: the mean over its residues of each hidden state
    (the token embedding, each block, the final norm), side by side, then dropout and a linear layer.
    Why: lower layers keep what the last one has traded for the masked-LM objective (a linear probe of
    all of them beats the last alone: docs/probe_features.md).  With ``ends`` = k > 0 (pooling=termini)
    also the last hidden state's mean over the protein's first k and last k residues: where a protein
    goes is written at its ends (signal and transit peptides), and a whole-protein mean dilutes them."""

    wants_layers = True  # FineTuneNet passes the list of hidden states, not the last one

    def __init__(self, dim: int, num_outputs: int, dropout: float = 0.0, layers: int = 1, ends: int = 0):
        super().__init__()
        self.layers, self.ends = int(layers), int(ends)
        width = dim * (self.layers + (2 if self.ends else 0))
        self.drop, self.out = nn.Dropout(dropout), nn.Linear(width, num_outputs)

    def forward(self, hidden: list[torch.Tensor], residues: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: ``layers`` tensors (B, L, dim), residues (B, L) True where to pool -> (B, num_outputs)."""
        return self.out(self.drop(self.probe_features(hidden, residues)))

    def probe_features(self, hidden: list[torch.Tensor], residues: torch.Tensor | None = None) -> torch.Tensor:
        if len(hidden) != self.layers:
            raise ValueError(f"pooling=layers: {len(hidden)} hidden states for a head of {self.layers}")
        means = [masked_mean(h, residues) for h in hidden]
        if self.ends:
            mask = residues if residues is not None else torch.ones(hidden[-1].shape[:2], dtype=torch.bool,
                                                                    device=hidden[-1].device)
            means += [masked_mean(hidden[-1], m) for m in end_masks(mask, self.ends)]
        return torch.cat(means, -1)


class TokenClassificationHead(nn.Module):
    """One output vector per position (e.g. secondary structure per residue): dropout and a
    linear layer; with ``window`` = w > 0, plus a linear map of the hidden states of the w residues
    on either side (a convolution over residues only, zero at the start: the head begins as the
    plain linear one; local structure depends on neighbours). Padding, <cls> and <eos> get outputs
    too; the loss leaves them out."""

    def __init__(self, dim: int, num_outputs: int, dropout: float = 0.0, window: int = 0):
        super().__init__()
        self.drop, self.out = nn.Dropout(dropout), nn.Linear(dim, num_outputs)
        self.window = int(window)
        self.context = nn.Conv1d(dim, num_outputs, 2 * self.window + 1, padding=self.window, bias=False) \
            if self.window else None
        if self.context is not None:
            nn.init.zeros_(self.context.weight)

    def forward(self, hidden: torch.Tensor, residues: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, L, dim), residues (B, L) True at residues (the window sees only those, so a
        protein's outputs do not depend on its batch's padding) -> (B, L, num_outputs)."""
        x = self.drop(hidden)
        y = self.out(x)
        if self.context is not None:
            if residues is not None:
                x = x * residues.unsqueeze(-1).to(x.dtype)
            y = y + self.context(x.transpose(1, 2)).transpose(1, 2)
        return y


class AttentionPoolingHead(nn.Module):
    """One output vector per protein, pooled by learned weights instead of a plain mean: a
    linear score per residue, softmax over the protein's residues, the weighted sum of the
    hidden states, then dropout and a linear layer (a motif can outweigh the composition)."""

    def __init__(self, dim: int, num_outputs: int, dropout: float = 0.0):
        super().__init__()
        self.score = nn.Linear(dim, 1)
        self.drop, self.out = nn.Dropout(dropout), nn.Linear(dim, num_outputs)

    def forward(self, hidden: torch.Tensor, residues: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, L, dim), residues (B, L) True where to pool (None: every position) ->
        (B, num_outputs)."""
        s = self.score(hidden).squeeze(-1).float()
        if residues is not None:
            s = s.masked_fill(~residues, float("-inf"))
        w = torch.softmax(s, -1).nan_to_num(0.0).to(hidden.dtype)  # a row without residues pools to 0
        return self.out(self.drop(torch.einsum("bl,bld->bd", w, hidden)))

    def probe_features(self, hidden: torch.Tensor, residues: torch.Tensor | None = None) -> torch.Tensor:
        """The plain mean: a probe folded into this head zeroes its scores (head_init=probe)."""
        return masked_mean(hidden, residues)


# --- an encoder with a task head (what finetune trains and export writes) ------------------
#: the projections LoRA adapts: attention's q/k/v and output, the feed-forward's two layers
LORA_TARGETS = ("to_qkv", "to_out", "fc1", "fc2")


def check_freeze(how, depth: int | None = None) -> None:
    """``freeze``: all, none, or a number of layers from 0 to ``depth`` (None: not known yet, any
    number from 0); one line otherwise, so that finetune refuses it before any work."""
    if str(how).lower() in ("all", "none") or (isinstance(how, int) and not isinstance(how, bool) and 0 <= how
                                                and (depth is None or how <= depth)):
        return
    raise UserError(f"freeze={how!r}: all, none, or a number of layers from 0 to "
                    f"{depth if depth is not None else 'the model depth'}")


def check_lora(rank, alpha) -> None:
    """LoRA's settings and peft, in one line each, so that finetune refuses them before any work."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserError("lora=true needs peft: pip install 'protein-performer[lora]'") from None
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1) or not alpha > 0:
        raise UserError(f"lora_rank={rank!r}, lora_alpha={alpha!r}: a positive integer rank and a positive alpha")


def mix_outputs(tuned: torch.Tensor, probe: torch.Tensor, share: float, task: str) -> torch.Tensor:
    """An output-space ensemble (WiSE-FT's output mix, Wortsman et al. 2022): ``share`` of the fine-tuned
    network's and the rest of the probe's. Classes: the log of the mixed probabilities (logits whose
    softmax is the mix; formed by logaddexp of log-softmaxes, so nothing overflows), in float32;
    regression: the mixed values (both heads predict standardized values)."""
    if task == "regression":
        return share * tuned.float() + (1 - share) * probe.float()
    return torch.logaddexp(F.log_softmax(tuned.float(), -1) + math.log(share),
                           F.log_softmax(probe.float(), -1) + math.log1p(-share))
TASK_HEADS = {"mean": SequenceClassificationHead, "attention": AttentionPoolingHead, "layers": LayerMeansHead,
              "termini": LayerMeansHead}


class FineTuneNet(nn.Module):
    """An encoder and a task head: (B, L) tokens -> (B, outputs), or (B, L, outputs) per residue
    (``task="residue"``). Its state_dict keys are ``encoder.*`` and ``head.*``, as the fine-tuned
    model.safetensors and the transformers code of an exported head have them; with a probe attached
    (:meth:`attach_probe`, finetune's default ensemble) also ``probe.encoder.*`` and ``probe.head.*``."""

    def __init__(self, encoder: nn.Module, task: str, num_outputs: int, pooling: str = "mean",
                 dropout: float = 0.1, window: int = 0):
        super().__init__()
        if pooling not in TASK_HEADS:
            raise UserError(f"pooling={pooling!r}: choose one of {', '.join(TASK_HEADS)}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise UserError(f"window={window!r}: a number of residues on each side, 0 or more")
        if window and task != "residue":
            raise UserError(f"window={window}: a per-residue head's context (task=residue), not task={task}")
        self.task, self.encoder = task, encoder
        dim = encoder.config.dim
        self.head = (TokenClassificationHead(dim, num_outputs, dropout, window) if task == "residue"
                     else LayerMeansHead(dim, num_outputs, dropout, encoder.depth + 1,
                                         TERMINUS if pooling == "termini" else 0) if pooling in ("layers", "termini")
                     else TASK_HEADS[pooling](dim, num_outputs, dropout))
        self.frozen: list[nn.Module] = []
        self.probe: FineTuneNet | None = None  # attach_probe: the frozen encoder and the probe's head
        self.share = 1.0  # this network's share of the output mix with the probe
        # the encoder's vocabulary (a model converted from ESM reads ESM's ids)
        self.tokenizer = Tokenizer(vocabulary=getattr(encoder.config, "vocabulary", "protein-performer"))
        for m in encoder.modules():  # the projections it was trained with: the head learns on those
            if hasattr(m, "redraw_interval"):
                m.redraw_interval = 0

    def hidden(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """What the head reads: the encoder's output (B, L, dim), or (pooling=layers, termini) every hidden state."""
        if getattr(self.head, "wants_layers", False):
            return self.encoder(tokens, padding_mask, return_layers=True)[1]
        return self.encoder(tokens, padding_mask)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.head(self.hidden(tokens, padding_mask), residue_mask(tokens, self.tokenizer))
        if self.probe is None:
            return out
        return mix_outputs(out, self.probe(tokens, padding_mask), self.share, self.task)

    def attach_probe(self, probe: FineTuneNet, share: float) -> None:
        """Predict with an output-space ensemble: ``share`` of this network's outputs and the rest of
        ``probe``'s (:func:`mix_outputs`; ``probe``: the checkpoint's encoder, frozen, and the linear
        probe as its head). Its weights are frozen and saved with this network's."""
        if not 0 < share < 1:
            raise UserError(f"ensemble={share!r}: the fine-tuned network's share of the mix, in (0, 1)")
        if probe.task != self.task or probe.probe is not None:
            raise ValueError("attach_probe: a plain network of the same task")
        probe.requires_grad_(False)
        self.probe, self.share = probe.eval(), float(share)

    def detach_probe(self) -> None:
        """Predict with this network alone again."""
        self.probe, self.share = None, 1.0

    def freeze(self, how) -> None:
        """``all``, ``none`` or N (the embedding and the first N blocks): frozen parts get no
        gradient and stay in eval mode (no dropout), so their weights stay bit-identical."""
        enc = self.encoder
        check_freeze(how, enc.depth)
        if str(how).lower() == "all":
            parts = [enc]
        elif str(how).lower() == "none":
            parts = []
        else:
            parts = [enc.embed, enc.pos_embed, *enc.blocks[:how]] if how else []
        self.frozen = [m for m in parts if m is not None]
        for m in self.frozen:
            m.requires_grad_(False)

    def train(self, mode: bool = True):
        super().train(mode)
        for m in [*self.frozen, *([self.probe] if self.probe is not None else [])]:
            m.eval()
        return self

    def checkpoint_blocks(self) -> None:
        """Recompute each block's activations in the backward pass instead of keeping them:
        memory for one block's activations, not ``depth`` of them (long proteins fit)."""
        from torch.utils.checkpoint import checkpoint

        def run(forward, x, mask):
            return checkpoint(forward, x, mask, use_reentrant=False) if torch.is_grad_enabled() else forward(x, mask)
        for block in self.encoder.blocks:
            block.forward = partial(run, block.forward)

    def add_lora(self, rank: int, alpha: float, dropout: float = 0.0) -> None:
        """LoRA (peft) on every attention and feed-forward projection: ``W x + (alpha / rank) B A x``
        with B = 0 at the start (the network computes what it did); the encoder's own weights
        are frozen, the adapters and the head train."""
        check_lora(rank, alpha)
        from peft import LoraConfig, inject_adapter_in_model
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(LORA_TARGETS),
                            bias="none")
        inject_adapter_in_model(config, self.encoder)  # freezes everything in the encoder but the adapters

    def merge_lora(self) -> None:
        """Fold each adapter into its weight (W + (alpha / rank) B A) and put the plain layer back:
        the network's keys and its saved weights are those of a network without LoRA."""
        from peft.tuners.lora import LoraLayer
        for name, m in [(n, m) for n, m in self.encoder.named_modules() if isinstance(m, LoraLayer)]:
            m.merge()
            parent, _, child = name.rpartition(".")
            setattr(self.encoder.get_submodule(parent) if parent else self.encoder, child, m.get_base_layer())
        if self.probe is not None:  # a copy of the network before training: its adapters are still zero
            self.probe.merge_lora()

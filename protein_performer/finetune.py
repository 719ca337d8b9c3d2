"""Fine-tuning: a supervised head on a pretrained encoder (``protein-performer finetune``).

labels (a CSV, or FLIP's per-residue FASTA) -> examples with a train / valid / test split ->
the checkpoint's :class:`~protein_performer.model.PerformerEncoder` + a head from
:mod:`protein_performer.model.heads`, trained by a Lightning Trainer on token-budget batches and
early-stopped on the validation loss (the best weights kept) -> in ``output_dir``:
``metrics.json`` and ``predictions.csv`` on the test split, ``model.safetensors`` (encoder +
head) and ``finetune.json`` (what :func:`~protein_performer.hub.export.load_finetuned` needs to rebuild
them, and the settings it was trained with: pooling, dropout, freeze, head_init, schedule, warmup;
``export ckpt=output_dir`` makes a transformers directory of them).

Every input is read and checked before the model trains, and nothing is written before the
training ends: a bad file is one line naming file and line, with nothing written.
"""
from __future__ import annotations

import csv
import io
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import UserError, first_line
from .files import (WrittenFiles, atomic_path, dead_temporaries, exclusive_lock, remove_path, write_json,
                    write_text)
from .output_guard import OutputGuard
from .hub.export import FINETUNE_CONFIG as CONFIG
from .probe import check_classes, check_test_overlap, repeated
from .model.heads import FineTuneNet
from .formats.fasta import read_fasta
from .formats.tabular import csv_reader, sequence_id
from .formats.text import numbered_lines
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

TASKS = ("classification", "regression", "residue")
SPLITS = ("train", "valid", "test")
METRICS, PREDICTIONS, WEIGHTS = "metrics.json", "predictions.csv", "model.safetensors"
JOURNAL = ".finetune-files.json"  # what finetune wrote into output_dir: what a rerun may replace
OUTPUTS = (WEIGHTS, CONFIG, PREDICTIONS, METRICS)
MISSING = {"", "na", "n/a", "nan", "null", "none"}
IGNORE = -100  # per-residue targets at <cls>, <eos> and padding
#: task=residue's default context: the head sees 7 residues on either side (docs/downstream.md: ss3
#: Q3 0.620 against 0.546 without, and 0.570 for the windowed composition baseline)
RESIDUE_WINDOW = 7


# --- labels -----------------------------------------------------------------------------
@dataclass
class Examples:
    ids: list[str]
    seqs: list[str]           # residues, cleaned by the tokenizer
    labels: list              # class name (str), value (float) or one class letter per residue (str)
    split: list[str | None]   # train | valid | test; None: drawn by assign_splits


def read_examples(path: str | Path, task: str, sequences: str | Path | None = None,
                  tokenizer: Tokenizer = Tokenizer()) -> Examples:
    """A label CSV (``id``, ``sequence`` or ``seq``, ``label``, optional ``split``) or, for
    ``task=residue``, FLIP's FASTA of per-residue labels (``>id SET=train VALIDATION=False``).
    ``sequences``: a FASTA giving each id its residues (FLIP's labels need it; a CSV may use
    it instead of a sequence column). Any bad row is a one-line error naming file and line."""
    if task not in TASKS:
        raise UserError(f"task={task!r}: choose one of {', '.join(TASKS)}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"labels {path}: no such file")
    by_id = None
    if sequences is not None:
        if not Path(sequences).is_file():
            raise FileNotFoundError(f"sequences {sequences}: no such file")
        by_id = {r.id: r.sequence for r in read_fasta(sequences)}
    first = next((line for _, line in numbered_lines(path) if line.strip()), "")
    ex = Examples([], [], [], [])
    seen: dict = {}  # id -> (line, label): probe's rule for a protein listed twice
    repeats = {"same": 0, "other": 0}

    def add(n: int, rid: str, seq: str | None, label: str, split: str | None):
        where = f"{path}:{n}"
        if seq is None:
            if rid not in by_id:
                raise UserError(f"{where}: protein {rid!r} is not in sequences={sequences}")
            seq = by_id[rid]
        seq = tokenizer.clean(seq, source=where, record=rid)
        if not seq:
            raise UserError(f"{where}: protein {rid!r} has an empty sequence")
        label = label.strip()
        if label.lower() in MISSING:
            raise UserError(f"{where}: protein {rid!r} has no label ({label!r})")
        if task == "regression":
            try:
                value = float(label)
            except ValueError:
                raise UserError(f"{where}: protein {rid!r}: label {label!r} is not a number") from None
            if not math.isfinite(value):
                raise UserError(f"{where}: protein {rid!r}: label {label!r} is not a finite number")
            label = value
        elif task == "residue":
            label = "".join(label.split())
            if len(label) != len(seq):
                raise UserError(f"{where}: protein {rid!r}: {len(label)} residue labels for {len(seq)} residues")
        if split is not None and split not in SPLITS:
            raise UserError(f"{where}: protein {rid!r}: split {split!r}: expected train, valid or test")
        # listed again with another class: refused (probe's rule); another value: a replicate measurement
        if repeated(seen, rid, label, where, conflicts="count" if task == "regression" else "refuse"):
            repeats["same" if seen[rid][1] == label else "other"] += 1
        ex.ids.append(rid), ex.seqs.append(seq), ex.labels.append(label), ex.split.append(split)

    if first.startswith(">"):
        if task != "residue":
            raise UserError(f"labels={path}: a FASTA of labels is read as per-residue labels (task=residue), "
                            f"not task={task}; give a CSV with a label column")
        if by_id is None:
            raise UserError(f"labels={path}: per-residue labels in FASTA need sequences=FASTA (the residues by id)")
        for r in read_fasta(path):
            tags = dict(t.split("=", 1) for t in r.description.split()[1:] if "=" in t)
            split = tags.get("SET", "").strip().lower() or None
            if split == "train" and tags.get("VALIDATION", "").strip().lower() == "true":
                split = "valid"
            add(r.line, r.id, None, r.sequence, split)
    else:
        _read_csv(path, add, by_id is not None)
    if not ex.ids:
        raise UserError(f"labels {path}: no labeled rows")
    if any(repeats.values()):
        log.warning("%s: %d rows repeat a protein listed before (%d with another value: replicates); every row is "
                    "kept", path, repeats["same"] + repeats["other"], repeats["other"])
    if any(s is None for s in ex.split) and not all(s is None for s in ex.split):
        n = next(i for i, s in enumerate(ex.split) if s is None)
        raise UserError(f"labels {path}: protein {ex.ids[n]!r} has no split while others have one")
    return ex


def _read_csv(path: Path, add, have_sequences: bool) -> None:
    reader = csv_reader(path)
    try:
        header = [h.strip().lower() for h in next(reader, [])]
        col = {name: header.index(name) for name in ("id", "seq", "sequence", "label", "split") if name in header}
        seq = col.get("sequence", col.get("seq"))
        if "label" not in col:
            raise UserError(f"{path}:1: no 'label' column (header: {', '.join(header)})")
        if seq is None and not (have_sequences and "id" in col):
            raise UserError(f"{path}:1: no 'sequence' column (header: {', '.join(header)}); "
                            f"or give an 'id' column and sequences=FASTA")
        for row in reader:
            if not any(c.strip() for c in row):
                continue
            n = reader.line_num
            if len(row) != len(header):
                raise UserError(f"{path}:{n}: expected {len(header)} columns, got {len(row)}")
            s = row[seq] if seq is not None else None
            rid = row[col["id"]].strip() if "id" in col else sequence_id(s)
            split = row[col["split"]].strip().lower() if "split" in col else None
            add(n, rid, s, row[col["label"]], split)
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: not a readable CSV file ({e})") from e


def assign_splits(ex: Examples, valid_fraction: float, test_fraction: float, seed: int, source: str,
                  strata: list | None = None) -> np.ndarray:
    """The split of every example: as the file says; valid rows, when the file has none, a
    seeded ``valid_fraction`` of train (per class of ``strata``, when given: each class keeps its
    share in both), said in one line; without a split column, a seeded three-way draw."""
    n = len(ex.ids)
    rng = np.random.default_rng(seed)
    split = np.array([s or "train" for s in ex.split], dtype=object)
    if ex.split[0] is None:
        order = rng.permutation(n)
        n_test = int(round(test_fraction * n))
        split[order[:n_test]] = "test"
    if not (split == "valid").any():
        train = np.flatnonzero(split == "train")
        if strata is None:
            split[rng.permutation(train)[: max(1, int(round(valid_fraction * len(train))))]] = "valid"
        else:
            for c in sorted({strata[i] for i in train}):
                members = rng.permutation([i for i in train if strata[i] == c])
                split[members[: int(round(valid_fraction * len(members)))]] = "valid"
            if not (split == "valid").any():
                split[rng.permutation(train)[:1]] = "valid"
        log.info("%s: no valid split given: %d of the %d training proteins held out for validation (a seeded %s%g "
                 "share), which chooses the kept weights; the test split chooses nothing", source,
                 int((split == "valid").sum()), len(train), "per-class " if strata is not None else "",
                 valid_fraction)
    for s in SPLITS:
        if not (split == s).any():
            raise UserError(f"labels {source}: no {s} proteins ({n} in all; the split column, "
                            f"test_labels or valid_fraction / test_fraction decide them)")
    return split


# --- the model --------------------------------------------------------------------------
def _state(net: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors only: the attention layers' ``_extra_state`` (redraw counters) is not a weight."""
    return {k: v for k, v in net.state_dict().items() if isinstance(v, torch.Tensor)}


# --- batches ----------------------------------------------------------------------------
class Encoded(torch.utils.data.Dataset):
    def __init__(self, tokens: list[np.ndarray], targets: list):
        self.tokens, self.targets = tokens, targets

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i], self.targets[i]


def collate(items, pad_id: int) -> dict:
    from .data.collate import pad_batch
    tokens, padding = pad_batch([t for t, _ in items], pad_id)
    targets = [y for _, y in items]
    if isinstance(targets[0], np.ndarray):  # per residue: aligned with the tokens after <cls>
        y = torch.full(tokens.shape, IGNORE, dtype=torch.long)
        for i, t in enumerate(targets):
            y[i, 1:1 + len(t)] = torch.as_tensor(t)
    else:
        y = torch.tensor(targets, dtype=torch.float32 if isinstance(targets[0], float) else torch.long)
    return {"tokens": tokens, "padding_mask": padding, "targets": y}


def _loader(data: Encoded, pad_id: int, max_tokens: int, train: bool = False, seed: int = 0):
    from .data.sampler import TokenBudgetBatchSampler, token_budget_batches
    lengths = [len(t) for t in data.tokens]
    batches = (TokenBudgetBatchSampler(np.array(lengths), max_tokens, shuffle=True, seed=seed) if train
               else token_budget_batches(lengths, max_tokens))
    return torch.utils.data.DataLoader(data, batch_sampler=batches, collate_fn=partial(collate, pad_id=pad_id))


# --- the head's start: a linear probe (LP-FT) -------------------------------------------
#: residues the per-residue probe is fitted on (a seeded sample of the training split's)
PROBE_RESIDUES = 20000


@torch.no_grad()
def _frozen_features(net: FineTuneNet, data: Encoded, max_tokens: int, seed: int):
    """What the head sees before any training, on ``data``: the mean over each protein's residues of
    the encoder's output (pooled tasks), or the output at each residue (a seeded sample of at most
    :data:`PROBE_RESIDUES`); returns (features (n, dim) float64, targets (n,))."""
    from .data.sampler import token_budget_batches
    from .model.heads import masked_mean, residue_mask
    was_training = net.training
    net.eval()
    X, y = [None] * len(data), [None] * len(data)                       # in data order, as the folds see them
    for batch in token_budget_batches([len(t) for t in data.tokens], max_tokens):
        b = collate([data[i] for i in batch], net.tokenizer.pad_id)
        h = net.encoder(b["tokens"], b["padding_mask"]).float()
        pooled = None if net.task == "residue" else masked_mean(h, residue_mask(b["tokens"], net.tokenizer))
        for row, i in enumerate(batch):
            if net.task == "residue":
                keep = b["targets"][row] != IGNORE
                X[i], y[i] = h[row][keep].double().numpy(), b["targets"][row][keep].numpy()
            else:
                X[i], y[i] = pooled[row:row + 1].double().numpy(), b["targets"][row:row + 1].numpy()
    net.train(was_training)
    X, y = np.concatenate(X), np.concatenate(y)
    if net.task == "residue" and len(y) > PROBE_RESIDUES:
        pick = np.sort(np.random.default_rng(seed).choice(len(y), PROBE_RESIDUES, replace=False))
        X, y = X[pick], y[pick]
    return X, y


def probe_head_init(net: FineTuneNet, data: Encoded, max_tokens: int, scale: tuple[float, float],
                    seed: int = 0) -> dict:
    """Start the head where a linear probe ends (LP-FT, Kumar et al. 2022: fine-tuning from a
    probed head keeps what the pretrained features hold, where a random head first distorts them):
    ``probe``'s pipeline (standardize, then logistic regression with C by 3-fold CV, or ridge) on the
    frozen encoder's features of the training split, folded into the head's linear layer, so the
    untrained net predicts what the probe predicts.  An attention-pooling head starts at the plain
    mean (its scores zero).  Returns what was fitted (C or alpha, the examples' count), or None
    when a class is too rare for the cross-validation (the head then stays random)."""
    from .probe import make_probe
    X, y = _frozen_features(net, data, max_tokens, seed)
    task = "regression" if net.task == "regression" else "classification"
    target = (y - scale[0]) / scale[1] if task == "regression" else y.astype(int)
    folds = 3 if task == "regression" else int(min(3, np.unique(target, return_counts=True)[1].min()))
    if folds < 2 or (task == "classification" and len(np.unique(target)) < 2):
        log.warning("head_init=probe: a class has fewer than 2 training examples, too few for the probe's "
                    "cross-validation; the head starts random")
        return None
    pipe = make_probe(task, folds=folds, seed=seed)
    pipe.fit(X, target)
    scaler, model = pipe[0], pipe[-1]
    coef = np.atleast_2d(model.coef_) / scaler.scale_                    # on raw features
    bias = np.atleast_1d(model.intercept_) - coef @ scaler.mean_
    out = net.head.out
    W = np.zeros((out.out_features, out.in_features))
    b = np.zeros(out.out_features)
    if task == "regression":
        W[0], b[0] = coef[0], bias[0]
    elif coef.shape[0] == 1:                                             # binary: logits [0, z]
        W[model.classes_[1]], b[model.classes_[1]] = coef[0], bias[0]
    else:
        W[model.classes_], b[model.classes_] = coef, bias
        missing = np.setdiff1d(np.arange(out.out_features), model.classes_)
        if len(missing):  # a class absent from train: never predicted, as by the probe
            b[missing] = b[model.classes_].min() - 10.0
    with torch.no_grad():
        out.weight.copy_(torch.as_tensor(W, dtype=out.weight.dtype))
        out.bias.copy_(torch.as_tensor(b, dtype=out.bias.dtype))
        if hasattr(net.head, "score"):
            net.head.score.weight.zero_()
            net.head.score.bias.zero_()
    chosen = {"C": float(np.atleast_1d(model.C_)[0])} if task == "classification" else {"alpha": float(model.alpha_)}
    return {**chosen, "examples": int(len(y))}


# --- training ---------------------------------------------------------------------------
#: schedule=linear: the share of the steps spent warming up (conf/finetune.yaml's warmup)
WARMUP = 0.06


def warmup_linear(total: float, warmup: float, seconds: float | None = None, clock=time.monotonic):
    """The learning-rate factor at each optimizer step: up from 0 over the first ``warmup`` share of
    ``total`` steps, then straight down to 0 at ``total`` (BERT's fine-tuning schedule: the last
    epoch's small steps settle the weights the early stopping keeps instead of jumping around them).

    ``seconds`` (trainer.max_time): the run also ends when that much time has passed since the first
    step, so the share done is the larger of the steps' and the clock's (``total`` may then be inf:
    the time alone bounds the run), and the rates reach 0 when the time does."""
    ramp = max(1, round(warmup * total)) if math.isfinite(total) else 1
    start = []

    def factor(step: int) -> float:
        if seconds is None:
            if step < ramp:
                return (step + 1) / ramp
            return max(0.0, (total - step) / max(1, total - ramp))
        if not start:
            start.append(clock())
        done = max(step / total if math.isfinite(total) else 0.0, (clock() - start[0]) / seconds)
        if done < warmup:
            return max(done, (step + 1) / total if math.isfinite(total) else 0.0) / warmup
        return max(0.0, (1.0 - done) / (1.0 - warmup))
    return factor


def time_budget(max_time) -> float | None:
    """trainer.max_time as seconds: Lightning's "DD:HH:MM:SS", a dict of timedelta's keys, or a timedelta;
    None when it is not set.  Anything else is one line naming the key."""
    import datetime
    if max_time is None:
        return None
    try:
        if isinstance(max_time, str):
            days, hours, minutes, secs = (int(x) for x in max_time.split(":"))
            max_time = datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=secs)
        elif isinstance(max_time, Mapping):
            max_time = datetime.timedelta(**max_time)
        seconds = max_time.total_seconds()
    except (TypeError, ValueError, AttributeError):
        raise UserError(f"trainer.max_time={max_time!r}: give DD:HH:MM:SS (e.g. 00:00:10:00), or a dict such as "
                        f"{{minutes: 10}}") from None
    if not seconds > 0:
        raise UserError(f"trainer.max_time={max_time}: must be longer than 0")
    return seconds


#: what selects the kept weights on the validation split (select_by=auto: the first of the task's)
SELECT_BY = {"classification": ("accuracy", "macro_f1", "mcc"), "regression": ("spearman",),
             "residue": ("residue_accuracy",)}


def selection_metric(task: str, by: str, outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The validation metric that picks the kept weights: ``outputs`` (n, C) logits or (n, 1) values in
    the head's scale, ``targets`` (n,) (residue tasks: one row per labeled residue).  Higher is better;
    NaN (a constant regression output) is returned as NaN and never wins."""
    from scipy.stats import spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef
    y = targets.numpy()
    if task == "regression":
        p = outputs[:, 0].numpy()
        return float("nan") if np.ptp(p) == 0 or np.ptp(y) == 0 else float(spearmanr(p, y).statistic)
    pred = outputs.argmax(-1).numpy()
    if by == "macro_f1":
        return float(f1_score(y, pred, average="macro"))
    if by == "mcc":
        return float(matthews_corrcoef(y, pred))
    return float((pred == y).mean())


def _lightning_module(net: FineTuneNet, lr: float, head_lr: float, weight_decay: float, scale: tuple[float, float],
                      schedule: str = "constant", warmup: float = 0.0, seconds: float | None = None,
                      select_by: str = "loss"):
    import pytorch_lightning as pl

    class FineTuner(pl.LightningModule):
        """Loss, optimizer, and the best validated weights (kept in memory, put back at the end): every
        validation is a candidate (``stage``: "probe" for the probed head before training, then each
        epoch), ranked by ``select_by`` on the validation split (ties: the lower loss, then the earlier)."""

        def __init__(self):
            super().__init__()
            self.net, self.best, self.best_loss, self._val = net, None, math.inf, []
            self.best_epoch = None  # 0 = the start (validated before training), n = after epoch n
            self.best_name, self.best_key, self.stage, self.candidates = None, None, "start", []

        def loss_of(self, out, y) -> tuple[torch.Tensor, int]:
            if net.task == "regression":
                return F.mse_loss(out.squeeze(-1), (y - scale[0]) / scale[1]), len(y)
            if net.task == "residue":
                return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=IGNORE), int((y != IGNORE).sum())
            return F.cross_entropy(out, y), len(y)

        def training_step(self, batch, batch_idx):
            loss, n = self.loss_of(self.net(batch["tokens"], batch["padding_mask"]).float(), batch["targets"])
            self.log("train/loss", loss, batch_size=n, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            out, y = self.net(batch["tokens"], batch["padding_mask"]).float(), batch["targets"]
            loss, n = self.loss_of(out, y)
            if net.task == "residue":
                keep = y != IGNORE
                out, y = out[keep], y[keep]
            self._val.append((float(loss) * n, n, out.detach().cpu(), y.detach().cpu()))

        def on_validation_epoch_end(self):
            val, self._val = self._val, []
            loss = sum(v[0] for v in val) / max(sum(v[1] for v in val), 1)
            self.log("val/loss", loss, prog_bar=True)
            metric = None
            if select_by != "loss" and val:
                metric = selection_metric(net.task, select_by, torch.cat([v[2] for v in val]),
                                          torch.cat([v[3] for v in val]))
                self.log(f"val/{select_by}", metric)
            if self.trainer.sanity_checking:
                return
            fitting = self.trainer.state.fn == "fit"
            name = f"epoch {self.trainer.current_epoch + 1}" if fitting else self.stage
            self.candidates.append({"name": name, "loss": loss, **({select_by: metric} if metric is not None else {})})
            key = (-loss,) if metric is None else (-math.inf if math.isnan(metric) else metric, -loss)
            if self.best_key is None or key > self.best_key:
                self.best_key, self.best_loss, self.best_name = key, loss, name
                self.best = {k: v.detach().clone() for k, v in _state(self.net).items()}
                self.best_epoch = self.trainer.current_epoch + 1 if fitting else 0

        def configure_optimizers(self):
            enc = [p for p in self.net.encoder.parameters() if p.requires_grad]
            groups = [{"params": list(self.net.head.parameters()), "lr": head_lr}] + (
                [{"params": enc, "lr": lr}] if enc else [])
            opt = torch.optim.AdamW(groups, weight_decay=weight_decay)
            if schedule == "constant":
                return opt
            total = float(self.trainer.estimated_stepping_batches)  # max_epochs (or max_steps) of batches; inf: max_time alone
            step = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(total, warmup, seconds))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": step, "interval": "step"}}

    return FineTuner()


def finetune(ckpt, labels, task: str, output_dir, *, sequences=None, test_labels=None, pooling: str = "mean",
             freeze="none", dropout: float = 0.0, lr: float = 1e-4, head_lr: float = 1e-3,
             weight_decay: float = 0.01, max_tokens: int = 8192, patience: int = 3, valid_fraction: float = 0.1,
             test_fraction: float = 0.2, seed: int = 0, gradient_checkpointing: bool = False,
             lora: bool = False, lora_rank: int = 8, lora_alpha: float = 16.0, lora_dropout: float = 0.0,
             head_init: str = "random", window: int | None = None, schedule: str = "linear", warmup: float = WARMUP,
             unknown: str = "error", overwrite: bool = False, trainer: dict | None = None,
             progress_every: int | None = 50, progress_seconds: float | None = 30.0, select_by: str = "auto",
             probe_baseline: bool = True) -> dict:
    """Fine-tune ``ckpt`` on ``labels`` and write ``output_dir``; returns the metrics. ``lora``:
    LoRA adapters (rank ``lora_rank``, scale ``lora_alpha / lora_rank``) on every attention and
    feed-forward projection train instead of the encoder's weights (``lr`` is theirs), merged into
    the weights at the end.  ``window`` (task=residue): the head also sees that many residues on
    either side (None: :data:`RESIDUE_WINDOW` for task=residue, else 0).  ``head_init``: ``probe`` (the head starts as a linear probe of the
    frozen encoder, :func:`probe_head_init`; the validation loss of that start competes with every
    epoch's) or ``random``.  Whatever the start, a linear probe of the frozen encoder is fitted on the
    training split and validated (``probe_baseline``; false: only the epochs compete, head_init=random), and the weights kept are the best of the probe and every epoch on the
    validation split by ``select_by`` (auto: accuracy, Spearman or residue accuracy; or macro_f1, mcc,
    loss), so fine-tuning never ends below its own probe on validation.  ``schedule``: ``constant`` rates, or ``linear`` (:func:`warmup_linear`:
    up over the first ``warmup`` share of the trainer's steps, then down to 0 at its last).
    Progress: one line per epoch (the validation loss, its best, the ETA) on stdout; with the
    trainer's progress bar on and stdout not a terminal, also a line every ``progress_every`` steps
    or ``progress_seconds`` seconds instead of the bar."""
    import pytorch_lightning as pl

    from .hub.load import load_model
    from .training.progress import check_progress, lightning_progress
    out = Path(output_dir)
    OutputGuard("finetune", {"ckpt": ckpt, "labels": labels, "sequences": sequences, "test_labels": test_labels}
                ).folder_path("output_dir", out, holds=False)  # the output guard; what it holds: _check_output
    for key, v in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0 <= v < 1:
            raise UserError(f"{key}={v}: a fraction in [0, 1)")
    check_progress(progress_every, progress_seconds)
    if int(max_tokens) < 1:
        raise UserError(f"max_tokens={max_tokens}: must be positive")
    if window is None:
        window = RESIDUE_WINDOW if task == "residue" else 0
    if head_init not in ("probe", "random"):
        raise UserError(f"head_init={head_init!r}: choose probe or random")
    choices = ("auto", "loss", *SELECT_BY.get(task, ()))
    if select_by not in choices:
        raise UserError(f"select_by={select_by!r}: for task={task} choose one of {', '.join(choices)}")
    select_by = SELECT_BY[task][0] if select_by == "auto" and task in SELECT_BY else select_by
    if schedule not in ("constant", "linear"):
        raise UserError(f"schedule={schedule!r}: choose constant or linear (warmup, then down to 0 at the last epoch)")
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < 1:
        raise UserError(f"warmup={warmup}: a fraction of the steps in [0, 1)")
    if lora and str(freeze).lower() != "none":
        raise UserError(f"lora=true with freeze={freeze}: LoRA freezes the encoder's own weights and adapts every "
                        f"block; leave freeze=none")
    tok = Tokenizer(unknown=unknown)
    ex = read_examples(labels, task, sequences, tok)
    if test_labels is not None:
        more = read_examples(test_labels, task, sequences, tok)
        if ex.split[0] is None:  # the test proteins are given: labels holds train (and valid)
            ex.split = ["train"] * len(ex.split)
        ex = Examples(ex.ids + more.ids, ex.seqs + more.seqs, ex.labels + more.labels,
                      ex.split + ["test"] * len(more.ids))
    split = assign_splits(ex, valid_fraction, test_fraction, seed, str(labels),
                          strata=ex.labels if task == "classification" else None)
    # probe's rule: test proteins (by sequence) that the model trains on are refused, or warned of with counts
    check_test_overlap([q for q, s in zip(ex.seqs, split) if s != "test"],
                       [q for q, s in zip(ex.seqs, split) if s == "test"], test_labels or labels)
    if task == "classification":
        check_classes(ex.labels, labels)
    classes = (sorted({c for lab in ex.labels for c in lab}) if task == "residue"
               else sorted(set(ex.labels)) if task == "classification" else [])
    if task != "regression" and len(classes) < 2:
        raise UserError(f"labels {labels}: one class only ({classes[0]!r}); nothing to learn")
    train_y = np.array([y for y, s in zip(ex.labels, split) if s == "train"] if task == "regression" else [])
    scale = (float(train_y.mean()), float(train_y.std()) or 1.0) if task == "regression" else (0.0, 1.0)
    _check_output(out, overwrite)

    longest = max(len(s) for s in ex.seqs) + 2
    if task == "residue" and isinstance(window, int) and not isinstance(window, bool) and window > longest - 3:
        # the head's context cannot reach past the longest protein: beyond it, only cost
        log.warning("window=%d: capped at %d, the longest protein's length less one (%d residues); a wider "
                    "window sees nothing more and costs window x length per protein", window, longest - 3,
                    longest - 2)
        window = longest - 3
    loaded = load_model(ckpt)
    encoder = loaded.net.encoder
    if encoder.pos_embed is not None and longest > encoder.max_positions:
        raise UserError(f"labels {labels}: a protein of {longest - 2} residues is longer than the model's learned "
                        f"positions (model.max_positions={encoder.max_positions})")
    torch.manual_seed(seed)
    net = FineTuneNet(encoder, task, 1 if task == "regression" else len(classes), pooling, dropout, window)
    net.freeze(freeze)
    if lora:
        net.add_lora(lora_rank, float(lora_alpha), float(lora_dropout))
    if gradient_checkpointing:
        net.checkpoint_blocks()

    index = {c: i for i, c in enumerate(classes)}
    tok = replace(net.tokenizer, unknown=unknown)
    tokens = [tok.encode(s) for s in ex.seqs]
    targets = [float(y) if task == "regression" else
               np.array([index[c] for c in y]) if task == "residue" else index[y] for y in ex.labels]
    part = {s: np.flatnonzero(split == s) for s in SPLITS}
    data = {s: Encoded([tokens[i] for i in idx], [targets[i] for i in idx]) for s, idx in part.items()}

    settings = {"accelerator": "cpu", "devices": 1, "max_epochs": 20, "logger": False,
                "enable_checkpointing": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                **(trainer or {})}
    seconds = time_budget(settings.get("max_time"))
    if schedule == "linear" and settings.get("max_epochs") == -1 and settings.get("max_steps", -1) == -1 \
            and seconds is None:
        raise UserError("schedule=linear falls to 0 at the last step: set trainer.max_epochs, trainer.max_steps or "
                        "trainer.max_time, or use schedule=constant")
    module = _lightning_module(net, lr, head_lr, weight_decay, scale, schedule, warmup, seconds, select_by)
    settings["enable_progress_bar"], progress = lightning_progress(
        settings.get("enable_progress_bar", True), "finetune", every=progress_every, seconds=progress_seconds,
        epochs=True)
    settings["callbacks"] = [pl.callbacks.EarlyStopping("val/loss", patience=patience, mode="min",
                                                       check_on_train_epoch_end=False), *progress]
    with tempfile.TemporaryDirectory() as root:  # whatever Lightning writes goes there, not into the cwd
        try:
            fit = pl.Trainer(default_root_dir=root, **settings)
        except (TypeError, ValueError) as e:  # an unknown or bad trainer.* setting (MisconfigurationException too)
            raise UserError(f"trainer: {first_line(e)}") from e
        with exclusive_lock(out.with_name(f".{out.name}.finetune.lock"), what=f"output_dir {out}", remove=True):
            _check_output(out, overwrite, sweep=True)  # again: another run may have written it since
            pl.seed_everything(seed, verbose=False)
            start = time.perf_counter()
            random_head = {k: v.clone() for k, v in net.head.state_dict().items()}
            probe = (probe_head_init(net, data["train"], max_tokens, scale, seed)  # the baseline
                     if probe_baseline or head_init == "probe" else None)
            valid = _loader(data["valid"], tok.pad_id, max_tokens)
            if probe is not None:  # the probe is a candidate for the kept weights (head_init=probe: the start)
                module.stage = "probe"
                fit.validate(module, valid, verbose=False)
            if head_init == "random":
                net.head.load_state_dict(random_head)
            net.train()  # the loaded encoder is in eval mode: its dropout on while it trains (frozen parts stay off)
            fit.fit(module, _loader(data["train"], tok.pad_id, max_tokens, train=True, seed=seed), valid)
            seconds = time.perf_counter() - start
            if module.best is not None:
                net.load_state_dict(module.best, strict=False)
            if lora:
                net.merge_lora()
            net = net.cpu().eval()
            predictions, scores = predict(net, data["test"], max_tokens, classes, scale)

            test_labels_ = [ex.labels[i] for i in part["test"]]
            result = metrics(task, classes, test_labels_, predictions, scores)
            result["baseline"] = baseline(task, [ex.labels[i] for i in part["train"]], test_labels_)
            result.update(proteins={s: int(len(idx)) for s, idx in part.items()}, steps=int(fit.global_step),
                          epochs=int(fit.current_epoch), train_seconds=round(seconds, 2),
                          best_val_loss=module.best_loss if module.best is not None else None,
                          head_init=head_init, probe=probe, best_epoch=module.best_epoch,
                          selection=selection_summary(module.candidates, module.best_name, select_by))
            meta = {"task": task, "classes": classes, "num_outputs": net.head.out.out_features,
                    "pooling": pooling, "dropout": dropout, "freeze": freeze, "target_scale": list(scale),
                    "head_init": head_init, "window": window, "schedule": schedule, "warmup": float(warmup),
                    "select_by": select_by,
                    "lora": {"rank": lora_rank, "alpha": float(lora_alpha), "dropout": float(lora_dropout)} if lora else None,
                    "model": encoder.config.to_dict(), "source": str(ckpt)}
            _write_outputs(out, net, meta, result, [ex.ids[i] for i in part["test"]], test_labels_,
                           predictions, scores)
    return result


@torch.no_grad()
def predict(net: FineTuneNet, data: Encoded, max_tokens: int, classes: list[str], scale: tuple[float, float]):
    """Test-split predictions in file order: class names, values, or a class letter per residue;
    and the positive-class probability for a binary task (else None)."""
    preds, scores = [None] * len(data), [None] * len(data)
    from .data.sampler import token_budget_batches
    for batch in token_budget_batches([len(t) for t in data.tokens], max_tokens):
        b = collate([data[i] for i in batch], net.tokenizer.pad_id)
        out = net(b["tokens"], b["padding_mask"]).float()
        for row, i in enumerate(batch):
            if net.task == "regression":
                preds[i] = float(out[row, 0]) * scale[1] + scale[0]
            elif net.task == "residue":
                preds[i] = "".join(classes[k] for k in out[row, 1:1 + len(data.targets[i])].argmax(-1).tolist())
            else:
                preds[i] = classes[int(out[row].argmax())]
                if len(classes) == 2:
                    scores[i] = float(torch.softmax(out[row], -1)[1])
    return preds, (scores if net.task == "classification" and len(classes) == 2 else None)


# --- metrics ----------------------------------------------------------------------------
def metrics(task: str, classes: list[str], labels: list, predictions: list, scores: list | None = None) -> dict:
    """Test-split metrics: accuracy, MCC and AUROC (binary; the positive class is the second
    in sorted order) or macro-F1 (multi-class); Spearman (regression); per-residue accuracy,
    Q3 when there are three classes (over all test residues together)."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef, roc_auc_score
    if task == "regression":
        y, p = np.asarray(labels, dtype=float), np.asarray(predictions, dtype=float)
        return {"spearman": float(spearmanr(y, p).statistic), "pearson": float(pearsonr(y, p).statistic),
                "rmse": float(np.sqrt(np.mean((y - p) ** 2))), "n": len(y)}
    if task == "residue":
        right = sum(a == b for y, p in zip(labels, predictions) for a, b in zip(y, p))
        total = sum(len(y) for y in labels)
        key = "q3" if len(classes) == 3 else "residue_accuracy"
        return {key: right / total, "residues": total, "n": len(labels)}
    r = {"accuracy": float(accuracy_score(labels, predictions)), "mcc": float(matthews_corrcoef(labels, predictions))}
    if len(classes) == 2:
        positive = np.array([y == classes[1] for y in labels])
        r["auroc"] = float(roc_auc_score(positive, scores)) if 0 < positive.sum() < len(positive) else None
    else:
        r["macro_f1"] = float(f1_score(labels, predictions, average="macro"))
    return {**r, "n": len(labels)}


def baseline(task: str, train: list, test: list) -> dict:
    """A constant predictor fitted on train: the most frequent class (residue), or the mean."""
    if task == "regression":
        return {"rmse": float(np.sqrt(np.mean((np.asarray(test) - np.mean(train)) ** 2)))}
    from collections import Counter
    if task == "residue":
        top = Counter(c for y in train for c in y).most_common(1)[0][0]
        return {"residue_accuracy": sum(c == top for y in test for c in y) / sum(len(y) for y in test)}
    top = Counter(train).most_common(1)[0][0]
    return {"accuracy": sum(y == top for y in test) / len(test)}


def selection_summary(candidates: list[dict], kept: str | None, by: str) -> dict:
    """What metrics.json says about the choice: every validated candidate, the one kept, and the kept
    one's margin over the probe on the validation split (by ``by``; the test split chose nothing)."""
    summary = {"by": by, "split": "valid", "kept": kept, "candidates": candidates}
    probe = next((c for c in candidates if c["name"] == "probe"), None)
    best = next((c for c in candidates if c["name"] == kept), None)
    if probe is not None and best is not None and by in best:
        summary["over_probe"] = best[by] - probe[by]
    return summary


def format_metrics(result: dict) -> str:
    keys = [k for k in ("accuracy", "mcc", "auroc", "macro_f1", "spearman", "pearson", "rmse", "q3",
                        "residue_accuracy") if result.get(k) is not None]
    main = ", ".join(f"{k} {result[k]:.4f}" for k in keys)
    base = ", ".join(f"{k} {v:.4f}" for k, v in result["baseline"].items())
    sel = result.get("selection") or {}
    kept = next((c for c in sel.get("candidates", []) if c["name"] == sel.get("kept")), None)
    choice = ""
    if kept is not None:
        value = kept.get(sel["by"], kept["loss"])
        choice = f"\nkept: {sel['kept']} (valid {sel['by']} {value:.4f}"
        if "over_probe" in sel and sel["kept"] != "probe":
            choice += f", {sel['over_probe']:+.4f} over the linear probe"
        elif sel["kept"] == "probe":
            choice += ": no epoch beat the linear probe"
        choice += ")"
    return (f"test ({result['n']} proteins): {main}; constant predictor: {base}\n"
            f"{result['steps']} steps, {result['epochs']} epochs, {result['train_seconds']:.1f} s{choice}")


# --- outputs ----------------------------------------------------------------------------
def _check_output(out: Path, overwrite: bool, sweep: bool = False) -> None:
    """Before any work: ``output_dir`` is new, empty, an unfinished finetune output (finetune's
    files without ``metrics.json``, written last: a kill during the final writes; the rerun
    completes it), or (with overwrite) an earlier finetune output holding only what finetune
    wrote. A kill inside one of finetune's atomic writes
    leaves a temporary no journal can list: a dead process's temporary of the journal, or of a
    name the journal records, counts as finetune's, and ``sweep`` (under the output's lock)
    removes it."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir {out}: exists and is not a directory")
    if not out.is_dir():
        return
    written = WrittenFiles(out / JOURNAL) if (out / JOURNAL).is_file() else None
    ours = [JOURNAL, *(name for name in OUTPUTS if written is not None and out / name in written)]
    leftovers = [p for name in ours for p in dead_temporaries(out / name)]
    present = [p for p in out.iterdir() if p not in leftovers]
    if present:
        if written is None:
            raise UserError(f"output_dir {out}: holds files finetune did not write; choose a new or empty folder")
        other = sorted(p.name for p in present if p.name != JOURNAL and p not in written)
        if other:
            raise UserError(f"output_dir {out}: holds {', '.join(other[:3])}, not written by finetune; "
                            f"move it away or choose another folder")
        if not overwrite and (out / METRICS).is_file():  # without metrics.json: unfinished, the rerun completes it
            raise UserError(f"output_dir {out}: holds an earlier finetune output; overwrite=true replaces it")
    for p in leftovers if sweep else ():
        remove_path(p)


def _write_outputs(out: Path, net: FineTuneNet, meta: dict, result: dict, ids, labels, predictions, scores) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    written = WrittenFiles(out / JOURNAL)
    written.record(*(out / name for name in (WEIGHTS, CONFIG, PREDICTIONS, METRICS)))
    # metrics.json marks a whole output: it goes first (finetune's, checked under the lock), so a
    # kill among the writes below leaves an unfinished output that the rerun completes
    (out / METRICS).unlink(missing_ok=True)
    write_json(out / CONFIG, meta, indent=2)
    with atomic_path(out / WEIGHTS) as tmp:
        save_file({k: v.contiguous() for k, v in _state(net).items()}, str(tmp), metadata={"format": "pt"})
        shutil.copymode(out / CONFIG, tmp)  # safetensors writes owner-only; share like the rest
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["id", "label", "prediction", *(["score"] if scores is not None else [])])
    for k, rid in enumerate(ids):
        w.writerow([rid, labels[k], predictions[k], *([scores[k]] if scores is not None else [])])
    write_text(out / PREDICTIONS, buf.getvalue())
    write_json(out / METRICS, result, indent=2)  # last: a folder with metrics.json is whole

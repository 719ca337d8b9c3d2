"""The ``finetune`` command end to end: settings checked, labels read and split, the net built, a
Lightning Trainer run under the output's lock, the kept weights tested and written."""
from __future__ import annotations

import copy
import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch

from ..errors import UserError, first_line
from ..files import exclusive_lock
from ..hub.load import load_model
from ..model.heads import TASK_HEADS, FineTuneNet, check_freeze, check_lora
from ..output_guard import OutputGuard
from ..probe import check_classes, check_test_overlap
from ..tokenizer import Tokenizer
from ..training.progress import check_progress, lightning_progress
from ..training.quiet import quiet_libraries
from .batches import Encoded, _loader
from .confidence import bootstrap_confidence
from .head_init import probe_head_init
from .labels import SPLITS, Examples, assign_splits, read_examples
from .module import FineTuner, interpolate, snapshot
from .pooling_choice import CHOICES, check_choices, choose_pooling
from .outputs import _check_output, _write_outputs
from .report import baseline, metrics, predict, selection_summary
from .schedule import SELECT_BY, WARMUP, time_budget

log = logging.getLogger(__name__)

#: the shares of the fine-tuned weights tried beside the probe's (WiSE-FT): each a validated candidate
SHARES = (0.25, 0.5, 0.75)

#: keep the best fine-tuned candidate over the probe only when it wins in this share of the bootstrap draws
#: of the validation proteins (docs/downstream.md, the gate study)
MIN_CONFIDENCE = 0.9

#: the best epoch's share of the output ensemble with the probe (their probabilities, or values, averaged);
#: 1: the epoch alone (docs/downstream.md, the ensemble study)
ENSEMBLE = 0.5

#: the ensemble gives way to the best epoch alone when the epoch beats the mix in this share of the validation
#: bootstrap's draws (1: never; docs/downstream.md, the epoch-or-mix study: ss3 +0.006 / +0.007, the rest unchanged)
EPOCH_CONFIDENCE = 0.9

#: pooling=auto takes every layer's mean over the last layer's only when a linear probe of it wins in this share of
#: the validation bootstrap's draws (docs/downstream.md, "pooling=auto")
POOLING_CONFIDENCE = 0.9
#: pooling=auto chooses on: valid (the validation split, with the bootstrap gate) or cv (the probes'
#: cross-validation on the training split; pooling_choice.choose_by_cv)
POOLING_BY = "valid"

#: task=residue's default context: the head sees 7 residues on either side (docs/downstream.md: ss3
#: Q3 0.620 against 0.546 without, and 0.570 for the windowed composition baseline)
RESIDUE_WINDOW = 7

#: the epochs a run may take unless trainer.max_epochs says otherwise: issue 45's held-out task (1,582
#: training proteins) within 20 minutes on 2 CPU cores, probes included; at 20 a family run of 2,651 proteins
#: was still improving at epoch 10 and on course for 40 minutes (docs/finetune_defaults.md)
MAX_EPOCHS = 10


def finetune(ckpt, labels, task: str, output_dir, *, sequences=None, test_labels=None, pooling: str = "auto",
             freeze="none", dropout: float = 0.0, lr: float = 1e-4, head_lr: float = 1e-3,
             weight_decay: float = 0.01, max_tokens: int = 8192, patience: int = 3, valid_fraction: float = 0.1,
             test_fraction: float = 0.2, seed: int = 0, gradient_checkpointing: bool = False,
             lora: bool = False, lora_rank: int = 8, lora_alpha: float = 16.0, lora_dropout: float = 0.0,
             head_init: str = "random", window: int | None = None, schedule: str = "linear", warmup: float = WARMUP,
             unknown: str = "error", overwrite: bool = False, trainer: dict | None = None, pooling_by: str = POOLING_BY,
             progress_every: int | None = 50, progress_seconds: float | None = 30.0, select_by: str = "auto",
             probe_baseline: bool = True, layer_decay: float = 1.0, stop_on: str = "metric", refit_probe: bool = True,
             interpolate: bool = False, min_confidence: float = MIN_CONFIDENCE, ensemble: float = ENSEMBLE,
             epoch_confidence: float = EPOCH_CONFIDENCE, pooling_confidence: float = POOLING_CONFIDENCE,
             pooling_choices=CHOICES) -> dict:
    """Fine-tune ``ckpt`` on ``labels`` and write ``output_dir``; returns the metrics.

    ``lora``: LoRA adapters (rank ``lora_rank``, scale ``lora_alpha / lora_rank``) on every attention and feed-forward
    projection train instead of the encoder's weights (``lr`` is theirs), merged at the end.  ``window``
    (task=residue): residues the head also sees on either side (None: :data:`RESIDUE_WINDOW`).  ``pooling``: mean,
    attention, layers, termini or auto (:func:`_auto_pooling`: ``pooling_choices``, ``pooling_by``,
    ``pooling_confidence``).  ``head_init``: probe (LP-FT, :func:`~.head_init.probe_head_init`) or random.  A linear
    probe of the frozen encoder is fitted on the training split (``probe_baseline``); the weights kept are the best
    on the validation split by ``select_by`` (auto: accuracy, Spearman or residue accuracy; or macro_f1, mcc, loss)
    of the probe, every epoch and (``interpolate``) the weights between the probe's and the best epoch's at
    :data:`SHARES` (WiSE-FT); the best fine-tuned one is kept over the probe only when it wins in
    ``min_confidence`` of the validation proteins' bootstrap draws (:func:`~.confidence.bootstrap_confidence`).
    ``ensemble``, ``epoch_confidence``: :func:`_ensemble`; ``refit_probe``: :func:`_refit_probe`; ``stop_on``: early
    stopping (``patience``) on select_by's ``metric`` or the ``loss``.  Progress: a line per epoch on stdout."""
    out = Path(output_dir)
    OutputGuard("finetune", {"ckpt": ckpt, "labels": labels, "sequences": sequences, "test_labels": test_labels}
                ).folder_path("output_dir", out, holds=False)  # the output guard; what it holds: _check_output
    select_by, choices = _check_settings(
        task, valid_fraction, test_fraction, progress_every, progress_seconds, max_tokens, head_init, select_by,
        schedule, warmup, lora, freeze, layer_decay, stop_on, interpolate, probe_baseline, min_confidence, ensemble,
        epoch_confidence, pooling, pooling_confidence, refit_probe, pooling_by, pooling_choices, lora_rank, lora_alpha)
    settings, seconds = _trainer_settings(trainer, schedule, patience, progress_every, progress_seconds,
                                          "loss" if stop_on == "loss" else select_by, select_by)
    with tempfile.TemporaryDirectory() as root:  # whatever Lightning writes goes there, not into the cwd
        fit = _trainer(root, settings)
        tok = Tokenizer(unknown=unknown)
        ex, split = _examples(labels, task, sequences, test_labels, tok, valid_fraction, test_fraction, seed)
        classes, scale = _classes_and_scale(ex, split, task, labels)
        _check_output(out, overwrite)
        adapters = (lora_rank, float(lora_alpha), float(lora_dropout)) if lora else None
        net, window = _build_net(ckpt, labels, ex, task, classes, pooling, dropout, window, seed, choices[-1])
        check_freeze(freeze, net.encoder.depth)  # the model's depth known: before the probes
        tok = replace(net.tokenizer, unknown=unknown)
        part = {s: np.flatnonzero(split == s) for s in SPLITS}
        data = _encode(ex, part, task, classes, tok)
        net, pooling, choice, features = _auto_pooling(net, data, pooling, max_tokens, scale, select_by,
                                                       pooling_confidence, dropout, window, seed, pooling_by == "cv",
                                                       choices)
        _adapt(net, freeze, gradient_checkpointing, adapters)
        module = FineTuner(net, lr, head_lr, weight_decay, scale, schedule, warmup, seconds, select_by, layer_decay)
        with exclusive_lock(out.with_name(f".{out.name}.finetune.lock"), what=f"output_dir {out}", remove=True):
            _check_output(out, overwrite, sweep=True)  # again: another run may have written it since
            probe, seconds, gate = _train(fit, module, data, tok.pad_id, max_tokens, seed, scale, probe_baseline
                                          or head_init == "probe", head_init, interpolate, min_confidence,
                                          float(ensemble), float(epoch_confidence), features,
                                          refit_probe and "valid" not in ex.split)
            if lora:
                module.net.merge_lora()
            net = module.net.cpu().eval()
            predictions, scores = predict(net, data["test"], max_tokens, classes, scale)
            test_labels_ = [ex.labels[i] for i in part["test"]]
            result = metrics(task, classes, test_labels_, predictions, scores)
            result["baseline"] = baseline(task, [ex.labels[i] for i in part["train"]], test_labels_)
            result.update(proteins={s: int(len(idx)) for s, idx in part.items()}, steps=int(fit.global_step),
                          epochs=int(fit.current_epoch), train_seconds=round(seconds, 2),
                          best_val_loss=module.best_loss if module.best is not None else None,
                          head_init=head_init, probe=probe, best_epoch=module.best_epoch,
                          selection=selection_summary(module.candidates, module.best_name, select_by, gate),
                          **({"pooling": choice} if choice is not None else {}))
            meta = _meta(net, ckpt, task, classes, scale, window, adapters, pooling=pooling, dropout=dropout,
                         freeze=freeze, head_init=head_init, schedule=schedule, warmup=float(warmup),
                         select_by=select_by, layer_decay=float(layer_decay), stop_on=stop_on, interpolate=interpolate,
                         min_confidence=float(min_confidence), epoch_confidence=float(epoch_confidence),
                         refit_probe=refit_probe)
            _write_outputs(out, net, meta, result, [ex.ids[i] for i in part["test"]], test_labels_, predictions, scores)
    return result


def _trainer(root: str, settings: dict) -> pl.Trainer:
    """The Trainer, built before any work: a bad trainer.* setting is one line before the probes run."""
    try:
        return pl.Trainer(default_root_dir=root, **settings)
    except (TypeError, ValueError) as e:  # an unknown or bad trainer.* setting (MisconfigurationException too)
        raise UserError(f"trainer: {first_line(e)}") from e


def _refit_probe(net: FineTuneNet, data: dict[str, Encoded], max_tokens: int, scale, seed: int) -> dict | None:
    """The kept probe (``net``: the kept network, or a kept mix's frozen probe member) fitted again on the
    training proteins and the validation proteins finetune held out of them, together (its C again by
    inner cross-validation): once the choice is made, the held-out labels need not go unused
    (scikit-learn's refit), and the test split still chooses nothing. What was fitted, with the proteins'
    count (``examples`` counts residues for task=residue)."""
    both = Encoded(data["train"].tokens + data["valid"].tokens, data["train"].targets + data["valid"].targets)
    fitted = probe_head_init(net, both, max_tokens, scale, seed)
    return None if fitted is None else {**fitted, "proteins": len(both)}


def _meta(net: FineTuneNet, ckpt, task: str, classes: list, scale, window: int, adapters, **settings) -> dict:
    """finetune.json: what load_finetuned needs to rebuild the kept network (task, classes, outputs, pooling,
    window, dropout, the encoder's config, the ensemble's share: None where the network stands alone) and
    the settings it was trained with."""
    return {"task": task, "classes": classes, "num_outputs": net.head.out.out_features, **settings,
            "target_scale": list(scale), "window": window,
            "ensemble": net.share if net.probe is not None else None,
            "lora": dict(zip(("rank", "alpha", "dropout"), adapters)) if adapters else None,
            "model": net.encoder.config.to_dict(), "source": str(ckpt)}


def _check_settings(task: str, valid_fraction, test_fraction, progress_every, progress_seconds, max_tokens,
                    head_init, select_by, schedule, warmup, lora, freeze, layer_decay, stop_on, interpolate,
                    probe_baseline, min_confidence, ensemble=1.0, epoch_confidence=1.0, pooling="mean",
                    pooling_confidence=1.0, refit_probe=True, pooling_by="valid",
                    pooling_choices=CHOICES, lora_rank=8, lora_alpha=16.0) -> tuple[str, tuple[str, ...]]:
    """Each setting checked before any file is read (one line naming the key; ``freeze``'s bound, the
    model's depth, once the model is read); returns ``select_by`` with auto resolved to the task's metric,
    and pooling=auto's candidates as a tuple."""
    for key, v in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0 <= v < 1:
            raise UserError(f"{key}={v}: a fraction in [0, 1)")
    check_progress(progress_every, progress_seconds)
    if pooling not in (*TASK_HEADS, "auto"):
        raise UserError(f"pooling={pooling!r}: choose one of {', '.join(TASK_HEADS)} or auto (one of pooling_choices, "
                        f"by a linear probe of each on the validation split)")
    if pooling_by not in ("valid", "cv"):
        raise UserError(f"pooling_by={pooling_by!r}: choose valid (the validation split, through the bootstrap gate) "
                        f"or cv (the probes' cross-validation on the training split)")
    if int(max_tokens) < 1:
        raise UserError(f"max_tokens={max_tokens}: must be positive")
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
    check_freeze(freeze)
    if lora and str(freeze).lower() != "none":
        raise UserError(f"lora=true with freeze={freeze}: LoRA freezes the encoder's own weights and adapts every "
                        f"block; leave freeze=none")
    if lora:
        check_lora(lora_rank, lora_alpha)
    if isinstance(layer_decay, bool) or not isinstance(layer_decay, (int, float)) or not 0 < layer_decay <= 1:
        raise UserError(f"layer_decay={layer_decay}: a factor in (0, 1] (1: every block at lr)")
    if stop_on not in ("loss", "metric"):
        raise UserError(f"stop_on={stop_on!r}: choose loss or metric (the one select_by names)")
    for name, v in (("interpolate", interpolate), ("probe_baseline", probe_baseline), ("refit_probe", refit_probe)):
        if not isinstance(v, bool):
            raise UserError(f"{name}={v!r}: true or false")
    for name, v in (("min_confidence", min_confidence), ("epoch_confidence", epoch_confidence),
                    ("pooling_confidence", pooling_confidence)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise UserError(f"{name}={v!r}: a share of the bootstrap draws in [0, 1] (0: keep the higher "
                            f"validation score)")
    if isinstance(ensemble, bool) or not isinstance(ensemble, (int, float)) or not 0 < ensemble <= 1:
        raise UserError(f"ensemble={ensemble!r}: the best epoch's share of the output mix with the probe, in (0, 1] "
                        f"(1: the epoch alone)")
    return select_by, check_choices(pooling_choices)


def _examples(labels, task: str, sequences, test_labels, tok: Tokenizer, valid_fraction: float,
              test_fraction: float, seed: int) -> tuple[Examples, np.ndarray]:
    """The labeled proteins (``labels`` and ``test_labels``, read and checked) and the split of each."""
    ex = read_examples(labels, task, sequences, tok)
    if test_labels is not None:
        more = read_examples(test_labels, task, sequences, tok)
        if ex.split[0] is None:  # the test proteins are given: labels holds train (and valid)
            ex.split = ["train"] * len(ex.split)
        ex = Examples(ex.ids + more.ids, ex.seqs + more.seqs, ex.labels + more.labels,
                      ex.split + ["test"] * len(more.ids))
    if task == "classification":  # before the split, whose line would call them classes
        check_classes(ex.labels, labels)
    split = assign_splits(ex, valid_fraction, test_fraction, seed, str(labels),
                          strata=ex.labels if task == "classification" else None)
    # probe's rule: test proteins (by sequence) that the model trains on are refused, or warned of with counts
    check_test_overlap([q for q, s in zip(ex.seqs, split) if s != "test"],
                       [q for q, s in zip(ex.seqs, split) if s == "test"], test_labels or labels)
    return ex, split


def _classes_and_scale(ex: Examples, split: np.ndarray, task: str, labels) -> tuple[list, tuple[float, float]]:
    """The classes in sorted order (none for regression), and the regression target's (mean, std) on
    the training split (the head learns standardized values; (0, 1) for the other tasks)."""
    classes = (sorted({c for lab in ex.labels for c in lab}) if task == "residue"
               else sorted(set(ex.labels)) if task == "classification" else [])
    if task != "regression" and len(classes) < 2:
        raise UserError(f"labels {labels}: one class only ({classes[0]!r}); nothing to learn")
    train_y = np.array([y for y, s in zip(ex.labels, split) if s == "train"] if task == "regression" else [])
    scale = (float(train_y.mean()), float(train_y.std()) or 1.0) if task == "regression" else (0.0, 1.0)
    return classes, scale


def _build_net(ckpt, labels, ex: Examples, task: str, classes: list, pooling: str, dropout: float, window: int,
               seed: int, richest: str = "layers") -> tuple[FineTuneNet, int]:
    """The checkpoint's encoder and a seeded new head (pooling=auto: the ``richest`` of its choices',
    whose features hold the others', :func:`_auto_pooling` chooses); returns it and the window (capped at
    the longest protein)."""
    window = (RESIDUE_WINDOW if task == "residue" else 0) if window is None else window
    longest = max(len(s) for s in ex.seqs) + 2
    if task == "residue" and isinstance(window, int) and not isinstance(window, bool) and window > longest - 3:
        # the head's context cannot reach past the longest protein: beyond it, only cost
        log.warning("window=%d: capped at %d, the longest protein's length less one (%d residues); a wider "
                    "window sees nothing more and costs window x length per protein", window, longest - 3,
                    longest - 2)
        window = longest - 3
    encoder = load_model(ckpt).net.encoder
    if encoder.pos_embed is not None and longest > encoder.max_positions:
        raise UserError(f"labels {labels}: a protein of {longest - 2} residues is longer than the model's learned "
                        f"positions (model.max_positions={encoder.max_positions})")
    torch.manual_seed(seed)
    pooling = (richest if task != "residue" else "mean") if pooling == "auto" else pooling
    return FineTuneNet(encoder, task, 1 if task == "regression" else len(classes), pooling, dropout, window), window


def _auto_pooling(net: FineTuneNet, data: dict[str, Encoded], pooling: str, max_tokens: int, scale, select_by: str,
                  confidence: float, dropout: float, window: int, seed: int, by_cv: bool = False,
                  choices: tuple[str, ...] = CHOICES):
    """pooling=auto (:func:`~.pooling_choice.choose_pooling`) among ``choices`` on ``net``, built with the last
    choice's head: its features hold the others', so one pass chooses and feeds the probe.  Returns the net
    with the chosen head (seeded as a plain run of that pooling seeds it), the pooling, the choice's summary
    and the training split's features (None, None where there was no choice: another pooling, or task=residue)."""
    if pooling != "auto" or net.task == "residue":
        return net, "mean" if pooling == "auto" else pooling, None, None
    pooling, choice, features = choose_pooling(net, data, max_tokens, scale, select_by, confidence, seed, by_cv,
                                               choices)
    if pooling != choices[-1]:
        torch.manual_seed(seed)
        net = FineTuneNet(net.encoder, net.task, net.head.out.out_features, pooling, dropout, window)
    return net, pooling, choice, features


def _adapt(net: FineTuneNet, freeze, gradient_checkpointing: bool, lora) -> None:
    """The net frozen, adapted (``lora``: (rank, alpha, dropout), or None) and checkpointed as asked."""
    net.freeze(freeze)
    if lora:
        net.add_lora(*lora)
    if gradient_checkpointing:
        net.checkpoint_blocks()


def _encode(ex: Examples, part: dict, task: str, classes: list, tok: Tokenizer) -> dict[str, Encoded]:
    """Each split's proteins as tokens and targets (a class index, a value, or a class index per residue)."""
    index = {c: i for i, c in enumerate(classes)}
    tokens = [tok.encode(s) for s in ex.seqs]
    targets = [float(y) if task == "regression" else
               np.array([index[c] for c in y]) if task == "residue" else index[y] for y in ex.labels]
    return {s: Encoded([tokens[i] for i in idx], [targets[i] for i in idx]) for s, idx in part.items()}


def _trainer_settings(trainer: dict | None, schedule: str, patience: int, progress_every, progress_seconds,
                      watch: str = "loss", metric: str = "loss"):
    """pl.Trainer's keyword arguments (finetune's defaults under ``trainer``'s), with early stopping on the
    validation ``watch`` (loss, or a metric: higher is better) and the progress lines (the validation loss
    and ``metric``, select_by's); and trainer.max_time in seconds (None: not set).  Lightning's tips and
    notices are silenced for the Trainer these settings make (training.quiet)."""
    quiet_libraries()
    settings = {"accelerator": "cpu", "devices": 1, "max_epochs": MAX_EPOCHS, "logger": False,
                "enable_checkpointing": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                **(trainer or {})}
    seconds = time_budget(settings.get("max_time"))
    if schedule == "linear" and settings.get("max_epochs") == -1 and settings.get("max_steps", -1) == -1 \
            and seconds is None:
        raise UserError("schedule=linear falls to 0 at the last step: set trainer.max_epochs, trainer.max_steps or "
                        "trainer.max_time, or use schedule=constant")
    settings["enable_progress_bar"], progress = lightning_progress(
        settings.get("enable_progress_bar", True), "finetune", every=progress_every, seconds=progress_seconds,
        epochs=True, also=(f"val/{metric}",) if metric != "loss" else ())
    settings["callbacks"] = [pl.callbacks.EarlyStopping(f"val/{watch}", patience=patience,
                                                       mode="min" if watch == "loss" else "max",
                                                       check_on_train_epoch_end=False), *progress]
    return settings, seconds


def _train(fit: pl.Trainer, module: FineTuner, data: dict[str, Encoded], pad_id: int, max_tokens: int, seed: int,
           scale: tuple[float, float], probe: bool, head_init: str, shares: bool = False,
           min_confidence: float = 0.0, ensemble: float = 1.0, epoch_confidence: float = 1.0,
           features=None, refit: bool = False) -> tuple[dict | None, float, dict]:
    """The probe fitted (``probe``) and validated as the first candidate, the head reset to random
    unless head_init=probe, the epochs trained, with ``shares`` their best interpolated with the probe
    (:data:`SHARES`) and validated, with ``ensemble`` < 1 the best fine-tuned one mixed with the probe
    in output space (:func:`_ensemble`; the epoch alone again where it beats the mix in ``epoch_confidence``
    of the bootstrap draws), the probe kept unless the best beats it in ``min_confidence`` of
    the bootstrap draws, and the kept candidate's weights put back (``features``: the training split's
    frozen features, already computed by pooling=auto), a kept probe, or a kept mix's probe half, fitted
    again with the validation proteins (``refit``: :func:`_refit_probe`); returns what the probe fitted (None: no probe; its
    ``refit``), the seconds it all took, and the gate's figures (for selection_summary)."""
    net = module.net
    pl.seed_everything(seed, verbose=False)
    start = time.perf_counter()
    random_head = {k: v.clone() for k, v in net.head.state_dict().items()}
    fitted = probe_head_init(net, data["train"], max_tokens, scale, seed, features) if probe else None  # baseline
    valid = _loader(data["valid"], pad_id, max_tokens)
    probed = None
    if fitted is not None:  # the probe is a candidate for the kept weights (head_init=probe: the start)
        module.stage = "probe"
        fit.validate(module, valid, verbose=False)
        # the mixes' start and the gate's fallback: copied only when they are used
        probed = snapshot(net) if shares or min_confidence > 0 or ensemble < 1 else None
    if head_init == "random":
        net.head.load_state_dict(random_head)
    net.train()  # the loaded encoder is in eval mode: its dropout on while it trains (frozen parts stay off)
    fit.fit(module, _loader(data["train"], pad_id, max_tokens, train=True, seed=seed), valid)
    if shares and probed is not None and module.best_epoch:  # an epoch beat the probe: pull it back toward it
        tuned, name, module.stage_epoch = module.best, module.best_name, module.best_epoch
        for share in SHARES:
            net.load_state_dict(interpolate(probed, tuned, share), strict=False)
            module.stage = f"{share:g} {name} + {1 - share:g} probe"
            fit.validate(module, valid, verbose=False)
    gate = {"min_confidence": float(min_confidence)}
    if ensemble < 1 and probed is not None and module.best_tuned is not None:
        gate.update(_ensemble(fit, module, valid, probed, ensemble, epoch_confidence, seed))
    confidence = module.confidence_over_probe(seed)
    if confidence is not None:
        gate.update(best_tuned=module.best_name, confidence=confidence)
        if confidence < min_confidence:
            module.keep_probe(probed)
    if module.best_name == "probe":
        net.detach_probe()  # the probe's own weights are the kept network's
    seconds = time.perf_counter() - start
    if module.best is not None:
        net.load_state_dict(module.best, strict=False)
    refitted = net if module.best_name == "probe" else net.probe  # a kept probe, or a kept mix's probe half
    if refit and fitted is not None and refitted is not None:
        fitted["refit"] = _refit_probe(refitted, data, max_tokens, scale, seed)
    return fitted, seconds, gate


def _ensemble(fit: pl.Trainer, module: FineTuner, valid, probed: dict, share: float, epoch_confidence: float = 1.0,
              seed: int = 0) -> dict:
    """The output-space ensemble validated and made the fine-tuned candidate, whatever its rank (a fixed
    rule, not a choice on the validation split: docs/downstream.md): ``share`` of the best fine-tuned
    candidate's outputs and the rest of a frozen copy of the network with the probe's weights; that
    candidate alone again when it beats the mix in ``epoch_confidence`` of the validation bootstrap's
    draws (< 1; where fine-tuning is far ahead of the probe, the probe only drags the mix). Returns the
    figures for metrics.json: that confidence, and whether the epoch alone was kept."""
    net = module.net
    member = copy.deepcopy(net)  # the checkpoint's encoder and the probe's head, frozen
    member.load_state_dict(probed, strict=False)
    net.load_state_dict(module.best_tuned, strict=False)
    alone = module.tuned_record()  # the mix's validation may take the best fine-tuned candidate's place
    net.attach_probe(member, share)
    name = module.best_tuned_name
    module.stage, module.stage_epoch = f"ensemble: {share:g} {name} + {1 - share:g} probe", module.best_tuned_epoch
    module.keep_next = True
    fit.validate(module, valid, verbose=False)
    if epoch_confidence >= 1 or module.select_by == "loss" or alone[4] is None:
        return {}
    confidence = bootstrap_confidence(net.task, module.select_by, module.best_val, alone[4], seed)
    if confidence >= epoch_confidence:
        net.detach_probe()
        module.keep_record(alone)
    return {"epoch_confidence": float(epoch_confidence), "epoch_over_mix": confidence,
            "epoch_alone": confidence >= epoch_confidence}


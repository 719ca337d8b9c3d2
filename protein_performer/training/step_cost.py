"""Equal wall-clock budgets measured side by side: each model's step count for a time budget.

Training models one after another for the same ``trainer.max_time`` gives each the speed of the
machine during its own minutes; on a shared machine that moves a model's step count by 10-20 %
(docs/long_proteins.md).  Here every model's training step (forward, loss, backward, clipping, the
run's optimizer) is timed on real batches of each crop of its length curriculum, the models taking turns
rep by rep in one process, so load changes hit all of them alike; then the budget is walked
through the curriculum at those costs (:func:`steps_within`) and each model trains for its count.
"""
from __future__ import annotations

import statistics
import time
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from ..objectives import IGNORE

#: timed batches per model and crop (conf/compare.yaml's calibration_reps)
CALIBRATION_REPS = 16


def crop_schedule(data_cfg) -> list[tuple[int, int]]:
    """(step, crop) phases of a data config: its ``crop_schedule`` with crops capped by ``max_len``
    (as the sampler caps them), or one phase at ``max_len``. Read, not checked: the data module
    that :func:`measure_step_costs` instantiates from the same config checks it first (training
    gets its data through the config, never by importing protein_performer.data)."""
    schedule = data_cfg.get("crop_schedule") if data_cfg.get("max_tokens") is not None else None
    cap = int(data_cfg.max_len)
    return [(int(s), min(int(c), cap)) for s, c in schedule] if schedule else [(0, cap)]


def steps_within(schedule: Sequence[tuple[int, int]], cost: Mapping[int, float], seconds: float,
                 limit: int = 10 ** 7) -> int:
    """How many steps fit in ``seconds`` when a step at crop c costs ``cost[c]`` s and the crop
    follows ``schedule`` (from step s on, crop c)."""
    steps, elapsed, phases = 0, 0.0, sorted(schedule)  # phases[0] starts at step 0 (the data module checks it)
    while steps < limit:
        crop = next(c for s, c in reversed(phases) if s <= steps)
        if elapsed + cost[crop] > seconds:
            break
        elapsed += cost[crop]
        steps += 1
    return steps


def _batches(data, crop: int, n: int) -> list[dict]:
    """``n`` training batches of a set-up data module with its curriculum held at ``crop``, spread
    evenly over the epoch's batch plan: a token budget's batches range from many short proteins
    to one long one, and exact attention's cost with them (the first few would be a lottery)."""
    if data.max_tokens is not None:
        data.crop_schedule = [(0, crop)]  # what the data module's check makes of [[0, crop]]
    loader = data.train_dataloader()
    if loader.batch_size is None:  # the batch sampler is the loader's sampler: a plan of index lists
        plan = list(loader.sampler)
        picks = [plan[round(i * (len(plan) - 1) / max(n - 1, 1))] for i in range(n)]
        return [loader.collate_fn(loader.dataset[idx]) for idx in picks]
    it = iter(loader)  # fixed-size batches: every one has the same shape
    return [next(it) for _ in range(n)]


def measure_step_costs(cfgs: Mapping[str, object], reps: int = CALIBRATION_REPS, clip: float = 1.0) -> dict[str, dict[int, float]]:
    """Mean seconds of one training step per model and crop over ``reps`` batches spread over the
    epoch: ``{name: {crop: s}}``.  The mean, not the median: the budget is a sum of steps, and exact
    attention's costs are skewed (a batch of 1,024-residue crops costs twice one of short proteins;
    medians bought it 294 steps that took 539 s of a 420 s budget, at bcb4c14).  ``cfgs``: composed
    training configs (compare.compose_train_config); every model starts from its own seeded
    initialization; rep r of every (model, crop) uses the same r-th batch, the models in turn, after
    one warm-up step each; glibc keeps freed memory when training would (``malloc=keep``, the default)."""
    import hydra
    import pytorch_lightning as pl

    from ..allocator import keep_freed_memory
    from .run import build_task
    if any(cfg.get("malloc", "keep") == "keep" for cfg in cfgs.values()):
        keep_freed_memory()  # as training does (run.train): else large activations page-fault in at every step
    work = {}
    for name, cfg in cfgs.items():
        pl.seed_everything(int(cfg.seed), verbose=False)
        task = build_task(cfg, None).train()
        opt = task.optimizer()  # the run's own (optim.optimizer): Muon's step costs more than AdamW's
        data = hydra.utils.instantiate(cfg.data)
        data.setup("fit")
        crops = sorted({c for _, c in crop_schedule(cfg.data)})
        work[name] = (task, opt, {c: _batches(data, c, reps + 1) for c in crops})

    def step(name: str, batch: dict) -> None:
        task, opt, _ = work[name]
        inputs, labels = task.model_ids(batch)
        logits = task(inputs, batch["padding_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.parameters(), clip)
        opt.step()

    times = {name: {c: [] for c in w[2]} for name, w in work.items()}
    for r in range(reps + 1):
        for crop in sorted({c for w in work.values() for c in w[2]}):
            for name, (_, _, batches) in work.items():
                if crop not in batches:
                    continue
                t0 = time.perf_counter()
                step(name, batches[crop][r])
                if r:  # rep 0 warms up
                    times[name][crop].append(time.perf_counter() - t0)
    return {name: {c: statistics.fmean(ts) for c, ts in per.items()} for name, per in times.items()}

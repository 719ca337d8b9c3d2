"""Fine-tuning: a supervised head on a pretrained encoder (``protein-performer finetune``).

labels (a CSV, or FLIP's per-residue FASTA) -> examples with a train / valid / test split ->
the checkpoint's :class:`~protein_performer.model.PerformerEncoder` + a head from
:mod:`protein_performer.model.heads`, trained by a Lightning Trainer on token-budget batches and
early-stopped on the validation loss (the best weights kept) -> in ``output_dir``:
``metrics.json`` and ``predictions.csv`` on the test split, ``model.safetensors`` (encoder +
head) and ``finetune.json`` (what :func:`~protein_performer.hub.load.load_finetuned` needs to rebuild
them, and the settings it was trained with: pooling, dropout, freeze, head_init, schedule, warmup;
``export ckpt=output_dir`` makes a transformers directory of them).

Every input is read and checked before the model trains, and nothing is written before the
training ends: a bad file is one line naming file and line, with nothing written.

Modules, lowest first: :mod:`.labels` (label files -> examples, and their splits; the CSV reader is
probe's), :mod:`.batches` (encoded examples in token-budget batches), :mod:`.schedule` (the learning
rates, trainer.max_time, the validation metric that keeps weights), :mod:`.head_init` (the linear
probe the head may start from, and the baseline it competes with), :mod:`.pooling_choice` (pooling=auto:
which hidden states the head reads, chosen by two probes on the validation split, or by their
cross-validation), :mod:`.module` (the LightningModule, :class:`FineTuner`), :mod:`.report` (test
predictions, metrics, the printed lines), :mod:`.outputs` (``output_dir``: what may be there, what is
written), :mod:`.run` (:func:`finetune`, the command end to end).
"""
from ..model.heads import FineTuneNet
from .batches import Encoded, _loader, collate
from .head_init import PROBE_RESIDUES, probe_head_init
from .labels import SPLITS, TASKS, Examples, _read_csv, assign_splits, read_examples
from .module import FineTuner, _state, encoder_groups
from .outputs import CONFIG, JOURNAL, METRICS, OUTPUTS, PREDICTIONS, WEIGHTS, _check_output, _write_outputs
from .report import baseline, format_metrics, metrics, predict, selection_summary
from .run import ENSEMBLE, EPOCH_CONFIDENCE, MIN_CONFIDENCE, POOLING_CONFIDENCE, RESIDUE_WINDOW, finetune
from .schedule import SELECT_BY, WARMUP, selection_metric, time_budget, warmup_linear

_lightning_module = FineTuner  # its name before the split (a function building the module)

__all__ = ["finetune", "format_metrics", "read_examples", "assign_splits", "Examples", "FineTuner", "FineTuneNet",
           "Encoded", "probe_head_init", "metrics", "baseline", "predict", "selection_summary", "selection_metric",
           "warmup_linear", "time_budget", "RESIDUE_WINDOW", "WARMUP", "PROBE_RESIDUES", "SELECT_BY", "TASKS",
           "SPLITS", "encoder_groups"]

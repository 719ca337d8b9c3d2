"""What finetune writes into ``output_dir``, and what it may write over: ``model.safetensors``,
``finetune.json``, ``predictions.csv`` and ``metrics.json`` (last: a folder holding it is whole),
recorded in a journal so that a rerun replaces only finetune's own files."""
from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path

from ..errors import UserError
from ..files import WrittenFiles, atomic_path, dead_temporaries, remove_path, write_json, write_text
from ..hub.load import FINETUNE_CONFIG as CONFIG
from ..model.heads import FineTuneNet
from .module import _state

METRICS, PREDICTIONS, WEIGHTS = "metrics.json", "predictions.csv", "model.safetensors"
JOURNAL = ".finetune-files.json"  # what finetune wrote into output_dir: what a rerun may replace
OUTPUTS = (WEIGHTS, CONFIG, PREDICTIONS, METRICS)


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

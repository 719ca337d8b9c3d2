"""Evaluate trained checkpoints on any FASTA / UniProt file, at full length, by length bucket.

For each protein (``<cls> residues <eos>``):

* masked-LM: 15 % of residues are selected and corrupted 80/10/10 (``mask_tokens``) with a
  generator seeded from (seed, the protein's tokens), so the masks of a protein do not
  depend on the batch it lands in, the order of the file or the token budget;
  the selected residues are scored.
* causal LM: every residue is scored given ``<cls>`` and the residues before it (the
  ``<eos>`` target is not scored, so the model and the amino-acid baseline score exactly
  the same positions).

Linear-attention models see every protein whole, whatever its length and whatever crop
they were trained with. Exact softmax (quadratic memory) sees proteins longer than
``window`` tokens through overlapping windows (``stride`` apart); each position is scored
exactly once, in the window that gives it the most context (causal: the longest prefix;
masked: the most central window). Models with learned positions are windowed at their
``max_positions``. ``metrics.json`` records which was used.

Figures are token-weighted (summed NLL / scored tokens), overall and per length bucket
(by number of residues); the baseline is the amino-acid frequencies of the checkpoint's
training data (the Performer paper's "empirical baseline"), scored on the same positions.
"""
from __future__ import annotations

import csv
import io
import itertools
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from .objectives import IGNORE, MASK_PROB, Scores, score_rows, scored_example
from .data.sampler import MAX_TOKENS, token_budget_batches
from .device import resolve_device
from .hub.load import load_model
from .data.buckets import check_buckets
from .data.collate import pad_batch
from .sequences import check_max_records, read_sequences, skipped_text
from .hub.load import checkpoint_step
from .tokenizer import Tokenizer
from .errors import UserError
from .files import atomic_path, write_json, write_text
from .output_guard import OutputGuard

log = logging.getLogger(__name__)

# (label, lowest length, highest length) in residues
BUCKETS: tuple[tuple[str, int, float], ...] = (
    ("<=256", 0, 256), ("257-512", 257, 512), ("513-1024", 513, 1024),
    ("1025-2048", 1025, 2048), ("2049-4096", 2049, 4096), (">4096", 4097, math.inf))
METRIC_KEYS = ("perplexity", "accuracy", "loss", "num_tokens", "num_sequences",
               "baseline_perplexity", "baseline_accuracy")


def length_bucket(num_residues: int) -> str:
    """The label of the length bucket a protein of ``num_residues`` residues falls in."""
    for label, lo, hi in BUCKETS:
        if lo <= num_residues <= hi:
            return label
    raise UserError(f"invalid protein length {num_residues}")


@dataclass
class Piece:
    """A stretch of one protein fed to the model: inputs and labels (IGNORE where not scored)."""
    seq: int
    inputs: torch.Tensor
    labels: torch.Tensor


@dataclass
class Protein:
    id: str
    tokens: np.ndarray  # <cls> residues <eos>, as Tokenizer.encode gives

    @property
    def num_residues(self) -> int:
        return len(self.tokens) - 2


# --- input ----------------------------------------------------------------------------
def load_proteins(path: str | Path, format: str | None = None, max_records: int | None = None,
                  unknown: str = "error", on_invalid: str = "error") -> list[Protein]:
    """Read and tokenize a FASTA or UniProt ``.dat`` file (plain or gzipped) under the one
    invalid-record policy of :func:`protein_performer.sequences.read_sequences`."""
    check_max_records(max_records)
    stats: dict = {}
    entries = read_sequences(path, format, unknown=unknown, on_invalid=on_invalid, stats=stats)
    proteins = [Protein(e.id, e.tokens) for e in itertools.islice(entries, max_records)]
    if any(stats.values()):
        log.warning("%s: skipped %s", path, skipped_text(stats))
    if not proteins:
        raise UserError(f"{path}: no protein records to evaluate (skipped: {skipped_text(stats)})")
    return proteins


def _as_proteins(sequences: Iterable, tokenizer: Tokenizer) -> list[Protein]:
    out = []
    for i, s in enumerate(sequences):
        if isinstance(s, Protein):
            out.append(s)
        elif isinstance(s, str):
            out.append(Protein(f"seq{i}", tokenizer.encode(s, record=f"seq{i}")))
        else:
            out.append(Protein(f"seq{i}", np.asarray(s, dtype=np.uint8)))
    return out


# --- what to score: objectives.scored_example, cut into windows for exact attention --------
def window_spans(n: int, window: int, stride: int, causal: bool) -> list[tuple[int, int, int, int]]:
    """Split positions 0..n-1 into windows [start, end) of ``window`` positions, ``stride``
    apart (the last aligned to the end), each owning [own_start, own_end): every position is
    owned by exactly one window. Causal: a window owns what the previous did not reach (the
    most left context); bidirectional: the boundaries sit mid-way through the overlaps."""
    if window < 1 or not 0 < stride <= window:
        raise UserError(f"need window >= 1 and 0 < stride <= window, got window={window}, stride={stride}")
    if n <= window:
        return [(0, n, 0, n)]
    starts = list(range(0, n - window, stride)) + [n - window]
    ends = [s + window for s in starts]
    spans = []
    for i, (s, e) in enumerate(zip(starts, ends)):
        if causal:
            own_s = 0 if i == 0 else ends[i - 1]
            own_e = e
        else:
            own_s = 0 if i == 0 else (s + ends[i - 1]) // 2
            own_e = n if i == len(starts) - 1 else (starts[i + 1] + e) // 2
        if own_e > own_s:
            spans.append((s, e, own_s, own_e))
    return spans


# --- the model -----------------------------------------------------------------------------
def _window_for(net, kernel: str | None, window: int | None, stride: int | None
                ) -> tuple[int | None, int | None, str | None]:
    """(window, stride, reason) for this model, or (None, None, None) when it sees proteins whole."""
    if net.pos_embed is not None:  # learned positions cannot go past max_positions
        w = net.max_positions if window is None else min(window, net.max_positions)
        s = min(stride or w // 2, w)
        return w, s, "learned positions (model.max_positions)"
    if kernel == "exact" and window is not None:
        return window, (stride or window // 2), "exact softmax attention (quadratic memory)"
    return None, None, None


def check_mask_prob(mask_prob) -> None:
    """A masked-LM masks a share of residues: 0 scores nothing, 1 leaves no context."""
    if isinstance(mask_prob, bool) or not isinstance(mask_prob, (int, float)) or not 0 < mask_prob < 1:
        raise UserError(f"mask_prob must be in (0, 1), got {mask_prob!r}")


@torch.no_grad()
def evaluate_model(model, sequences: Sequence, *, seed: int = 0, mask_prob: float = MASK_PROB,
                   max_tokens: int = MAX_TOKENS, batch_size: int = 64, window: int | None = 4096,
                   stride: int | None = 2048, device: str = "cpu", progress: bool = True,
                   desc: str = "evaluate", buckets=None) -> dict:
    """Score ``sequences`` (Protein objects, strings or token arrays) with ``model`` (a
    ProteinLM, a checkpoint path or anything :func:`protein_performer.hub.load.load_model` takes).

    Returns ``metrics.json``'s content: the figures overall, ``buckets`` (the same figures
    per length bucket) and ``evaluation`` (objective, seed, attention kernel and whether
    proteins were seen whole or windowed).  ``buckets``: batches padded to these lengths
    (data/buckets.py; the same figures, one shape per bucket)."""
    check_mask_prob(mask_prob)
    loaded = load_model(model, device)
    net, tokenizer, objective = loaded.net, loaded.tokenizer, loaded.objective
    proteins = _as_proteins(sequences, tokenizer)
    if not proteins:
        raise UserError("nothing to evaluate: no sequences")
    dev = resolve_device(device)
    freqs = loaded.aa_frequencies
    win, stride_used, why = _window_for(net, loaded.kernel, window, stride)

    pieces: list[Piece] = []
    windowed = 0
    for i, p in enumerate(proteins):
        inputs, labels = scored_example(p.tokens, objective, tokenizer, seed, mask_prob)
        n = len(inputs)
        if win is None or n <= win:
            pieces.append(Piece(i, inputs, labels))
            continue
        windowed += 1
        for s, e, own_s, own_e in window_spans(n, win, stride_used, causal=objective == "clm"):
            lab = torch.full((e - s,), IGNORE, dtype=labels.dtype)
            lab[own_s - s:own_e - s] = labels[own_s:own_e]
            pieces.append(Piece(i, inputs[s:e], lab))

    buckets = check_buckets(buckets, max(len(p.inputs) for p in pieces), "buckets")
    per_seq = [Scores(sequences=1) for _ in proteins]
    total = sum(len(p.inputs) for p in pieces)
    bar = None
    if progress:  # tqdm's bar on a terminal; in a log, a plain line every 50 batches or 30 s
        from .training.progress import progress_bar
        bar = progress_bar(total, desc, "tokens", stream=sys.stderr, tqdm_kw={"unit": "tok", "unit_scale": True})
    for idx in token_budget_batches([len(p.inputs) for p in pieces], max_tokens, batch_size, buckets):
        batch = [pieces[i] for i in idx]
        inputs, padding = pad_batch([p.inputs for p in batch], tokenizer.pad_id, buckets)
        labels = pad_sequence([p.labels for p in batch], batch_first=True, padding_value=IGNORE)
        labels = F.pad(labels, (0, inputs.shape[1] - labels.shape[1]), value=IGNORE)
        rows = score_rows(net(inputs.to(dev), None if padding is None else padding.to(dev)), labels.to(dev), freqs)
        rows = {k: v.tolist() for k, v in rows.items()}
        for r, p in enumerate(batch):
            per_seq[p.seq].add({k: v[r] for k, v in rows.items()})
        if bar is not None:
            bar.update(sum(len(p.inputs) for p in batch))
    if bar is not None:
        bar.close()

    overall = Scores()
    buckets = {label: Scores() for label, _, _ in BUCKETS}
    for p, s in zip(proteins, per_seq):
        overall.add(s)
        buckets[length_bucket(p.num_residues)].add(s)
    has_base = freqs is not None
    result = overall.metrics(has_base)
    result["buckets"] = {k: v.metrics(has_base) for k, v in buckets.items()}
    result["evaluation"] = {
        "objective": objective,
        "scored": "masked residues" if objective == "mlm" else "every residue (next-token)",
        "mask_prob": mask_prob if objective == "mlm" else None,
        "seed": seed,
        "attention_kernel": loaded.kernel,
        "full_length": windowed == 0,
        "window": win,
        "stride": stride_used,
        "window_reason": why,
        "windowed_sequences": windowed,
        "baseline": "training amino-acid frequencies (from the checkpoint)" if has_base else None,
    }
    return result


# --- checkpoints, files ----------------------------------------------------------------------
def checkpoint_name(path: str | Path) -> str:
    """A readable label: the run directory for ``<run>/checkpoints/x.ckpt``, else the file stem."""
    p = Path(path)
    if p.parent.name == "checkpoints" and p.parent.parent.name:
        return p.parent.parent.name if p.stem == "last" else f"{p.parent.parent.name}/{p.stem}"
    return p.stem


def _unique_names(paths: Sequence[str], names: Sequence[str] | None) -> list[str]:
    if names is not None:
        if len(names) != len(paths):
            raise UserError(f"names: {len(names)} given for {len(paths)} checkpoints")
        return list(names)
    out: list[str] = []
    for p in paths:
        base, n = checkpoint_name(p), 2
        name = base
        while name in out:
            name, n = f"{base}-{n}", n + 1
        out.append(name)
    return out


def write_csv(results: dict[str, dict], path: str | Path) -> None:
    """One row per (checkpoint, bucket); bucket "all" is the whole set."""
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(["checkpoint", "bucket", *METRIC_KEYS])
    for name, m in results.items():
        w.writerow([name, "all", *(m[k] for k in METRIC_KEYS)])
        for label, bm in m["buckets"].items():
            w.writerow([name, label, *(bm[k] for k in METRIC_KEYS)])
    write_text(path, buf.getvalue())


def plot(results: dict[str, dict], path: str | Path, title: str | None = None) -> None:
    """Perplexity and accuracy against length bucket, one line per checkpoint, baseline dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [b[0] for b in BUCKETS]
    x = np.arange(len(labels))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    baselines: dict[tuple, str] = {}
    for name, m in results.items():
        for ax, key in zip(axes, ("perplexity", "accuracy")):
            y = [m["buckets"][b][key] for b in labels]
            ax.plot(x, [np.nan if v is None else v for v in y], marker="o", label=name)
        base = tuple(m["buckets"][b]["baseline_perplexity"] for b in labels) + \
            tuple(m["buckets"][b]["baseline_accuracy"] for b in labels)
        # equal up to float32 summation order (windows batch differently): one line
        key = tuple(None if v is None else round(v, 4) for v in base)
        baselines.setdefault(key, (base, name))
    for base, name in baselines.values():
        if all(v is None for v in base):
            continue
        tag = "amino-acid baseline" + (f" ({name})" if len(baselines) > 1 else "")
        k = len(labels)
        for ax, ys in zip(axes, (base[:k], base[k:])):
            ax.plot(x, [np.nan if v is None else v for v in ys], ls="--", color="gray", label=tag)
    for ax, key in zip(axes, ("perplexity", "accuracy")):
        ax.set_xticks(x, labels, rotation=30)
        ax.set_xlabel("protein length (residues)")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)


def _log_wandb(results: dict[str, dict], png: Path) -> None:
    wandb = sys.modules.get("wandb")  # only a process that imported wandb can have a run
    if wandb is None or getattr(wandb, "run", None) is None:
        return
    data = {}
    for name, m in results.items():
        for k in METRIC_KEYS:
            data[f"eval/{name}/{k}"] = m[k]
        for b, bm in m["buckets"].items():
            for k in ("perplexity", "accuracy"):
                data[f"eval/{name}/{b}/{k}"] = bm[k]
    data["eval/plot"] = wandb.Image(str(png))
    wandb.log(data)


def evaluate(ckpt: str | Sequence[str], data_path: str | Path, output_dir: str | Path, *,
             names: Sequence[str] | None = None, format: str | None = None, max_records: int | None = None,
             unknown: str = "error", on_invalid: str = "error", overwrite: bool = False,
             **kwargs) -> dict[str, dict]:
    """Evaluate one or several checkpoints on one file; write ``metrics.json``, ``metrics.csv``
    and ``metrics.png`` into ``output_dir``. With one checkpoint ``metrics.json`` holds its
    figures; with several it holds ``{"checkpoints": {name: figures}}`` and each also gets
    ``output_dir/<name>/metrics.json``. ``kwargs`` go to :func:`evaluate_model`. Every output goes
    through the output guard: a file evaluate did not record writing in ``output_dir``'s journal
    is replaced only with ``overwrite`` (after a warning line), a name leaving ``output_dir`` or an
    output over an input is refused."""
    paths = [str(ckpt)] if isinstance(ckpt, (str, Path)) else [str(c) for c in ckpt]
    if not paths:
        raise UserError("ckpt: no checkpoint given")
    check_mask_prob(kwargs.get("mask_prob", MASK_PROB))
    for p in paths:  # fail before the (slow) work on a missing file
        if not Path(p).exists():
            raise FileNotFoundError(f"checkpoint {p}: no such file")
    labels = _unique_names(paths, names)
    out = Path(output_dir)
    guard = OutputGuard("evaluate", {"data.path": data_path, **{f"ckpt[{i}]": p for i, p in enumerate(paths)}},
                        overwrite=overwrite, folder=out, journal=True)
    guard.folder_path("output_dir", out)
    files = [out / n for n in ("metrics.json", "metrics.csv", "metrics.png")]
    if len(paths) > 1:
        files += [guard.child(out, n, f"names[{i}]" if names is not None else "checkpoint name") / "metrics.json"
                  for i, n in enumerate(labels)]
    for f in files:
        guard.file(f"output_dir/{f.relative_to(out)}", f)
    guard.sweep()
    proteins = load_proteins(data_path, format, max_records, unknown, on_invalid)
    results: dict[str, dict] = {}
    for path, name in zip(paths, labels):
        m = evaluate_model(load_model(path), proteins, desc=name, **kwargs)
        m["checkpoint"] = path
        m["step"] = checkpoint_step(path)
        m["data"] = str(data_path)
        results[name] = m
        base = "none" if m["baseline_perplexity"] is None else f"{m['baseline_perplexity']:.3f}"
        log.info("%s: perplexity %.3f (baseline %s), accuracy %.4f on %d tokens", name, m["perplexity"], base,
                 m["accuracy"], m["num_tokens"])
    # written only once every checkpoint is scored, each file whole (beside, then renamed)
    guard.record(*files)
    if len(results) == 1:
        write_json(out / "metrics.json", next(iter(results.values())), indent=2)
    else:
        write_json(out / "metrics.json", {"checkpoints": results}, indent=2)
        for name, m in results.items():
            write_json(out / name / "metrics.json", m, indent=2)
    write_csv(results, out / "metrics.csv")
    plot(results, out / "metrics.png", title=Path(data_path).name)
    guard.seal(*files)
    _log_wandb(results, out / "metrics.png")
    return results


def format_table(results: dict[str, dict]) -> str:
    """A markdown table: overall figures and perplexity per bucket, one row per checkpoint."""
    labels = [b[0] for b in BUCKETS]
    head = ["model", "step", "perplexity", "accuracy", "baseline ppl", "baseline acc", "tokens"] + \
        [f"ppl {b}" for b in labels]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v, pct=False):
        if v is None:
            return "–"
        return f"{100 * v:.2f} %" if pct else f"{v:.3f}"
    for name, m in results.items():
        cells = [name, str(m.get("step", "")), f(m["perplexity"]), f(m["accuracy"], True),
                 f(m["baseline_perplexity"]), f(m["baseline_accuracy"], True), str(m["num_tokens"])]
        cells += [f(m["buckets"][b]["perplexity"]) for b in labels]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)

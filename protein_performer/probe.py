"""Linear probes on embeddings, beside an amino-acid-composition baseline.

Why: a probe answers "do these embeddings know more than the residue counts do?". A
standardize + logistic-regression (classification) or ridge (regression) pipeline with
its regularization chosen by inner cross-validation is fitted on the embeddings and,
with the same protocol, on the 20 standard amino-acid frequencies of each sequence.
Scores come from the labels' own split (a test file or a ``split`` column) or, without
one, from outer K-fold cross-validation. A shuffled-label control shows what chance
looks like with the same pipeline.

Labels are a CSV/TSV (gzipped or not) with a ``label`` column and an ``id`` or ``seq``
column; without ids a sequence is found under :func:`protein_performer.formats.tabular.sequence_id`,
the id ``scripts/embed.py`` gives CSV rows without ids.
"""
from __future__ import annotations

import csv
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from .formats.tabular import csv_reader, sequence_id
from .tokenizer import STANDARD_AA
from .errors import UserError, first_line

log = logging.getLogger(__name__)


# --- inputs ----------------------------------------------------------------------------
#: attributes of scripts/embed.py's HDF5 files that say which model and layers gave the rows
MODEL_ATTRS = ("model_sha256", "checkpoint_sha256", "layers", "precision")


def load_embeddings(paths: str | Path | Sequence[str | Path], pooling: str = "mean",
                    layer: int | None = None) -> tuple[list[str], np.ndarray]:
    """ids and (N, D) rows from one or more HDF5 files written by ``scripts/embed.py``.
    ``layer`` picks ``<pooling>/<layer>`` when a file holds several layers. Files of
    different dimensions or of different models (their identity attributes), an id given
    two different rows and non-finite rows are one-line errors: one probe, one feature space."""
    import h5py
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    ids, rows, first = [], [], None
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"embeddings {p}: no such file")
        try:
            f = h5py.File(p, "r")
        except OSError:
            raise UserError(f"embeddings {p}: not an HDF5 file (expected the output of scripts/embed.py)") from None
        with f:
            if "ids" not in f or pooling not in f:
                raise UserError(f"embeddings {p}: no 'ids' and '{pooling}' datasets (has {sorted(f.keys())})")
            node = f[pooling]
            if not hasattr(node, "shape"):  # a group keyed by layer
                layers = sorted(node.keys(), key=int)
                if layer is None:
                    raise UserError(f"embeddings {p}: '{pooling}' holds layers {layers}; choose one with layer=")
                if str(layer) not in node:
                    raise UserError(f"embeddings {p}: no layer {layer} under '{pooling}' (has {layers})")
                node = node[str(layer)]
            x = np.asarray(node[:], dtype=np.float32)
            names = [v.decode() if isinstance(v, bytes) else str(v) for v in f["ids"][:]]
            model = {k: _plain(f.attrs[k]) for k in MODEL_ATTRS if k in f.attrs}
        if x.ndim != 2 or len(x) != len(names):
            raise UserError(f"embeddings {p}: '{pooling}' has shape {x.shape}, expected ({len(names)}, dim)")
        bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
        if bad.size:
            raise UserError(f"embeddings {p}: protein {names[bad[0]]!r} has a non-finite embedding "
                            f"({bad.size} such rows); embed it again")
        if first is None:
            first = (p, x.shape[1], model)
        elif x.shape[1] != first[1]:
            raise UserError(f"embeddings {p}: dimension {x.shape[1]}, but {first[0]} has {first[1]}; "
                            f"embed both with the same model")
        else:
            diff = [k for k in model if k in first[2] and model[k] != first[2][k]]
            if diff:
                raise UserError(f"embeddings {p}: made with another model than {first[0]} ({diff[0]} "
                                f"{model[diff[0]]} vs {first[2][diff[0]]}); embed both with the same model")
        ids += names
        rows.append(x)
    X = np.concatenate(rows)
    seen: dict[str, int] = {}
    for i, rid in enumerate(ids):
        j = seen.setdefault(rid, i)
        if j != i and not np.array_equal(X[i], X[j]):
            raise UserError(f"embeddings {', '.join(map(str, paths))}: id {rid!r} has two different embeddings")
    return ids, X


def _plain(v):
    """An HDF5 attribute as a comparable Python value."""
    return v.tolist() if isinstance(v, np.ndarray) else v.decode() if isinstance(v, bytes) else v


@dataclass
class Labels:
    ids: list[str]
    labels: list[str]
    seqs: list[str] | None
    split: list[str] | None
    source: str
    skipped: dict = field(default_factory=dict)


#: label cells that mean "no label" (probe skips and counts such rows; finetune refuses them)
MISSING = {"", "na", "n/a", "nan", "null", "none"}
#: the columns a label table may have (``sequence`` and ``seq`` are one column under two names)
LABEL_COLUMNS = ("id", "seq", "sequence", "label", "split")


class LabelRow(NamedTuple):
    line: int
    id: str                 # the id column, else sequence_id(seq)
    seq: str | None         # stripped; None without a sequence column
    label: str              # stripped
    split: str | None       # lower-cased; None without a split column


def label_rows(path: Path, check_header: Callable[[list[str], dict[str, int]], None]) -> Iterator[LabelRow]:
    """The rows of a label table (CSV or TSV, gzipped or not; the one reader of probe and finetune):
    columns ``label``, ``id`` and/or ``sequence`` (or ``seq``; ``sequence`` when there are both),
    optionally ``split``, in file order; rows of blank cells are skipped.  ``check_header(header,
    columns)`` (lower-cased names; name -> index) refuses a header its caller cannot use; a row of
    another number of cells than the header, or a file that is no CSV, is one line naming file and line."""
    reader = csv_reader(path)
    try:
        header = [h.strip().lower() for h in next(reader, [])]
        col = {name: header.index(name) for name in LABEL_COLUMNS if name in header}
        check_header(header, col)
        seq = col.get("sequence", col.get("seq"))
        for row in reader:
            if not any(c.strip() for c in row):
                continue
            n = reader.line_num
            if len(row) != len(header):
                raise UserError(f"{path}:{n}: expected {len(header)} columns, got {len(row)}")
            s = row[seq].strip() if seq is not None else None
            yield LabelRow(n, row[col["id"]].strip() if "id" in col else sequence_id(s), s,
                           row[col["label"]].strip(), row[col["split"]].strip().lower() if "split" in col else None)
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: not a readable CSV file ({e})") from e


def read_labels(path: str | Path) -> Labels:
    """A label table (:func:`label_rows`): columns ``label`` and ``id`` and/or ``seq`` (optionally ``split``).
    Rows with an empty sequence or a missing label (:data:`MISSING`) are counted, not fatal;
    a protein listed twice is counted once, and with two different labels is an error
    naming both lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"labels {path}: no such file")

    col: dict[str, int] = {}

    def check_header(header: list[str], columns: dict[str, int]) -> None:
        if "label" not in columns or not ({"id", "seq", "sequence"} & columns.keys()):
            raise UserError(f"{path}:1: header {header[:8]} needs a 'label' column and an 'id' or 'seq' column")
        col.update(columns)

    ids, labels, seqs, split, skipped = [], [], [], [], {"empty": 0, "duplicate": 0}
    first: dict[str, tuple[int, str]] = {}  # id -> (line, label)
    for r in label_rows(path, check_header):
        if r.label.lower() in MISSING or (r.seq is not None and not r.seq):
            skipped["empty"] += 1
            continue
        if repeated(first, r.id, r.label, f"{path}:{r.line}"):
            skipped["duplicate"] += 1
            continue
        ids.append(r.id)
        labels.append(r.label)
        seqs.append(r.seq)
        split.append(r.split)
    if not ids:
        raise UserError(f"{path}: no labeled rows")
    if any(skipped.values()):
        log.warning("%s: skipped %d rows without a label or sequence and %d repeated rows", path,
                    skipped["empty"], skipped["duplicate"])
    has_seq = bool({"seq", "sequence"} & col.keys())
    return Labels(ids, labels, seqs if has_seq else None, split if "split" in col else None, str(path), skipped)


def repeated(first: dict, rid: str, label, where: str, conflicts: str = "refuse") -> bool:
    """Whether protein ``rid`` (at ``where``, ``file:line``) was listed before in this file, ``first``
    holding each id's first (line, label). Listed again with another label: one line naming both
    lines (``conflicts="refuse"``, probe's and fine-tuning's classes), or, with ``conflicts="count"``
    (replicate measurements of a regression target), True like a plain repeat: the caller counts it."""
    line = where.rpartition(":")[2]
    if rid not in first:
        first[rid] = (line, label)
        return False
    old_line, old = first[rid]
    if old != label and conflicts == "refuse":
        raise UserError(f"{where}: protein {rid!r} labeled {label!r}, but {old!r} on line {old_line}; "
                        f"one label per protein")
    return True


def check_test_overlap(train: Sequence, test: Sequence, test_source) -> None:
    """Refuse a test set made of training proteins (``train``, ``test``: the proteins' keys, such as
    embedding rows or sequences), and warn with counts when only some test proteins are training
    proteins: the one rule probe and finetune share."""
    train = set(train)
    both = sum(t in train for t in test)
    if test and both == len(test):
        raise UserError(f"labels {test_source}: every test protein is also a training protein; "
                        f"the test set must hold other proteins")
    if both:
        log.warning("%d of %d test proteins of %s are also training proteins: the scores are optimistic",
                    both, len(test), test_source)


#: classification labels beyond this many distinct values that also look like measurements are refused
MAX_NUMERIC_CLASSES = 20


def check_classes(labels: Sequence, source) -> None:
    """Refuse classification labels that do not look like classes: more than
    :data:`MAX_NUMERIC_CLASSES` distinct values that are all numbers, not all whole (200 stability
    scores would make 199 classes), or more distinct values than half the proteins (nearly every
    protein a class of its own)."""
    distinct = sorted({str(x).strip() for x in labels})
    if len(distinct) <= MAX_NUMERIC_CLASSES:
        return
    try:
        values = np.array([float(x) for x in distinct])
    except ValueError:
        values = None
    numeric = values is not None and bool(np.isfinite(values).all())
    fractional = numeric and not bool(np.all(values == np.round(values)))
    if fractional or 2 * len(distinct) > len(labels):
        what = "numbers, not all whole" if fractional else "nearly one per protein"
        raise UserError(f"labels {source}: {len(distinct)} distinct labels among {len(labels)} proteins "
                        f"({what}: {', '.join(distinct[:3])}, ...) do not look like classes"
                        f"{'; for measurements use task=regression' if numeric else ''}")


def composition_features(seqs: Sequence[str]) -> np.ndarray:
    """(N, 20) frequencies of the standard amino acids (other residues count in the
    denominator only)."""
    lut = np.full(256, -1, dtype=np.int64)
    for i, aa in enumerate(STANDARD_AA):
        lut[ord(aa)] = i
    out = np.zeros((len(seqs), len(STANDARD_AA)), dtype=np.float64)
    for n, s in enumerate(seqs):
        codes = lut[np.frombuffer(s.upper().encode("latin-1", errors="replace"), dtype=np.uint8)]
        out[n] = np.bincount(codes[codes >= 0], minlength=len(STANDARD_AA)) / max(len(codes), 1)
    return out.astype(np.float32)


def detect_task(labels: Sequence[str], max_classes: int = 20) -> str:
    """'classification' for non-numeric labels or few integer values, else 'regression'."""
    try:
        values = np.array([float(x) for x in labels])
    except ValueError:
        return "classification"
    if np.all(values == np.round(values)) and len(np.unique(values)) <= max_classes:
        return "classification"
    return "regression"


# --- the probe ---------------------------------------------------------------------------
#: the logistic-regression probe's solver ("auto": :func:`.probe_solver.solver_for` at fit time;
#: benchmarks/speed/solver_timing.py times both) and its stopping tolerance (the gradient's largest entry):
#: scikit-learn's 1e-4 stops Newton-CG a few 1e-3 of a probability short of Newton-Cholesky's optimum;
#: 1e-5 reaches it on family's 640 features
SOLVER, TOL = "auto", 1e-5


def make_probe(task: str, folds: int = 5, seed: int = 0, solver: str | None = None):
    """standardize -> logistic regression (C by inner CV on log-loss; ``solver``, default
    :data:`SOLVER`) or ridge (alpha by leave-one-out)."""
    from sklearn.linear_model import RidgeCV
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from .probe_solver import ShapeSolvedLogisticRegressionCV
    if task == "classification":
        head = ShapeSolvedLogisticRegressionCV(Cs=np.logspace(-4, 2, 7),
                                               cv=StratifiedKFold(folds, shuffle=True, random_state=seed),
                                               scoring="neg_log_loss", solver=solver or SOLVER, max_iter=100,
                                               tol=TOL, l1_ratios=(0.0,), use_legacy_attributes=False)
    elif task == "regression":
        head = RidgeCV(alphas=np.logspace(-3, 5, 9))
    else:
        raise UserError(f"task must be 'classification' or 'regression', got {task!r}")
    return make_pipeline(StandardScaler(), head)


def scores(task: str, y_true: np.ndarray, y_pred: np.ndarray) -> dict:
    from sklearn.metrics import accuracy_score, f1_score, r2_score
    if task == "classification":
        return {"accuracy": float(accuracy_score(y_true, y_pred)),
                "macro_f1": float(f1_score(y_true, y_pred, average="macro", zero_division=0))}
    from scipy.stats import pearsonr, spearmanr
    const = np.ptp(y_pred) == 0
    return {"spearman": 0.0 if const else float(spearmanr(y_true, y_pred).statistic),
            "pearson": 0.0 if const else float(pearsonr(y_true, y_pred).statistic),
            "r2": float(r2_score(y_true, y_pred))}


def _chosen(pipe) -> dict:
    head = pipe[-1]
    if hasattr(head, "C_"):
        return {"C": float(np.ravel(head.C_)[0])}
    if hasattr(head, "alpha_"):
        return {"alpha": float(head.alpha_)}
    return {}


def fit_and_score(task: str, X_train, y_train, X_test=None, y_test=None, folds: int = 5, seed: int = 0) -> dict:
    """Fit and score on the test rows, or by outer K-fold CV when there are none."""
    import warnings

    from sklearn.model_selection import KFold, StratifiedKFold, cross_val_predict
    with warnings.catch_warnings():  # rare classes: said once by check_split, not once per fold by sklearn
        warnings.filterwarnings("ignore", message="The least populated class in y has only")
        if X_test is not None:
            pipe = make_probe(task, folds, seed).fit(X_train, y_train)
            return {**scores(task, y_test, pipe.predict(X_test)), **_chosen(pipe)}
        outer = (StratifiedKFold if task == "classification" else KFold)(folds, shuffle=True, random_state=seed)
        pred = cross_val_predict(make_probe(task, folds, seed), X_train, y_train, cv=outer)
    return scores(task, y_train, pred)


def chance(task: str, y_train: np.ndarray, y_test: np.ndarray) -> dict:
    """Scores of always predicting the training majority class (or mean)."""
    if task == "classification":
        vals, counts = np.unique(y_train, return_counts=True)
        return scores(task, y_test, np.full(len(y_test), vals[np.argmax(counts)], dtype=y_test.dtype))
    return {"spearman": 0.0, "pearson": 0.0, "r2": float(scores(task, y_test, np.full(len(y_test), y_train.mean()))["r2"])}


def _subsample(idx: np.ndarray, n: int | None, rng: np.random.Generator) -> np.ndarray:
    return idx if n is None or len(idx) <= n else np.sort(rng.choice(idx, n, replace=False))


def check_probe_settings(task: str, folds, max_train, max_test) -> None:
    if task not in ("auto", "classification", "regression"):
        raise UserError(f"task={task!r}: choose auto, classification or regression")
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise UserError(f"folds={folds!r}: the cross-validation's folds, an integer of 2 or more")
    for key, cap in (("max_train", max_train), ("max_test", max_test)):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise UserError(f"{key}={cap!r}: a positive number of proteins, or null for all")


def train_and_test_rows(tables: list, folds: int) -> tuple[list, str]:
    """([(table, its training rows)] + [(table, its test rows)] when there is a test set), and the protocol:
    a second labels file is the test set, else the split column's "test" rows, else cross-validation."""
    if len(tables) > 1:
        return [(t, list(range(len(t.ids)))) for t in tables[:2]], "test file"
    if tables[0].split is not None:
        sp = tables[0].split
        return [(tables[0], [i for i, s in enumerate(sp) if s != "test"]),
                (tables[0], [i for i, s in enumerate(sp) if s == "test"])], "split column"
    return [(tables[0], list(range(len(tables[0].ids))))], f"{folds}-fold cross-validation"


def run_probe(embeddings: str | Sequence[str], labels: str, test_labels: str | None = None, *, task: str = "auto",
              pooling: str = "mean", layer: int | None = None, folds: int = 5, seed: int = 0,
              baseline: bool = True, shuffle_control: bool = True, max_train: int | None = None,
              max_test: int | None = None) -> dict:
    """The probe experiment; returns a JSON-ready dict of scores and counts."""
    check_probe_settings(task, folds, max_train, max_test)
    ids, X = load_embeddings(embeddings, pooling, layer)
    row = {rid: i for i, rid in enumerate(ids)}
    tables = [read_labels(labels)] + ([read_labels(test_labels)] if test_labels else [])
    if task == "auto":
        task = detect_task([lab for t in tables for lab in t.labels])
    for t in tables:
        if task == "regression":
            check_values(t)
        else:
            check_classes(t.labels, t.source)
    rng = np.random.default_rng(seed)

    def gather(t: Labels, which: list[int]):
        keep = [i for i in which if t.ids[i] in row]
        y = np.array(t.labels, dtype=object) if task == "classification" else np.array(t.labels, dtype=np.float64)
        y = y[keep].astype(str) if task == "classification" else y[keep]
        seqs = [t.seqs[i] for i in keep] if t.seqs is not None else None
        return np.array([row[t.ids[i]] for i in keep], dtype=np.int64), y, seqs, len(which) - len(keep)

    parts, protocol = train_and_test_rows(tables, folds)
    gathered = [gather(t, w) for t, w in parts]
    missing = sum(g[3] for g in gathered)
    if missing:
        log.warning("%d labeled rows have no embedding in %s (skipped)", missing, embeddings)
    if any(len(g[0]) == 0 for g in gathered):
        raise UserError(f"no labeled rows of {labels} match ids in {embeddings} "
                         f"(CSV rows without an id column are matched by sequence_id(seq))")
    check_split(gathered, task, labels, test_labels or labels, folds)
    # subsample (seeded) and build features
    caps = [max_train, max_test]
    feats = []
    for k, (rows_k, y, seqs, _) in enumerate(gathered):
        sel = _subsample(np.arange(len(y)), caps[k], rng)
        feats.append((X[rows_k[sel]], y[sel], [seqs[i] for i in sel] if seqs is not None else None))
    Xtr, ytr, str_ = feats[0]
    Xte, yte, ste = feats[1] if len(feats) > 1 else (None, None, None)
    result: dict = {"task": task, "protocol": protocol, "embeddings": embeddings if isinstance(embeddings, str)
                    else list(embeddings), "labels": labels, "test_labels": test_labels, "pooling": pooling,
                    "layer": layer, "n_train": int(len(ytr)), "n_test": int(len(yte)) if yte is not None else None,
                    "dim": int(X.shape[1]), "missing_embeddings": int(missing),
                    "skipped_rows": {k: sum(t.skipped[k] for t in tables) for k in tables[0].skipped}}
    if task == "classification":
        vals, counts = np.unique(ytr, return_counts=True)
        result["classes"] = {str(v): int(c) for v, c in zip(vals, counts)}
    n_fits = 1 + bool(baseline and str_ is not None) + bool(shuffle_control)

    def fit(name: str, X_tr, y_tr, X_te) -> dict:  # a line per fitted probe: the slow part
        log.info("probe %d/%d (%s): %d x %d, %s", len(fitted) + 1, n_fits, name, X_tr.shape[0], X_tr.shape[1],
                 protocol)
        t = time.perf_counter()
        try:
            fitted.append(fit_and_score(task, X_tr, y_tr, X_te, yte, folds, seed))
        except UserError:
            raise
        except ValueError as e:  # scikit-learn refusing these labels (too few of a class for the folds, ...)
            raise UserError(f"labels {labels}: the {name} probe cannot be fitted on these labels "
                            f"({first_line(e)})") from e
        log.info("probe %d/%d (%s): done in %.1f s", len(fitted), n_fits, name, time.perf_counter() - t)
        return fitted[-1]

    fitted: list = []
    result["embedding"] = fit("embedding", Xtr, ytr, Xte)
    if baseline:
        if str_ is None:
            result["composition"] = {"skipped": "labels have no seq column"}
        else:
            result["composition"] = fit("composition", composition_features(str_), ytr,
                                        composition_features(ste) if ste is not None else None)
    y_ref = yte if yte is not None else ytr
    result["chance"] = chance(task, ytr, y_ref)
    if shuffle_control:
        result["shuffled_labels"] = fit("shuffled labels", Xtr, rng.permutation(ytr), Xte)
    return result


def check_values(t: Labels) -> None:
    """Regression labels are finite numbers: one line naming the first protein whose label is not."""
    for rid, label in zip(t.ids, t.labels):
        try:
            value = float(label)
        except ValueError:
            raise UserError(f"labels {t.source}: protein {rid!r}: label {label!r} is not a number "
                            f"(task=regression)") from None
        if not np.isfinite(value):
            raise UserError(f"labels {t.source}: protein {rid!r}: label {label!r} is not a finite number")


def check_split(gathered: list, task: str, train_source, test_source, folds: int = 5) -> None:
    """Refuse what no probe can score honestly: a training set of one class, a regression
    target that never varies, fewer training proteins than folds or classes too small for
    the stratified folds, a test set made of training proteins (a warning when only some are)."""
    y = gathered[0][1]
    if len(np.unique(y)) < 2:
        what = "classes" if task == "classification" else "values"
        raise UserError(f"labels {train_source}: every training protein has the same label '{y[0]}'; "
                        f"a probe needs at least two {what}")
    # the regularization is chosen by an inner folds-fold CV on the training proteins (within the
    # outer folds' training part when there is no test split): each class needs a member in each
    need = folds if len(gathered) > 1 else folds + 1
    if len(y) < need:
        raise UserError(f"labels {train_source}: {len(y)} training proteins; the probe's {folds}-fold "
                        f"cross-validation needs at least {need} (lower folds=, or label more proteins)")
    if task == "classification":
        vals, counts = np.unique(y, return_counts=True)
        if counts.max() < need:
            raise UserError(f"labels {train_source}: no class has {need} training proteins (the largest, "
                            f"{str(vals[np.argmax(counts)])!r}, has {counts.max()}); the probe's {folds}-fold "
                            f"stratified cross-validation needs that many (lower folds=, or label more proteins)")
        rare = [f"{str(v)!r} ({c})" for v, c in zip(vals, counts) if c < need]  # 'c', not np.str_('c')
        if rare:
            log.warning("classes with fewer than %d training proteins, the least the probe's %d-fold "
                        "cross-validation needs: %s; their scores are unreliable", need, folds,
                        ", ".join(rare[:5]) + (", ..." if len(rare) > 5 else ""))
    if len(gathered) < 2:
        return
    check_test_overlap(gathered[0][0].tolist(), gathered[1][0].tolist(), test_source)


def format_result(r: dict) -> str:
    """A few human lines for the console."""
    keys = ["accuracy", "macro_f1"] if r["task"] == "classification" else ["spearman", "pearson", "r2"]
    lines = [f"{r['task']} probe, {r['protocol']}: {r['n_train']} train" +
             (f" / {r['n_test']} test" if r["n_test"] else "") + f" proteins, dim {r['dim']}"]
    for name in ("embedding", "composition", "shuffled_labels", "chance"):
        if name in r and "skipped" not in r[name]:
            lines.append(f"  {name:16s} " + "  ".join(f"{k} {r[name][k]:.3f}" for k in keys))
    return "\n".join(lines)

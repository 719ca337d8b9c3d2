"""Zero-shot variant effects: score ProteinGym-style substitution CSVs with a trained model.

Why: users of protein language models rank mutants by the model's log-probabilities (ESM's
``variant-prediction`` example, ProteinGym's zero-shot track). ESM cuts proteins to 1,022
residues; here the whole protein is the context at any length, no windows.

Strategies (one score column each; higher = more like the wild type or better):

* ``masked_marginal`` (masked LM, default): one forward per distinct mutated position of the
  assay with that position masked; a mutant scores sum over its substitutions of
  log p(mt) - log p(wt) read at the masked position.
* ``wt_marginal`` (masked LM): the same differences read from one forward of the unmasked
  wild type.
* ``pll`` (masked LM, opt-in; one forward per position per sequence): pseudo-log-likelihood
  of the mutant minus that of the wild type.
* ``log_likelihood_ratio`` (causal LM, default there): log p(mutant) - log p(wild type),
  residues given the ones before them (not ``<eos>``), as the project's scoring core
  (:func:`protein_performer.objectives.scored_example`) defines a protein's likelihood. The
  wild type runs once in RNN mode; each group of mutants branches from its state at the
  group's first mutated position, so the shared prefix is computed once.

Every input file is read and every mutant checked before the model runs; outputs are
written whole (:mod:`protein_performer.files`) and never over an input.
"""
from __future__ import annotations

import contextlib
import csv
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .data.sampler import MAX_TOKENS, token_budget_batches
from .device import precision_dtype
from .errors import UserError
from .files import write_json, write_text
from .output_guard import OutputGuard
from .hub.load import load_model
from .data.buckets import check_buckets
from .data.collate import pad_batch
from .sequences import read_sequences
from .formats import ParseError, check_source
from .formats.text import open_text
from .sequences import MAX_MESSAGES
from .tokenizer import AMINO_ACIDS, STANDARD_AA, Tokenizer

log = logging.getLogger(__name__)

#: strategy -> the objective it needs
STRATEGIES = {"masked_marginal": "mlm", "wt_marginal": "mlm", "pll": "mlm", "log_likelihood_ratio": "clm"}
DEFAULT = {"mlm": "masked_marginal", "clm": "log_likelihood_ratio"}
SUBSTITUTION = re.compile(r"([A-Z])(-?\d+)([A-Z])")


# --- reading assays --------------------------------------------------------------------
def parse_mutant(text: str, wild_type: str, offset: int = 1) -> tuple[tuple[int, str, str], ...]:
    """``A24G:C30W`` -> ((index into wild_type, wt, mt), ...); ``offset`` is the number of the
    sequence's first residue (ESM's ``--offset-idx``). Raises UserError saying what is wrong."""
    subs, seen = [], set()
    for part in text.strip().split(":"):
        m = SUBSTITUTION.fullmatch(part.strip())
        if not m:
            raise UserError(f"malformed substitution {part!r} (expected e.g. A24G, several joined by ':')")
        wt, pos, mt = m.group(1), int(m.group(2)), m.group(3)
        i = pos - offset
        if not 0 <= i < len(wild_type):
            raise UserError(f"position {pos} is outside the wild type (residues {offset}..{offset + len(wild_type) - 1}"
                            f" with offset={offset})")
        if wild_type[i] != wt:
            raise UserError(f"the wild type has {wild_type[i]!r} at position {pos}, not {wt!r}")
        if mt not in STANDARD_AA:
            rare = " (X, B, Z, U and O: unknown, ambiguous or rare residues no score covers)" if mt in AMINO_ACIDS else ""
            raise UserError(f"{mt!r} is not one of the 20 standard amino acids{rare}")
        if i in seen:
            raise UserError(f"position {pos} is mutated twice")
        seen.add(i)
        subs.append((i, wt, mt))
    return tuple(sorted(subs))


def apply_mutant(wild_type: str, subs) -> str:
    seq = list(wild_type)
    for i, _, mt in subs:
        seq[i] = mt
    return "".join(seq)


def _float(text: str | None) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


@dataclass
class Assay:
    """One substitution CSV: its rows as read, each row's substitutions (None where skipped)
    and the wild type."""

    path: Path
    wild_type: str
    header: list[str]
    rows: list[list[str]]
    mutants: list[tuple | None]
    skipped: int = 0
    scores: dict = field(default_factory=dict)  # strategy -> (rows,) float64, NaN where skipped

    @property
    def name(self) -> str:
        return self.path.name

    def column(self, name: str) -> np.ndarray | None:
        if name not in self.header:
            return None
        j = self.header.index(name)
        return np.array([_float(r[j]) for r in self.rows])


def read_assay(path: str | Path, wild_type: str, offset: int = 1, on_invalid: str = "error") -> Assay:
    """Read and check a substitution CSV against ``wild_type`` (already cleaned): a malformed
    mutant, an out-of-range position, a wild-type residue that does not match or a
    ``mutated_sequence`` that is not the mutant applied is an error naming file, line and
    mutant, or with ``on_invalid="skip"`` a counted skip."""
    if on_invalid not in ("error", "skip"):
        raise UserError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    path = Path(path)
    check_source(path)
    with open_text(path) as fh:
        reader = csv.reader(fh, strict=True)
        try:
            header = next(reader, [])
            if "mutant" not in header:
                raise ParseError(f"{path}:1: the header {header[:8]} has no 'mutant' column")
            mcol = header.index("mutant")
            scol = header.index("mutated_sequence") if "mutated_sequence" in header else None
            rows, mutants, skipped = [], [], 0
            for row in reader:
                if not row:
                    continue
                line = reader.line_num
                if len(row) != len(header):
                    raise ParseError(f"{path}:{line}: expected {len(header)} columns, got {len(row)}")
                text = row[mcol]
                try:
                    subs = parse_mutant(text, wild_type, offset)
                    if scol is not None and row[scol].strip():
                        given = "".join(row[scol].split()).upper()
                        if given != apply_mutant(wild_type, subs):
                            raise UserError("mutated_sequence is not the wild type with this mutant applied")
                except UserError as e:
                    msg = f"{path}:{line}: mutant {text!r}: {e}"
                    if on_invalid == "error":
                        raise UserError(msg + " (on_invalid=skip skips such rows)") from None
                    if skipped < MAX_MESSAGES:
                        log.warning("skipped: %s", msg)
                    skipped += 1
                    subs = None
                rows.append(row)
                mutants.append(subs)
        except csv.Error as e:
            raise ParseError(f"{path}:{reader.line_num}: not a readable CSV file ({e})") from None
    if not any(m is not None for m in mutants):
        raise UserError(f"{path}: no mutant to score ({len(rows)} rows, {skipped} skipped)")
    return Assay(path, wild_type, header, rows, mutants, skipped)


def _clean(seq: str, tokenizer: Tokenizer, where: str) -> str:
    return tokenizer.clean(seq, source=where, record="wild type")


def wild_type_of(sequence: str | None, sequence_file: str | None, tokenizer: Tokenizer) -> str:
    """The wild type from ``sequence=`` or the one record of ``sequence_file=``."""
    if (sequence is None) == (sequence_file is None):
        raise UserError("give the wild type with exactly one of sequence=RESIDUES or sequence_file=FASTA")
    if sequence is not None:
        seq = _clean(str(sequence), tokenizer, "sequence")
        if not seq:
            raise UserError("sequence: is empty")
        return seq
    entries = list(read_sequences(sequence_file, tokenizer=tokenizer))
    if len(entries) != 1:
        raise UserError(f"sequence_file={sequence_file}: expected one wild-type record, found {len(entries)}")
    return _clean(entries[0].sequence, tokenizer, str(sequence_file))


def reference_wild_types(reference: str | Path, tokenizer: Tokenizer) -> dict[str, str]:
    """ProteinGym's reference file: ``DMS_filename`` and/or ``DMS_id`` -> ``target_seq``."""
    reference = Path(reference)
    check_source(reference, "reference")
    out: dict[str, str] = {}
    with open_text(reference) as fh:
        reader = csv.DictReader(fh)
        names = [c for c in ("DMS_filename", "DMS_id") if c in (reader.fieldnames or [])]
        if not names or "target_seq" not in reader.fieldnames:
            raise ParseError(f"reference={reference}:1: needs a target_seq column and DMS_filename or DMS_id "
                             f"(ProteinGym's reference file), has {(reader.fieldnames or [])[:8]}")
        for row in reader:
            where = f"{reference}:{reader.line_num}"
            seq = _clean(row["target_seq"] or "", tokenizer, where)
            if not seq:
                raise ParseError(f"{where}: empty target_seq")
            for c in names:
                if row[c]:
                    key = row[c] if c == "DMS_filename" else f"{row[c]}.csv"
                    out[key] = seq
    return out


def read_assays(input: str | Path, sequence=None, sequence_file=None, reference=None, offset: int = 1,
                on_invalid: str = "error", tokenizer: Tokenizer | None = None) -> list[Assay]:
    """One CSV with its wild type, or every ``*.csv`` of a folder with ``reference``."""
    tokenizer = tokenizer or Tokenizer()
    input = Path(input)
    if not input.is_dir():
        if reference is not None:
            raise UserError(f"reference= names the wild types of a folder of assays; input={input} is a file "
                            f"(give sequence= or sequence_file=)")
        return [read_assay(input, wild_type_of(sequence, sequence_file, tokenizer), offset, on_invalid)]
    if reference is None or sequence is not None or sequence_file is not None:
        raise UserError(f"input={input} is a folder: give reference=CSV (DMS_id or DMS_filename, target_seq) "
                        f"for its wild types, not sequence= / sequence_file=")
    wild_types = reference_wild_types(reference, tokenizer)
    ref = Path(reference).resolve()
    files = sorted(p for p in input.iterdir() if p.suffix.lower() == ".csv" and p.resolve() != ref)
    if not files:
        raise UserError(f"input={input}: no .csv files")
    missing = [p.name for p in files if p.name not in wild_types]
    if missing:
        raise UserError(f"reference={reference}: no wild type for {missing[0]}"
                        + (f" and {len(missing) - 1} other files" if len(missing) > 1 else ""))
    return [read_assay(p, wild_types[p.name], offset, on_invalid) for p in files]


# --- the model ---------------------------------------------------------------------------
class Scorer:
    """Log-probabilities from a loaded model: masked copies under a token budget, one
    unmasked forward, and the causal ratio in RNN mode."""

    def __init__(self, loaded, max_tokens: int = MAX_TOKENS, rnn_batch: int = 256, precision: str = "32",
                 buckets=None):
        self.net, self.tokenizer, self.kernel = loaded.net, loaded.tokenizer, loaded.kernel
        self.buckets = buckets  # masked copies padded to these lengths (data/buckets.py; None: not padded)
        self.max_tokens, self.rnn_batch = int(max_tokens), int(rnn_batch)
        self.device = next(self.net.parameters()).device
        self.dtype = precision_dtype(precision)

    def ids(self, seq: str) -> np.ndarray:
        return self.tokenizer.encode(seq).astype(np.int64)

    def aa_id(self, aa: str) -> int:
        return self.tokenizer.aa_id(aa)

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @torch.inference_mode()
    def logprobs(self, tokens: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) tokens (padding after the protein where ``padding`` says) -> (B, L, V) float64
        log-probabilities."""
        with self._autocast():
            logits = self.net(tokens.to(self.device), None if padding is None else padding.to(self.device))
        return torch.log_softmax(logits.double(), -1)

    def masked(self, tokens: np.ndarray, positions: Sequence[int]) -> np.ndarray:
        """(len(positions), V) log-probabilities at each position of ``tokens`` with that
        position (alone) masked; the masked copies are batched under the token budget."""
        out = np.empty((len(positions), self.tokenizer.vocab_size))
        for batch in token_budget_batches([len(tokens)] * len(positions), self.max_tokens, buckets=self.buckets):
            x, padding = pad_batch([tokens] * len(batch), self.tokenizer.pad_id, self.buckets)  # None: no bucket
            pos = torch.tensor([positions[i] for i in batch])
            rows = torch.arange(len(batch))
            x[rows, pos] = self.tokenizer.mask_id
            out[batch] = self.logprobs(x, padding)[rows.to(self.device), pos.to(self.device)].cpu().numpy()
        return out

    def pll(self, tokens: np.ndarray) -> float:
        """Pseudo-log-likelihood: sum over residues of log p(residue | the rest, it masked)."""
        positions = list(range(1, len(tokens) - 1))
        lp = self.masked(tokens, positions)
        return float(lp[np.arange(len(positions)), tokens[positions]].sum())

    def _rows(self, length: int) -> int:
        """Mutants stepped together in RNN mode: exact attention's KV cache grows with length."""
        if self.kernel == "exact":
            return max(1, min(self.rnn_batch, self.max_tokens // length))
        return self.rnn_batch

    @torch.inference_mode()
    def log_likelihood_ratio(self, wild_type: np.ndarray, mutants: list[list[tuple[int, int]]]) -> np.ndarray:
        """log p(mutant) - log p(wild type) for each mutant (a list of (token index, id)).

        The wild type is stepped once; mutants, sorted by first mutated position, go in groups
        that start from the wild type's state just before their group's first mutated
        position and run their remaining tokens in one chunked call from it (a row whose own first mutation comes later feeds wild-type tokens until it,
        which is exact: its context there is the wild type's)."""
        net, L = self.net, len(wild_type)
        T = torch.as_tensor(wild_type, device=self.device)
        first = np.array([min(p for p, _ in m) for m in mutants])
        order = np.argsort(first, kind="stable")
        rows = self._rows(L)
        groups = [order[a:a + rows] for a in range(0, len(order), rows)]
        mut_sum = np.zeros(len(mutants))  # log p(mutant[j]) summed over j >= start (its group's branch point)
        start = np.zeros(len(mutants), dtype=np.int64)
        wt_lp = np.zeros(L)  # wt_lp[j] = log p(T[j] | T[:j]), j = 1 .. L-2 (residues, not <eos>)
        state, g = net.init_state(1, self.device), 0
        with self._autocast():
            for t in range(L - 2):  # step t reads T[t] and predicts T[t + 1]
                logits, state = net.step(T[t:t + 1], state)
                lp = torch.log_softmax(logits[0].double(), -1)
                wt_lp[t + 1] = float(lp[T[t + 1]])
                while g < len(groups) and first[groups[g][0]] == t + 1:
                    group, g = groups[g], g + 1
                    M = T.repeat(len(group), 1)
                    for r, m in enumerate(group):
                        for p, tok in mutants[m]:
                            M[r, p] = tok
                    acc = lp[M[:, t + 1]]
                    if t + 1 < L - 2:  # the rest of each mutant in one chunked call from the branch state
                        logits_m, _ = net.step(M[:, t + 1:L - 2], _expand(state, len(group)))
                        lp_m = torch.log_softmax(logits_m.double(), -1)          # (rows, L - 3 - t, V)
                        acc = acc + lp_m.gather(2, M[:, t + 2:L - 1, None])[..., 0].sum(1)
                    mut_sum[group], start[group] = acc.cpu().numpy(), t + 1
        wt_suffix = np.cumsum(wt_lp[::-1])[::-1]  # wt_suffix[p] = sum over j >= p
        return mut_sum - wt_suffix[start]


def _expand(state: Any, n: int) -> Any:
    """A batch-1 decoding state seen as ``n`` identical rows (views; steps make new tensors)."""
    if isinstance(state, torch.Tensor):
        return state.expand(n, *state.shape[1:])
    if isinstance(state, dict):
        return {k: _expand(v, n) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_expand(v, n) for v in state)
    return state


def distinct_mutants(assay: Assay) -> int:
    """How many distinct mutants :func:`score_assay` computes (per strategy)."""
    return len({m for m in assay.mutants if m is not None})


def score_assay(scorer: Scorer, assay: Assay, strategies: Sequence[str], progress=None) -> dict[str, np.ndarray]:
    """strategy -> (rows,) scores, NaN at skipped rows; identical mutants computed once.
    ``progress``: called with the number of mutant scores computed (``ProgressLines.update``)."""
    wt = scorer.ids(assay.wild_type)
    distinct = sorted({m for m in assay.mutants if m is not None})
    where = {m: k for k, m in enumerate(distinct)}
    subs = [[(i + 1, scorer.aa_id(mt), int(wt[i + 1])) for i, _, mt in m] for m in distinct]  # token indices
    out = {}
    for strategy in strategies:
        if strategy in ("masked_marginal", "wt_marginal"):
            if strategy == "masked_marginal":  # row k: log-probabilities at positions[k], masked
                positions = sorted({p for s in subs for p, _, _ in s})
                lp, row = scorer.masked(wt, positions), {p: k for k, p in enumerate(positions)}.__getitem__
            else:  # row p: log-probabilities at token p of the unmasked wild type
                lp, row = scorer.logprobs(torch.as_tensor(wt)[None])[0].cpu().numpy(), int
            values = [sum(lp[row(p), mt] - lp[row(p), w] for p, mt, w in s) for s in subs]
        elif strategy == "pll":
            base = scorer.pll(wt)
            values = []
            for s in subs:
                mut = wt.copy()
                for p, mt, _ in s:
                    mut[p] = mt
                values.append(scorer.pll(mut) - base)
                if progress is not None:
                    progress(1)
        else:
            values = scorer.log_likelihood_ratio(wt, [[(p, mt) for p, mt, _ in s] for s in subs])
        if progress is not None and strategy != "pll":
            progress(len(subs))
        values = np.asarray(values, dtype=np.float64)
        out[strategy] = np.array([values[where[m]] if m is not None else math.nan for m in assay.mutants])
    return out


# --- metrics ---------------------------------------------------------------------------
def spearman(x, y) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None if either side is constant."""
    from scipy.stats import spearmanr
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(spearmanr(x, y).statistic)


def ndcg(y_true, y_score, top: float = 10.0) -> float | None:
    """NDCG of the top ``top`` % as ProteinGym computes it (``calc_ndcg``): gains are the
    min-max scaled DMS scores, the top k = floor(n * top / 100) by predicted score count."""
    y_true, y_score = np.asarray(y_true, float), np.asarray(y_score, float)
    k = int(np.floor(len(y_true) * top / 100))
    if k < 1 or np.ptp(y_true) == 0:
        return None
    gains = (y_true - y_true.min()) / np.ptp(y_true)

    def dcg(order_by):
        ranks = np.argsort(np.argsort(-order_by, kind="stable"), kind="stable") + 1
        keep = ranks <= k
        return float(np.sum(gains[keep] / np.log2(ranks[keep] + 1)))

    return dcg(y_score) / dcg(gains)


def auc(y_bin, y_score) -> float | None:
    from sklearn.metrics import roc_auc_score
    y_bin = np.asarray(y_bin, float)
    if len(np.unique(y_bin)) != 2:
        return None
    return float(roc_auc_score(y_bin, y_score))


def assay_metrics(assay: Assay) -> dict | None:
    """Per strategy Spearman / NDCG (DMS_score) and AUC (DMS_score_bin) over scored rows."""
    dms = assay.column("DMS_score")
    if dms is None:
        return None
    bins = assay.column("DMS_score_bin")
    out = {}
    for strategy, s in assay.scores.items():
        ok = ~np.isnan(s) & ~np.isnan(dms)
        out[strategy] = {"spearman": spearman(s[ok], dms[ok]), "ndcg": ndcg(dms[ok], s[ok]), "auc": None,
                         "n": int(ok.sum())}
        if bins is not None:
            okb = ok & ~np.isnan(bins)
            out[strategy]["auc"] = auc(bins[okb], s[okb])
    return out


def average(per_assay: dict[str, dict | None]) -> dict:
    """strategy -> mean of each metric over the assays that have it (and how many)."""
    out: dict = {}
    for metrics in per_assay.values():
        for strategy, m in (metrics or {}).items():
            for key in ("spearman", "ndcg", "auc"):
                if m[key] is not None:
                    out.setdefault(strategy, {}).setdefault(key, []).append(m[key])
    return {s: {k: float(np.mean(v)) for k, v in d.items()} | {"assays": max(map(len, d.values()))}
            for s, d in out.items()}


# --- the command -------------------------------------------------------------------------
def resolve_strategies(strategies, causal: bool, source: str) -> list[str]:
    objective = "clm" if causal else "mlm"
    if strategies is None:
        return [DEFAULT[objective]]
    strategies = [strategies] if isinstance(strategies, str) else list(strategies)
    for s in strategies:
        if s not in STRATEGIES:
            raise UserError(f"strategies: {s!r} is not one of {', '.join(STRATEGIES)}")
        if STRATEGIES[s] != objective:
            kind = "a causal (clm)" if causal else "a masked (mlm)"
            fits = ", ".join(k for k, v in STRATEGIES.items() if v == objective)
            raise UserError(f"strategies: {s} needs a {STRATEGIES[s]} model; {source} is {kind} model "
                            f"(use {fits})")
    if not strategies:
        raise UserError(f"strategies: empty list (choose from {', '.join(STRATEGIES)})")
    return list(dict.fromkeys(strategies))


def output_paths(input: Path, output: Path, assays: list[Assay]) -> tuple[list[Path], Path]:
    """Where each scored CSV and the metrics JSON go: ``output`` itself and
    ``<output stem>.metrics.json`` beside it, or, for a folder of assays, ``output/<file>``
    and ``output/metrics.json``."""
    if input.is_dir():
        if output.exists() and not output.is_dir():
            raise UserError(f"output={output}: input is a folder, so output must be a folder (it is a file)")
        return [output / a.name for a in assays], output / "metrics.json"
    if output.is_dir():
        raise UserError(f"output={output}: is a directory; give the scored CSV's path")
    return [output], output.with_name(f"{output.stem}.metrics.json")


def score_files(ckpt: Any, input: str, output: str, sequence: str | None = None,
                sequence_file: str | None = None, reference: str | None = None, offset: int = 1,
                strategies=None, on_invalid: str = "error", overwrite: bool = False, max_tokens: int = MAX_TOKENS,
                rnn_batch: int = 256, device: str = "auto", precision: str = "32", buckets=None) -> dict:
    """Score every assay, write the scored CSVs and the metrics JSON; returns the summary.  ``buckets``:
    masked copies padded to these lengths (a list, auto or None; data/buckets.py): the same scores."""
    input_p, output_p = Path(input), Path(output)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise UserError(f"offset={offset!r}: the number of the wild type's first residue, an integer (1 by default)")
    assays = read_assays(input_p, sequence, sequence_file, reference, offset, on_invalid)
    buckets = check_buckets(buckets, max(len(a.wild_type) for a in assays) + 2, "buckets")  # + <cls>, <eos>
    outs, metrics_path = output_paths(input_p, output_p, assays)
    # the output guard: no output is, holds or lies inside an input (the checkpoint or export
    # directory too), none leaves the output folder, an existing one is replaced only with overwrite
    guard = OutputGuard("score", {**{f"input {a.name}" if input_p.is_dir() else "input": a.path for a in assays},
                                  **({"input": input_p} if input_p.is_dir() else {}),
                                  "reference": reference, "sequence_file": sequence_file,
                                  "ckpt": ckpt if isinstance(ckpt, (str, Path)) else None}, overwrite=overwrite)
    if input_p.is_dir():
        guard.folder_path("output", output_p, holds=False)
        outs = [guard.child(output_p, a.name, f"input file {a.name}", "output") for a in assays]
    else:
        guard.overlap("output", output_p)
    for key, p in [*((f"output {o.name}" if input_p.is_dir() else "output", o) for o in outs),
                   ("metrics JSON", metrics_path)]:
        guard.file(key, p)
    guard.sweep()
    loaded = load_model(ckpt, device)
    strategies = resolve_strategies(strategies, loaded.causal, loaded.source)
    scorer = Scorer(loaded, max_tokens, rnn_batch, precision, buckets)
    start = time.perf_counter()
    lines = _progress_lines(sum(distinct_mutants(a) for a in assays) * len(strategies))
    for assay in assays:
        t0 = time.perf_counter()
        assay.scores = score_assay(scorer, assay, strategies, None if lines is None else lines.update)
        n = len(assay.rows) - assay.skipped
        log.info("%s: %d mutants scored in %.1f s", assay.name, n, time.perf_counter() - t0)
    if lines is not None:
        lines.close()
    seconds = time.perf_counter() - start
    per_assay = {a.name: assay_metrics(a) for a in assays}
    summary = {"ckpt": str(loaded.source), "strategies": strategies, "seconds": round(seconds, 3),
               "assays": {a.name: {"length": len(a.wild_type), "rows": len(a.rows),
                                   "scored": len(a.rows) - a.skipped, "skipped": a.skipped,
                                   "output": str(o), "metrics": per_assay[a.name]}
                          for a, o in zip(assays, outs)},
               "average": average(per_assay), "metrics_file": str(metrics_path)}
    for assay, out in zip(assays, outs):
        write_text(out, scored_csv(assay, strategies))
    write_json(metrics_path, summary)
    return summary


def _progress_lines(total: int):
    """Progress lines when stdout is not a terminal (a log file): one every 50 scoring calls or
    30 s, counting mutant scores (distinct mutants x strategies); on a terminal, none (as before)."""
    import sys

    from .training.progress import ProgressLines, is_terminal
    if is_terminal(sys.stdout):
        return None
    return ProgressLines("score", total, unit="mutant scores", rate_unit="mutants/s")


def scored_csv(assay: Assay, strategies: Sequence[str]) -> str:
    """The input rows as read, one column per strategy (replaced if the input had it;
    empty at skipped rows)."""
    import io
    header = list(assay.header)
    cols = []
    for s in strategies:
        if s not in header:
            header.append(s)
        cols.append(header.index(s))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    for k, row in enumerate(assay.rows):
        row = row + [""] * (len(header) - len(row))
        for s, j in zip(strategies, cols):
            v = assay.scores[s][k]
            row[j] = "" if math.isnan(v) else repr(float(v))
        w.writerow(row)
    return buf.getvalue()


def format_summary(summary: dict) -> str:
    """Per assay: mutants scored and skipped, each strategy's figures; then the averages."""
    def figures(m: dict) -> str:
        return ", ".join(f"{k} {m[k]:.3f}" for k in ("spearman", "ndcg", "auc") if m.get(k) is not None) or "no metric"
    lines = []
    for name, a in summary["assays"].items():
        head = f"{name}: {a['scored']:,} mutants scored" + (f", {a['skipped']:,} skipped" if a["skipped"] else "")
        if a["metrics"]:
            head += "; " + "; ".join(f"{s}: {figures(m)}" for s, m in a["metrics"].items())
        lines.append(head)
    for s, m in summary["average"].items():
        lines.append(f"average over {m['assays']} assays, {s}: {figures(m)}")
    lines.append(f"scored in {summary['seconds']:.1f} s; wrote " + ", ".join(a["output"] for a in summary["assays"].values())
                 + f", {summary['metrics_file']}")
    return "\n".join(lines)

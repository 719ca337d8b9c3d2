"""Why a model loses on the longest proteins: the same checkpoint evaluated three ways.

    python benchmarks/quality/long_context.py --ckpt NAME=RUN/checkpoints/last.ckpt [--ckpt ...] [--doc docs/long_proteins.md]

On the held-out proteins longer than ``--min-length`` residues (and, for reference, those of
half that length up to it), masked-LM perplexity (``evaluate``'s scoring, seed 0) of each
checkpoint:

* whole: the protein in one piece (what ``evaluate`` does for linear kernels);
* windows of W tokens, W / 2 apart, each residue scored in its most central window (what
  ``evaluate`` does for exact softmax above 4,096): if windows score better than the whole
  protein, the model is hurt, not helped, by the far context;
* whole, with the rotary base changed at evaluation (the weights untouched): if slower
  rotations score better, the far positions' rotary phases, rarely seen in training, are what
  hurts.

The table is printed and, with ``--doc``, put between this script's markers in that doc.

``--per-protein`` (two checkpoints A, B): each protein longer than ``--min-length`` scored alone
(the same masks), A's perplexity against B's, and how much the protein repeats itself (zlib's
compressed bytes per residue: repeats compress); prints the table, the pooled gap with a paired
bootstrap interval over proteins, and the correlation of the gap with that size. Where a kernel
loses a bucket, this says whether a few proteins, and which kind, hold it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

HELDOUT = common.ROOT / "data" / "heldout" / "uniprotkb_mix_heldout_2k.fasta.gz"
START, END = "<!-- benchmarks/quality/long_context.py: start -->", "<!-- benchmarks/quality/long_context.py: end -->"


def set_rotary_base(net, base: float) -> None:
    """Every block's rotary frequencies recomputed for ``base``, as a model built with it has them."""
    from protein_performer.attention.rotary import RotaryEmbedding
    for m in net.modules():
        if isinstance(m, RotaryEmbedding):
            m.inv_freq = RotaryEmbedding(m.dim, base).inv_freq


def perplexity(loaded, sequences, window: int | None) -> float:
    """``evaluate``'s perplexity; ``window``: every protein longer than it in windows (any kernel)."""
    from protein_performer import evaluate as E
    if window is None:
        return E.evaluate_model(loaded, sequences, progress=False, window=None)["perplexity"]
    whole = E._window_for
    E._window_for = lambda net, kernel, w, s: (window, window // 2, "benchmarks/quality/long_context.py")
    try:
        return E.evaluate_model(loaded, sequences, progress=False)["perplexity"]
    finally:
        E._window_for = whole


def set_gap(nll_a, nll_b, tokens, reps: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """The set's perplexity gap of A against B in % (token-weighted, as ``evaluate`` pools a bucket:
    exp(sum NLL_A / sum n) / exp(sum NLL_B / sum n) - 1), and its 95 % interval from a paired
    bootstrap over proteins: is a bucket's gap more than which proteins happen to be in it?"""
    import numpy as np
    a, b, n = (np.asarray(x, dtype=np.float64) for x in (nll_a, nll_b, tokens))
    gap = lambda idx: 100 * np.expm1((a[idx].sum(-1) - b[idx].sum(-1)) / n[idx].sum(-1))  # noqa: E731
    idx = np.random.default_rng(seed).integers(0, len(a), size=(reps, len(a)))
    low, high = np.percentile(gap(idx), [2.5, 97.5])
    return float(gap(np.arange(len(a)))), float(low), float(high)


def per_protein(names, models, records) -> list[str]:
    """Table lines: protein, length, both perplexities, the gap of the first against the second, zlib
    bytes per residue; then the set's gap with its bootstrap interval (``set_gap``), and the Pearson
    correlation of gap and compressed size."""
    import zlib

    import numpy as np

    from protein_performer import evaluate as E
    rows, gaps, sizes, nll, tokens = [], [], [], ([], []), []
    for r in records:
        scores = [E.evaluate_model(m, [r.sequence], progress=False) for m in models]
        ppl = [s["perplexity"] for s in scores]
        if scores[0]["num_tokens"] != scores[1]["num_tokens"]:
            raise SystemExit(f"{r.id}: {names[0]} scored {scores[0]['num_tokens']} tokens, {names[1]} "
                             f"{scores[1]['num_tokens']}: two checkpoints of the same objective, please")
        tokens.append(scores[0]["num_tokens"])  # the same masks: the same scored tokens in both
        for i, s in enumerate(scores):
            nll[i].append(s["loss"] * s["num_tokens"])
        gap, size = 100 * (ppl[0] / ppl[1] - 1), len(zlib.compress(r.sequence.encode(), 9)) / len(r.sequence)
        gaps.append(gap)
        sizes.append(size)
        rows.append([r.id, f"{len(r.sequence):,}", f"{ppl[0]:.3f}", f"{ppl[1]:.3f}", f"{gap:+.2f} %", f"{size:.3f}"])
        print(" | ".join(rows[-1]), flush=True)
    order = np.argsort(gaps)[::-1]
    lines = common.md_table(["protein", "length", f"{names[0]} ppl", f"{names[1]} ppl", f"{names[0]} against {names[1]}",
                             "zlib bytes / residue"], [rows[i] for i in order])
    r = float(np.corrcoef(gaps, sizes)[0, 1]) if len(gaps) > 2 else float("nan")
    behind = sum(g > 0 for g in gaps)
    pooled, low, high = set_gap(*nll, tokens)
    return lines + ["", f"{names[0]} against {names[1]} over the {len(gaps)} proteins (pooled as a length bucket): "
                        f"{pooled:+.2f} % (95 % interval {low:+.2f} to {high:+.2f} %, paired bootstrap over proteins)",
                    "", f"{names[0]} behind on {behind} of {len(gaps)} proteins; correlation of the gap with the "
                        f"compressed size: r = {r:.2f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--heldout", type=Path, default=HELDOUT)
    ap.add_argument("--min-length", type=int, default=4096)
    ap.add_argument("--windows", type=int, nargs="*", default=[4096, 2048, 1024])
    ap.add_argument("--bases", type=float, nargs="*", default=[10000, 40000, 100000])
    ap.add_argument("--doc", type=Path, help="put the table between this script's markers in that doc")
    ap.add_argument("--per-protein", action="store_true",
                    help="two --ckpt: each long protein alone, the first's perplexity against the second's "
                         "(printed; --windows and --bases are not used)")
    args = ap.parse_args()
    if args.per_protein and len(args.ckpt) != 2:
        ap.error("--per-protein compares two checkpoints: give --ckpt twice")
    if args.per_protein and args.doc:
        ap.error("--per-protein prints its table; --doc is for the windows table (it would replace it)")
    for spec in args.ckpt:
        if not spec.partition("=")[2]:
            ap.error(f"--ckpt {spec}: NAME=PATH (the label of the table's rows, then the checkpoint)")
        if not Path(spec.partition("=")[2]).exists():
            ap.error(f"--ckpt {spec}: no such checkpoint or exported directory")
    from protein_performer.formats.fasta import read_fasta
    from protein_performer.hub.load import load_model
    records = list(read_fasta(args.heldout))
    seqs = [r.sequence for r in records]
    n = args.min_length
    if args.per_protein:
        names, paths = zip(*(spec.partition("=")[::2] for spec in args.ckpt))
        lines = [f"Generated by `{common.command_line(__file__)}` at commit {common.git_commit()}: each protein of "
                 f"`{args.heldout.name}` longer than {n:,} residues scored alone (`evaluate`'s scoring, seed 0).", ""]
        lines += per_protein(names, [load_model(p) for p in paths], [r for r in records if len(r.sequence) > n])
        common.publish(lines, None, START, END)
        return
    long, mid = [s for s in seqs if len(s) > n], [s for s in seqs if n // 2 < len(s) <= n]
    head = ["model", "trained base", "evaluated as", f">{n:,} ({len(long)} proteins)",
            f"{n // 2 + 1:,}-{n:,} ({len(mid)} proteins)"]
    rows, start = [], time.perf_counter()
    for spec in args.ckpt:
        name, _, path = spec.partition("=")
        loaded = load_model(path)
        trained = float(getattr(loaded.net.config, "rotary_base", 10000.0))
        cases = [("whole", None, trained)] + [(f"windows of {w:,}", w, trained) for w in args.windows] + \
                [(f"whole, rotary base {b:,.0f}", None, b) for b in args.bases if b != trained]
        for label, window, base in cases:
            set_rotary_base(loaded.net, base)
            cells = [name, f"{trained:,.0f}", label] + [f"{perplexity(loaded, s, window):.3f}" for s in (long, mid)]
            rows.append(cells)
            print(" | ".join(cells), flush=True)
        set_rotary_base(loaded.net, trained)
    lines = [f"Generated by `{common.command_line(__file__)}` at commit {common.git_commit()} "
             f"({time.perf_counter() - start:.0f} s): held-out masked-LM perplexity (`evaluate`'s scoring, "
             f"seed 0) of the proteins of `{args.heldout.name}` longer than {n:,} residues and, for reference, "
             f"of those of {n // 2 + 1:,}-{n:,}. Windows: W tokens, W / 2 apart, each residue scored in its "
             "most central window. Rotary base: the frequencies recomputed at evaluation, weights untouched.", ""]
    lines += common.md_table(head, rows)
    common.publish(lines, args.doc, START, END)


if __name__ == "__main__":
    main()

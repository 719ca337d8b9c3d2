#!/usr/bin/env python
"""How close each attention kernel is to exact softmax attention: output error and row total
variation against a float64 reference, with the mean of the visible values as the floor every
kernel must beat.

    python benchmarks/quality/fidelity.py              # full grid (~10 min on 1 core), writes docs/fidelity.md
    python benchmarks/quality/fidelity.py --quick      # a small grid in seconds (the test runs it)
    python benchmarks/quality/fidelity.py --ckpt runs/NAME/checkpoints/last.ckpt [--ckpt ...]   # adds (b)

For each query position i of an evenly spaced sample of ``--rows`` positions (all of them when
L <= rows; the reference is quadratic only in the sample, so L = 16,384 stays linear in L):

* output error ||o_hat_i - o_i|| / ||o_i||, averaged over those rows and all heads (o = softmax(q k^T
  / sqrt(d)) v; per row, because pooled over rows the first causal positions, whose outputs are
  large and easy to get right, would dominate),
* row total variation 0.5 sum_j |a_hat_ij - p_ij|, averaged the same way (1 = disjoint),

where a_hat_ij = q'_i . k'_j / sum_j q'_i . k'_j are the kernel's own weights, written out in float64
from the feature map (naive.kernel_rows; the fast paths equal it to 1e-14, tests/test_attention*.py).
"mean" is o_hat = the plain mean of the visible values (a_hat = uniform): a kernel above it is worse
than no attention at all.  Data: (a) iid q, k ~ N(0, s) coordinate-wise, so the logits have standard
deviation s, v ~ N(0, 1); (b) with ``--ckpt``, each layer's q, k, v of a trained model on the longest
held-out proteins (data/heldout).  FAVOR++ gets its rho fitted on the data it is scored on (the
model fits it by an EMA of the training batches); Hedgehog is distilled (feature_maps.distill) on
fresh draws of the same distribution, never on the scored ones.  Random maps (FAVOR+, FAVOR++, trig,
ReLU) are averaged over ``draws`` projections (2; one projection serves all heads).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

KERNELS = ["softmax", "favor++", "trig", "relu", "elu", "hedgehog"]
LABEL = {"softmax": "FAVOR+", "favor++": "FAVOR++", "trig": "trig", "relu": "ReLU", "elu": "elu+1",
         "hedgehog": "Hedgehog", "mean": "mean of values"}
FULL = dict(features=[64, 128, 256, 512], lengths=[256, 1024, 4096, 16384], head_dims=[32, 64],
            stds=[0.5, 1.0, 2.0], rows=128, heads=4, distill_steps=150, draws=2)
QUICK = dict(features=[16, 64], lengths=[64, 256], head_dims=[16], stds=[1.0], rows=32, heads=2,
             distill_steps=40, draws=1)
RANDOM = {"softmax", "favor++", "trig", "relu"}  # maps that draw a projection: averaged over ``draws`` draws
HELDOUT = common.ROOT / "data" / "heldout" / "uniprotkb_mix_heldout_2k.fasta.gz"
DOC = common.DOCS / "fidelity.md"
CKPT_HINT = ("protein-performer train logger=csv hydra.run.dir=runs/fid_performer && protein-performer train "
             "model=transformer logger=csv hydra.run.dir=runs/fid_transformer && python benchmarks/quality/fidelity.py "
             "--ckpt runs/fid_performer/checkpoints/last.ckpt --ckpt runs/fid_transformer/checkpoints/last.ckpt")


# ----------------------------------------------------------------------------- measurement
def iid(d: int, std: float, L: int, heads: int, seed: int, rank: int | None = None):
    """q, k ~ N(0, std) per coordinate (logit std = std), v ~ N(0, 1); float64 (1, H, L, d).  With
    ``rank``: q, k Gaussian in one random rank-dimensional subspace, scaled to the same logit std (so
    |x|^2 = std sqrt(rank), 2 std at rank 4, against std sqrt(d) for iid: the regime FAVOR is made for)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, L, d, generator=g, dtype=torch.float64) for _ in range(3))
    if rank is None:
        return q * math.sqrt(std), k * math.sqrt(std), v
    basis = torch.linalg.qr(torch.randn(d, rank, generator=g, dtype=torch.float64))[0]   # (d, rank)
    scale = math.sqrt(std * math.sqrt(d / rank))       # logit var rank * scale^4 / d = std^2
    return q[..., :rank] @ basis.T * scale, k[..., :rank] @ basis.T * scale, v


def sample_rows(L: int, n: int):
    import torch
    return torch.linspace(0, L - 1, min(n, L)).round().long().unique()


def score(a, p, o_hat, o) -> dict:
    """Output error: the mean over rows (and heads) of ||o_hat_i - o_i|| / ||o_i|| (per row, so the
    first causal positions, whose outputs are large and easy, do not dominate); row total variation
    0.5 sum_j |a_ij - p_ij|, averaged the same way."""
    err = (o_hat - o).norm(dim=-1) / o.norm(dim=-1)
    return {"err": float(err.mean()), "tv": float(0.5 * (a - p).abs().sum(-1).mean())}


def average(scores: list[dict]) -> dict:
    return {key: sum(s[key] for s in scores) / len(scores) for key in scores[0]}


def make_map(kernel: str, d: int, r: int, heads: int, seed: int, fit=None, distill_steps: int = 0):
    """A float64 feature map; favor++'s rho set from ``fit`` = (q, k); hedgehog distilled on ``fit(step)``."""
    import torch

    from protein_performer.attention import build_feature_map, distill
    fm = build_feature_map(kernel, d, r, generator=torch.Generator().manual_seed(seed), heads=heads)
    if kernel == "hedgehog":
        distill(fm, lambda step: tuple(t.float() for t in fit(step)), steps=distill_steps)
    fm = fm.double()
    if kernel == "favor++":
        fm.set_rho(*fit)
    return fm


def evaluate(fm, q, k, v, rows, refs: dict) -> dict:
    """{causal: scores + share of rows whose unfloored normalizer is <= 0} of one map on one sample."""
    import torch

    from protein_performer.attention.naive import kernel_rows, kernel_scores
    out = {}
    with torch.no_grad():
        scores = kernel_scores(fm(q[:, :, rows], is_query=True), *fm(k, is_query=False))
        for causal, (p, o) in refs.items():
            floor = fm.normalizer_floor(k, causal)
            a, den = kernel_rows(scores, rows, causal, fm.normalizer_eps if floor is None else floor)
            out[causal] = {**score(a, p, a @ v, o), "nonpos": float((den <= 0).double().mean())}
    return out


def references(q, k, v, rows) -> dict:
    """{causal: (softmax weights, softmax outputs)} of the sampled rows, and the same for the mean."""
    from protein_performer.attention.naive import _visible, mean_rows, softmax_rows
    refs, means = {}, {}
    logits = (q[:, :, rows] @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    for causal in (False, True):
        p = softmax_rows(q, k, rows, causal, logits)
        refs[causal] = (p, p @ v)
        seen = _visible(rows, k.shape[-2], causal).to(p.dtype)
        uniform = (seen / seen.sum(-1, keepdim=True)).expand_as(p)
        means[causal] = score(uniform, p, mean_rows(v, rows, causal), refs[causal][1])
    return refs, means


def kernel_grid(kernels, features, head_dim):
    """(kernel, r) pairs: elu has r = head_dim only."""
    return [(kern, head_dim if kern == "elu" else r) for kern in kernels
            for r in ([head_dim] if kern == "elu" else features)]


def families(args):
    """(data name, rank, std) of (a): iid at every std, and q, k in a 4-dim subspace at logit std 1."""
    return [("iid", None, std) for std in args.stds] + [("rank4", 4, 1.0)]


def run_iid(args, emit) -> None:
    for d in args.head_dims:
        for name, rank, std in families(args):
            data = iid(d, std, max(args.lengths), args.heads, seed=0, rank=rank)
            maps = {}
            for L in args.lengths:
                q, k, v = (t[:, :, :L] for t in data)
                rows = sample_rows(L, args.rows)
                refs, means = references(q, k, v, rows)
                for causal, m in means.items():
                    emit(dict(data=name, d=d, std=std, L=L, causal=causal, kernel="mean", r=0, **m))
                for kern, r in kernel_grid(args.kernels, args.features, d):
                    draws = range(1, 1 + (args.draws if kern in RANDOM else 1))
                    if kern == "favor++":
                        fms = [make_map(kern, d, r, args.heads, seed, fit=(q, k)) for seed in draws]
                    else:  # the same maps (draws, or one fit) for every L, as in a model
                        if (kern, r) not in maps:
                            fit = lambda step: iid(d, std, 256, args.heads, 10_000 + step, rank)[:2]  # noqa: E731
                            maps[kern, r] = [make_map(kern, d, r, args.heads, seed, fit=fit,
                                                      distill_steps=args.distill_steps) for seed in draws]
                        fms = maps[kern, r]
                    runs = [evaluate(fm, q, k, v, rows, refs) for fm in fms]
                    for causal in (False, True):
                        emit(dict(data=name, d=d, std=std, L=L, causal=causal, kernel=kern, r=r,
                                  **average([run[causal] for run in runs])))
            if name != "iid":
                continue
            # q/k normalisation at a matched logit spread: every q, k rescaled to the mean norm
            L = min(1024, max(args.lengths))
            q, k, v = (t[:, :, :L] for t in data)
            qn, kn = (t / t.norm(dim=-1, keepdim=True) * t.norm(dim=-1).mean() for t in (q, k))
            rows = sample_rows(L, args.rows)
            r = 256 if 256 in args.features else args.features[-1]
            fms = [make_map("softmax", d, r, args.heads, seed) for seed in range(1, 1 + args.draws)]
            for name, (a, b) in (("raw", (q, k)), ("qk_norm", (qn, kn))):
                refs, means = references(a, b, v, rows)
                runs = [evaluate(fm, a, b, v, rows, refs) for fm in fms]
                for causal in (False, True):
                    emit(dict(data=f"qknorm:{name}", d=d, std=std, L=L, causal=causal, kernel="softmax", r=r,
                              **average([run[causal] for run in runs])))
                    emit(dict(data=f"qknorm:{name}", d=d, std=std, L=L, causal=causal, kernel="mean", r=0,
                              **means[causal]))


def checkpoint_qkv(path: str, proteins: int, max_len: int):
    """Per layer, (q, k, v) (P, H, L, d) float64 of a checkpoint on the ``proteins`` longest held-out
    proteins, cropped to max_len (the rotary-embedded q, k the kernel sees), the model and the tokens."""
    import torch

    from protein_performer.formats import read_records
    from protein_performer.training.task import load_checkpoint
    task = load_checkpoint(path)
    model = task.model
    seqs = sorted((r.sequence for r in read_records(HELDOUT)), key=len, reverse=True)[:proteins]
    L = min(max_len, len(seqs[-1]))
    tokens = torch.stack([torch.as_tensor(task.tokenizer.encode(s[:L - 2]).astype("int64")) for s in seqs])
    taken = []
    # the kernel's heads only: local heads (attention/local.py) attend exactly within a window, not through it
    hooks = [b.attn.register_forward_pre_hook(lambda m, a: taken.append(tuple(t[:, m.local_heads:] for t in m._qkv(a[0]))))
             for b in model.blocks]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return [tuple(t.double() for t in qkv) for qkv in taken], model, tokens


def run_ckpt(args, emit) -> None:
    """(b): every layer of every checkpoint; proteins split in half: hedgehog distilled on windows of
    the first half's q, k, scored (like everything else) on the second."""
    for path in args.ckpt:
        layers, model, _ = checkpoint_qkv(path, args.ckpt_proteins, args.ckpt_len)
        name = f"{Path(path).parent.parent.name or path} ({model.blocks[0].attn.kernel})"
        for layer, (q, k, v) in enumerate(layers):
            half = q.shape[0] // 2
            fit_q, fit_k = q[:half].float(), k[:half].float()
            q, k, v = q[half:], k[half:], v[half:]
            d, heads, L = q.shape[-1], q.shape[1], q.shape[2]
            rows = sample_rows(L, args.rows)
            refs, means = references(q, k, v, rows)
            base = dict(data="ckpt", ckpt=name, layer=layer, d=d, std=0.0, L=L)
            for causal, m in means.items():
                emit(dict(base, causal=causal, kernel="mean", r=0, **m))
            win = min(256, L)

            def crops(step):  # distillation on 256-token windows of the fitting half (memory win x win)
                a = (step * 997) % (L - win + 1)
                return fit_q[..., a:a + win, :], fit_k[..., a:a + win, :]
            for kern, r in kernel_grid(args.kernels, args.features, d):
                fit = (q, k) if kern == "favor++" else crops
                runs = [evaluate(make_map(kern, d, r, heads, seed, fit=fit, distill_steps=args.distill_steps),
                                 q, k, v, rows, refs) for seed in range(1, 1 + (args.draws if kern in RANDOM else 1))]
                for causal in (False, True):
                    emit(dict(base, causal=causal, kernel=kern, r=r, **average([run[causal] for run in runs])))


# ----------------------------------------------------------------------------- report
def fmt(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.3g}"


def _find(recs, **key):
    return [r for r in recs if all(r.get(k) == v for k, v in key.items())]


def iid_tables(recs, args) -> list[str]:
    lines = []
    for d in args.head_dims:
        for data, rank, std in families(args):
            title = f"logit std {std:g}" if rank is None else f"q, k in a {rank}-dim subspace, logit std {std:g}"
            lines += [f"### head_dim {d}, {title}", "",
                      "Output error, the mean over rows of ‖ôᵢ−oᵢ‖/‖oᵢ‖ (row total variation in brackets); **bold**: "
                      "below the mean "
                      "of values in that column.", ""]
            header = ["kernel", "r"] + [f"{'causal' if c else 'bidir.'} L={L:,}" for c in (False, True)
                                        for L in args.lengths]
            rows = []
            for kern, r in [("mean", 0)] + kernel_grid(args.kernels, args.features, d):
                cells = []
                for causal in (False, True):
                    for L in args.lengths:
                        hit = _find(recs, data=data, d=d, std=std, L=L, causal=causal, kernel=kern, r=r)
                        floor = _find(recs, data=data, d=d, std=std, L=L, causal=causal, kernel="mean")
                        if not hit:
                            cells.append("")
                            continue
                        text = f"{fmt(hit[0]['err'])} ({fmt(hit[0]['tv'])})"
                        cells.append(f"**{text}**" if kern != "mean" and hit[0]["err"] < floor[0]["err"] else text)
                rows.append([LABEL[kern], r or ""] + cells)
            lines += common.md_table(header, rows) + [""]
    return lines


def summary(recs, args) -> list[str]:
    """Best kernel per (head_dim, std, mode) at the longest L, against the mean."""
    L = max(args.lengths)
    rows = []
    for d in args.head_dims:
        for std in args.stds:
            for causal in (False, True):
                key = dict(data="iid", d=d, std=std, L=L, causal=causal)
                floor = _find(recs, kernel="mean", **key)[0]["err"]
                cand = [r for r in _find(recs, **key) if r["kernel"] != "mean"]
                best = min(cand, key=lambda r: r["err"])
                fav = min(_find(cand, kernel="softmax"), key=lambda r: r["err"])
                beat = sorted({LABEL[r["kernel"]] for r in cand if r["err"] < floor})
                rows.append([d, f"{std:g}", "causal" if causal else "bidir.", fmt(floor),
                             f"{LABEL[best['kernel']]} r={best['r']}: {fmt(best['err'])}",
                             f"{fmt(fav['err'])} (r={fav['r']})", ", ".join(beat) or "none"])
    return common.md_table(["head_dim", "logit std", "mode", "mean of values", "best kernel",
                            "best FAVOR+", "kernels below the mean (any r)"], rows)


def qknorm_table(recs, args) -> list[str]:
    rows = []
    for d in args.head_dims:
        for std in args.stds:
            for causal in (False, True):
                cells = []
                for name in ("raw", "qk_norm"):
                    key = dict(data=f"qknorm:{name}", d=d, std=std, causal=causal)
                    fav, mean = _find(recs, kernel="softmax", **key), _find(recs, kernel="mean", **key)
                    cells += [fmt(fav[0]["err"]), fmt(mean[0]["err"])]
                rows.append([d, f"{std:g}", "causal" if causal else "bidir.", *cells])
    L, r = recs and next((x["L"], x["r"]) for x in recs if x["data"] == "qknorm:raw" and x["kernel"] == "softmax")
    return [f"L = {L:,}, r = {r}, output error.", ""] + common.md_table(
        ["head_dim", "logit std", "mode", "FAVOR+ raw q, k", "mean (raw)", "FAVOR+ q, k at the mean norm",
         "mean (normalised)"], rows)


def trig_table(recs, args) -> list[str]:
    r = 256 if 256 in args.features else args.features[-1]
    rows = []
    for d in args.head_dims:
        for std in args.stds:
            for causal in (False, True):
                cells = []
                for L in args.lengths:
                    hit = _find(recs, data="iid", d=d, std=std, L=L, causal=causal, kernel="trig", r=r)
                    cells.append(f"{100 * hit[0]['nonpos']:.0f} % / {fmt(hit[0]['err'])}" if hit else "")
                rows.append([d, f"{std:g}", "causal" if causal else "bidir.", *cells])
    return [f"trig, r = {r}: share of rows whose normalizer q'·Σk' is ≤ 0 (floored, hence wrong) / output "
            "error.", ""] + common.md_table(["head_dim", "logit std", "mode"] + [f"L={L:,}" for L in args.lengths],
                                            rows)


def ckpt_tables(recs, args) -> list[str]:
    recs = [r for r in recs if r["data"] == "ckpt"]
    if not recs:
        return ["Not measured: there is no trained checkpoint in the repository, and training the README "
                "default and its `model=transformer` twin takes about 2 × 9 min on 2 cores. To produce this "
                f"section: `{CKPT_HINT}`.", ""]
    lines = []
    for name in dict.fromkeys(r["ckpt"] for r in recs):
        mine = [r for r in recs if r["ckpt"] == name]
        layers = sorted({r["layer"] for r in mine})
        L = mine[0]["L"]
        lines += [f"### {name}, L = {L:,}, {len(layers)} layers", "",
                  "Output error per layer (row total variation in brackets).", ""]
        header = ["kernel", "r"] + [f"{'causal' if c else 'bidir.'} layer {i}" for c in (False, True) for i in layers]
        rows = []
        for kern, r in [("mean", 0)] + kernel_grid(args.kernels, args.features, mine[0]["d"]):
            cells = [next((f"{fmt(x['err'])} ({fmt(x['tv'])})" for x in _find(mine, causal=c, layer=i, kernel=kern,
                                                                              r=r)), "")
                     for c in (False, True) for i in layers]
            rows.append([LABEL[kern], r or ""] + cells)
        lines += common.md_table(header, rows) + [""]
    return lines


def report(recs, args, seconds: float) -> str:
    cmd = args.original_command or common.command_line(__file__)
    lines = ["# Attention fidelity: each kernel against exact softmax", "",
             f"Generated by `{cmd}` in {seconds / 60:.1f} min ({args.threads} thread, {common.cpu()}, load "
             f"{common.load_average()}); every figure is float64.  What is measured and how: the docstring of "
             "benchmarks/quality/fidelity.py.  Rows per (L, mode): an evenly spaced sample of "
             f"{args.rows} query positions, {args.heads} heads; the same feature maps "
             f"for every L, averaged over {args.draws} draws for random maps.", "",
             "## Summary: the best kernel at the longest length", "",
             f"L = {max(args.lengths):,}, output error; the mean of values is the floor.", "",
             *summary(recs, args), "",
             "## (a) iid q, k", "", *iid_tables(recs, args),
             "## q/k normalisation (FAVOR+)", "", *qknorm_table(recs, args), "",
             "## trig: non-positive normalizers", "", *trig_table(recs, args), "",
             "## (b) q, k, v of trained checkpoints on held-out proteins", "", *ckpt_tables(recs, args)]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small grid (seconds), for the test")
    ap.add_argument("--ckpt", action="append", default=[], help="a checkpoint whose layers' q, k, v to score (b)")
    ap.add_argument("--ckpt-proteins", type=int, default=4, help="the longest held-out proteins (half fit, half scored)")
    ap.add_argument("--ckpt-len", type=int, default=4096, help="crop held-out proteins to this many tokens")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=DOC)
    ap.add_argument("--original-command", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        setattr(args, key, value)
    args.kernels = args.kernels.split(",")
    unknown = set(args.kernels) - set(KERNELS)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}; choose from {','.join(KERNELS)}")
    import torch
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="attention kernel 'trig'")
    recs, start = [], time.perf_counter()

    def emit(rec: dict) -> None:
        recs.append(rec)
        if os.environ.get("FIDELITY_VERBOSE"):
            print(rec, flush=True)
    run_iid(args, emit)
    run_ckpt(args, emit)
    text = report(recs, args, time.perf_counter() - start)
    common.write_doc(args.out, text, keep_below=True)
    print(f"wrote {args.out} ({len(recs)} measurements, {(time.perf_counter() - start) / 60:.1f} min)")


if __name__ == "__main__":
    main()

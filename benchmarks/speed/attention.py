#!/usr/bin/env python
"""Benchmark the attention kernels: time and peak memory against sequence length, and the
accuracy of the softmax-approximating kernels against exact softmax attention.

What is timed is the attention core on given q, k, v of shape (batch, heads, L, head_dim)
(feature maps + attention, no projections), as in the anchors: forward+backward (gradient of
sum(out * g) w.r.t. q, k, v) and forward only (no_grad).  Every (method, mode, pass) runs in
its own subprocess over increasing L, so the peak RSS read after each L is that L's peak
(the whole process, ~220 MiB of which is Python + torch: docs/anchors.md, 'Machine').

    python benchmarks/speed/attention.py            # full run, writes docs/benchmarks.md + PNGs
    python benchmarks/speed/attention.py --quick    # L = 512..2048, a few minutes
    nice python benchmarks/speed/attention.py --threads 2
    python benchmarks/speed/attention.py --speed    # fwd+bwd side by side with SDPA -> docs/attention_speed.md

Methods: our kernels (softmax = FAVOR+, favor++, relu, trig, elu with r = head_dim), exact
SDPA, and performer-pytorch 1.1.4 (``pip install performer-pytorch==1.1.4``, the optional
``bench`` extra) when importable; fast-transformers is measured when importable, and its
figures, with the other libraries' and the machine's, are cited from docs/anchors.md (measured
earlier, not rerun here; their provenance is there).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK_LENGTHS = [512, 1024, 2048]
OURS = ["softmax", "favor++", "relu", "trig", "elu", "exact"]
LABELS = {
    "softmax": "ours FAVOR+ (softmax, r=256)",
    "favor++": "ours FAVOR++ (r=256)",
    "relu": "ours ReLU (r=256)",
    "trig": "ours trig (r=256)",
    "elu": "ours elu+1 (r=64)",
    "exact": "exact SDPA",
    "pp": "performer-pytorch 1.1.4",
    "ft": "fast-transformers 0.4.0 elu+1",
}

ANCHOR_SOURCE = "docs/anchors.md"


def load_anchors() -> dict:
    """The attention figures measured earlier with other libraries (docs/anchors.md, 'Attention
    core'): (id, mode) -> {L: (seconds per fwd+bwd step, peak RSS MiB)}."""
    return {(row["id"], row["mode"]): {int(k[2:]): tuple(common.number(x) for x in v.split("/"))
                                       for k, v in row.items() if k.startswith("L=")}
            for row in common.anchors("Attention core")}


# ----------------------------------------------------------------------------- worker side


def _build(method: str, causal: bool, args):
    """Return f(q, k, v) -> out for a method."""
    import torch

    from protein_performer.attention import build_feature_map, kernel_attention

    if method in OURS:
        r = args.nb_features
        fm = build_feature_map(method, args.head_dim, r, generator=torch.Generator().manual_seed(0))
        return lambda q, k, v: kernel_attention(fm, q, k, v, causal=causal, chunk_size=args.chunk_size)
    if method == "pp":
        warnings.filterwarnings("ignore")
        from performer_pytorch import FastAttention

        fa = FastAttention(args.head_dim, nb_features=args.nb_features, causal=causal)
        return lambda q, k, v: fa(q, k, v)
    if method == "ft":
        from fast_transformers.attention import CausalLinearAttention, LinearAttention
        from fast_transformers.masking import LengthMask, TriangularCausalMask

        att = CausalLinearAttention(args.head_dim) if causal else LinearAttention(args.head_dim)

        def f(q, k, v):
            B, H, L, _ = q.shape
            tr = lambda t: t.transpose(1, 2)  # noqa: E731  (B, L, H, d)
            mask = TriangularCausalMask(L) if causal else None
            lm = LengthMask(torch.full((B,), L, dtype=torch.long), max_len=L)
            return att(tr(q), tr(k), tr(v), mask, lm, lm).transpose(1, 2)
        return f
    raise ValueError(method)


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    causal = args.mode == "causal"
    f = _build(args.method, causal, args)
    B, H, d = args.batch, args.heads, args.head_dim
    prev = None
    for L in args.lengths:
        if prev is not None:
            growth = 4.0 if args.method == "exact" else 2.2
            if args.method == "pp" and causal:
                growth = 2.5
            predicted = prev * (L / prev_L) ** math.log2(growth)
            if predicted > args.max_seconds:
                print(json.dumps({"L": L, "skipped": f"predicted {predicted:.0f} s > --max-seconds"}), flush=True)
                continue
        g = torch.Generator().manual_seed(L)
        scale = 0.5 ** 0.5  # logits of std 0.5
        q = (torch.randn(B, H, L, d, generator=g) * scale).requires_grad_(args.pass_ == "fwdbwd")
        k = (torch.randn(B, H, L, d, generator=g) * scale).requires_grad_(args.pass_ == "fwdbwd")
        v = torch.randn(B, H, L, d, generator=g).requires_grad_(args.pass_ == "fwdbwd")
        go = torch.randn(B, H, L, d, generator=g)

        def step():
            if args.pass_ == "fwdbwd":
                q.grad = k.grad = v.grad = None
                out = f(q, k, v)
                torch.autograd.backward(out, go)
            else:
                with torch.no_grad():
                    f(q, k, v)
        try:
            first = common.seconds(step)  # warm-up
            timing = common.measure(step, args.reps if first < 2.0 else max(1, min(args.reps, 2)), warmup=0)
        except RuntimeError as e:  # out of memory and the like
            print(json.dumps({"L": L, "skipped": f"error: {str(e)[:80]}"}), flush=True)
            break
        t = timing.median
        print(json.dumps({"L": L, "time": t, "time_min": timing.best, "rss_mib": common.peak_rss_mib(),
                          "reps": len(timing.runs)}), flush=True)
        prev, prev_L = t, L
        del q, k, v, go


# ----------------------------------------------------------------------------- driver side
def run_worker(method, mode, pass_, lengths, args) -> dict:
    cmd = ["--worker", "--method", method, "--mode", mode, "--pass", pass_,
           "--lengths", ",".join(map(str, lengths)), "--threads", args.threads,
           "--reps", args.reps, "--max-seconds", args.max_seconds, "--batch", args.batch,
           "--heads", args.heads, "--head-dim", args.head_dim, "--chunk-size", args.chunk_size,
           "--nb-features", args.head_dim if method == "elu" else args.nb_features]

    def show(rec: dict) -> None:
        shown = (f"{rec['time']:.4f} s  {rec['rss_mib']:.0f} MiB" if "time" in rec else rec["skipped"])
        print(f"  {LABELS.get(method, method):32s} {mode:13s} {pass_:6s} L={rec['L']:6d}  {shown}", flush=True)
    child = common.run_child(__file__, cmd, on_record=show)
    if not child.ok:
        print(f"  {method} {mode} {pass_}: worker failed: {child.reason}", flush=True)
    return {rec["L"]: rec for rec in child.records}


def matmul_rate(threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    out = {}

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    out["mm2048_gflops"] = 2 * 2048 ** 3 / common.measure(lambda: a @ b, 5).best / 1e9
    x, w = torch.randn(8, 8192, 256), torch.randn(8, 256, 64)
    out["bmm_gflops"] = 2 * 8 * 8192 * 256 * 64 / common.measure(lambda: x @ w, 5).best / 1e9
    return out


def favor_bidir_flops(L, args) -> float:
    """Nominal matmul FLOPs of bidirectional FAVOR+ fwd+bwd (3x the forward's matmuls)."""
    B, H, d, r = args.batch, args.heads, args.head_dim, args.nb_features
    fwd = 2 * (2 * B * H * L * d * r) + 2 * (2 * B * H * L * r * (d + 1))
    return 3 * fwd


# ----------------------------------------------------------------------------- accuracy study
def accuracy_study(args) -> dict:
    import torch

    from protein_performer.attention import build_feature_map, kernel_attention
    from protein_performer.attention.naive import softmax_attention

    torch.set_num_threads(args.threads)
    try:
        warnings.filterwarnings("ignore")
        from performer_pytorch import FastAttention
    except Exception:
        FastAttention = None
    d, L, H = args.head_dim, args.acc_length, 4
    stds = [0.25, 0.5, 1.0, 2.0]
    feats = [64, 256] if args.quick else [64, 256, 1024, 4096]
    draws = 1 if args.quick else 3
    rows = []
    for std in stds:
        g = torch.Generator().manual_seed(0)
        s = math.sqrt(std)  # q, k ~ N(0, s^2): logits q.k/sqrt(d) have std s^2 = std
        q = torch.randn(1, H, L, d, generator=g) * s
        k = torch.randn(1, H, L, d, generator=g) * s
        v = torch.randn(1, H, L, d, generator=g)
        ref = softmax_attention(q.double(), k.double(), v.double())
        err = lambda out: ((out.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        row = {"std": std, "measured_logit_std": ((q @ k.transpose(-1, -2)) / math.sqrt(d)).std().item(),
               "uniform": err(v.mean(2, keepdim=True).expand_as(v))}
        for r in feats:
            for kernel in ("softmax", "favor++", "trig"):
                es = []
                for seed in range(draws):
                    fm = build_feature_map(kernel, d, r, generator=torch.Generator().manual_seed(100 + seed))
                    if kernel == "favor++":
                        fm.set_rho(q, k)
                    es.append(err(kernel_attention(fm, q, k, v)))
                row[f"{kernel}/{r}"] = sum(es) / len(es)
            if FastAttention is not None:
                es = []
                for seed in range(draws):
                    torch.manual_seed(100 + seed)
                    fa = FastAttention(d, nb_features=r)
                    es.append(err(fa(q, k, v)))
                row[f"pp/{r}"] = sum(es) / len(es)
        rows.append(row)
        print("  accuracy", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
    return {"rows": rows, "features": feats, "draws": draws, "L": L, "heads": H, "pp": FastAttention is not None}


# ----------------------------------------------------------------------------- report
def fmt_cell(rec) -> str:
    if rec is None:
        return "—"
    if "time" not in rec:
        return "skipped"
    t = rec["time"]
    ts = f"{t:.3f}" if t < 10 else f"{t:.1f}"
    return f"{ts} / {rec['rss_mib']:.0f}"


def write_report(results, acc, mm, args, lengths, wall) -> str:
    import torch

    anchors, machine = load_anchors(), common.machine_anchors()
    lines = []
    P = lines.append
    P("# Attention benchmarks")
    P("")
    P("Generated by `benchmarks/speed/attention.py` — do not edit by hand; rerun the script.")
    P("")
    P(f"- command: `{args.command_line}`")
    P(f"- machine: {common.cpu()}, {os.cpu_count()} CPUs, "
      f"torch {torch.__version__}, {args.threads} threads, fp32")
    P(f"- shapes: batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, r = {args.nb_features} "
      f"(elu+1: r = head dim), chunk size {args.chunk_size} for the causal linear path")
    P(f"- fp32 matmul rate measured in this run: {mm['mm2048_gflops']:.0f} GFLOP/s (2048² matmul), "
      f"{mm['bmm_gflops']:.0f} GFLOP/s ((8×8192×256)·(256×64) batched)")
    P(f"- what is timed: feature maps + attention on given q, k, v (no projections); fwd+bwd = "
      "gradient w.r.t. q, k, v; median of up to "
      f"{args.reps} runs after a warm-up; cells are `seconds / peak RSS MiB of the whole process` "
      f"(one process per method and pass, L increasing, ~{machine['torch_rss_mib']} MiB of it is Python + torch)")
    P("- q, k ~ N(0, 1/2) entrywise (logit std 0.5), v ~ N(0, 1)"
      + (f"; total wall time {wall / 60:.1f} min" if wall == wall else ""))
    P(f"- load average: {args.load}; other jobs inflate absolute times and make them noisy — compare "
      f"the matmul rate above with the ~{machine['matmul_gflops']} GFLOP/s of a quiet machine, and exact SDPA "
      "in this run with its anchor; same-run ratios are the fair comparison")
    P(f"- anchors (figures measured earlier, with other libraries, not rerun here): {ANCHOR_SOURCE}, "
      "where their provenance is")
    P("")
    for pass_, title in (("fwdbwd", "Forward + backward"), ("fwd", "Forward only")):
        for mode in ("causal", "bidirectional"):
            P(f"## {title}, {mode}")
            P("")
            rows = []
            for method in results:
                recs = results[method].get((mode, pass_))
                if recs is None:
                    continue
                label = LABELS.get(method, method)
                if method == "pp" and mode == "causal":
                    label += " (CPU fallback)"
                rows.append([label, *(fmt_cell(recs.get(L)) for L in lengths)])
            lines += common.md_table(["method", *(f"L={L}" for L in lengths)], rows)
            P("")
    P(f"## Anchors (measured earlier, cited from {ANCHOR_SOURCE}, not rerun here)")
    P("")
    alen = sorted({L for row in anchors.values() for L in row})
    lines += common.md_table(["method", "mode", *(f"L={L}" for L in alen)],
                             [[m, mode, *(f"{row[L][0]} / {row[L][1]}" if L in row else "—" for L in alen)]
                              for (m, mode), row in anchors.items()])
    P("")
    P("## Goals")
    P("")

    def best(rec):
        return f"(best run {rec['time_min']:.3f} s)" if "time_min" in rec else ""

    def get(method, mode, L, pass_="fwdbwd"):
        rec = results.get(method, {}).get((mode, pass_), {}).get(L)
        return rec if rec and "time" in rec else None
    def anchor(key, mode):  # seconds per fwd+bwd step at L=8192
        return anchors[(key, mode)][8192][0]
    fp = get("softmax", "causal", 8192)
    ex = get("exact", "causal", 8192)
    ex_a, ppft_a = anchor("exact", "causal"), anchor("pp+ft-kernel", "causal")
    load = ex["time"] / ex_a if ex else None  # how much slower than when the anchors were measured
    if load:
        P(f"- load factor of this run: exact causal SDPA at L=8192 took {ex['time']:.2f} s here vs {ex_a:.2f} s "
          f"in the anchors, i.e. **{load:.1f}×** slower; 'normalized' figures below divide by it "
          "(a rough estimate of a quiet machine, not a measurement)")
    if fp:
        P(f"- causal FAVOR+ fwd+bwd at L=8192: **{fp['time']:.3f} s** {best(fp)}"
          + (f"; {ex['time'] / fp['time']:.1f}× faster than exact causal SDPA in the same run" if ex else "")
          + f"; vs the anchors: exact SDPA {ex_a:.2f} s, performer-pytorch + fast-transformers kernel "
          f"{ppft_a:.2f} s (goal: faster than the first, ≥ 5× faster than the second)"
          + (f"; normalized {fp['time'] / load:.2f} s = {ppft_a * load / fp['time']:.1f}× faster than "
             f"{ppft_a:.2f} s" if load else ""))
    el = get("elu", "causal", 8192)
    if el:
        P(f"- causal elu+1 (r=64) fwd+bwd at L=8192: **{el['time']:.3f} s** {best(el)} "
          f"vs fast-transformers' compiled kernel anchor {anchor('ft elu+1', 'causal'):.3f} s (goal: at least as fast)"
          + (f"; normalized {el['time'] / load:.2f} s" if load else ""))
    for method in ("softmax", "elu"):
        a, b = get(method, "causal", 8192), get(method, "causal", 16384)
        if a and b:
            P(f"- peak memory, causal {LABELS[method]}, L=16384 vs 8192: {b['rss_mib']:.0f} / {a['rss_mib']:.0f} MiB"
              f" = **{b['rss_mib'] / a['rss_mib']:.2f}×** (goal ≤ 2.1×; RSS includes "
              f"~{machine['torch_rss_mib']} MiB of torch)")
    bd = get("softmax", "bidirectional", 8192)
    if bd:
        gf = favor_bidir_flops(8192, args) / bd["time"] / 1e9
        pp = get("pp", "bidirectional", 8192)
        ppt = pp["time"] if pp else anchor("pp", "bidirectional")
        src = "measured in this run" if pp else "anchor"
        P(f"- bidirectional FAVOR+ fwd+bwd at L=8192: **{bd['time']:.3f} s** vs performer-pytorch {ppt:.3f} s "
          f"({src}; {ppt / bd['time']:.1f}× faster, goal ≥ 3×); nominal matmul work {gf:.0f} GFLOP/s = "
          f"{100 * gf / mm['mm2048_gflops']:.0f} % of this run's 2048² matmul rate (goal ≥ 50 %)")
    P("")
    if acc:
        P("## Approximation study")
        P("")
        P(f"Relative error ‖approx − exact‖ / ‖exact‖ of bidirectional attention against exact softmax "
          f"attention (float64 reference), L = {acc['L']}, {acc['heads']} heads, head dim {args.head_dim}, "
          f"q, k ~ N(0, std) entrywise so that the logits q·k/√d have the given standard deviation, "
          f"v ~ N(0, 1); mean over {acc['draws']} independent feature draws. `uniform` is the plain average "
          "of V (what an attention that collapsed to uniform returns). FAVOR++ uses rho computed from the "
          "data (what its training-time running estimate converges to).")
        P("")
        cols = ["uniform"] + [f"{k}/{r}" for r in acc["features"] for k in
                              (("softmax", "favor++", "trig", "pp") if acc["pp"] else ("softmax", "favor++", "trig"))]
        names = {"softmax": "FAVOR+", "favor++": "FAVOR++", "trig": "trig", "pp": "perf-pytorch"}
        header = ["uniform"] + [f"{names[c.split('/')[0]]} r={c.split('/')[1]}" for c in cols[1:]]
        lines += common.md_table(["logit std", *header],
                                 [[row["std"], *(f"{row[c]:.3f}" if row[c] < 100 else f"{row[c]:.1e}" for c in cols)]
                                  for row in acc["rows"]])
        P("")
        wins = [(row["std"], r) for row in acc["rows"] for r in acc["features"]
                if row[f"favor++/{r}"] < row[f"softmax/{r}"]]
        P("Reading:")
        P("")
        P("- Our FAVOR+ and FAVOR++ errors fall as r grows at every logit scale: what remains is the "
          "estimator's own variance, which grows like exp(|x+y|²) with the norms of the data-scaled q, k "
          "(at head dim 64, |x|² ≈ 8 × logit std). From logit std 0.5 up, thousands of features are needed "
          "to beat a plain average of V, and at std ≥ 1 none of the r here do: random-feature softmax "
          "estimates are only informative for small-norm queries and keys, which is what trained Performers "
          "learn to keep.")
        P("- Nothing collapses toward uniform: no epsilon is added to the features, and the key stabilizer is a "
          "data-independent bound that cancels exactly (see `protein_performer/attention/feature_maps.py`). "
          "performer-pytorch instead returns almost exactly the uniform average from std 1 up (its error "
          "equals the `uniform` column) and is worse than uniform at std 0.25 with r ≤ 256: its epsilon added "
          "after max-scaling drowns the key features. Its lower raw error at std 0.5 – 2 is that shrinkage "
          "toward the average, not information about the attention pattern.")
        P(f"- FAVOR++ (OPRF) beats FAVOR+ at equal r in {len(wins)} of "
          f"{len(acc['rows']) * len(acc['features'])} cells: "
          + ", ".join(f"std {sd} r={r}" for sd, r in wins) + ". "
          "Its A minimizes the variance averaged (in log space) over all query–key pairs; the attention "
          "error is dominated by the few pairs with the largest kernel values, whose |x+y|² is far above "
          "average, so at large logit scales the data-averaged A is no longer the right trade-off.")
        P("- trig features are unbiased but not positive: the estimated normalizer crosses zero, and the "
          "outputs are only bounded by the normalizer floor (|out| ≤ 10⁶ max|v|) — the instability the "
          "Performer paper reports.")
        P("")
    P("![time and memory](benchmarks.png)")
    P("")
    if acc:
        P("![approximation](benchmarks_approx.png)")
        P("")
    return "\n".join(lines)


def plot(results, acc, lengths, out_png: Path, out_acc: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for j, mode in enumerate(("causal", "bidirectional")):
        for method, res in results.items():
            recs = res.get((mode, "fwdbwd"), {})
            Ls = [L for L in lengths if recs.get(L, {}).get("time")]
            if not Ls:
                continue
            style = "--" if method in ("exact", "pp") else "-"
            axes[0, j].plot(Ls, [recs[L]["time"] for L in Ls], style, marker="o", label=LABELS.get(method, method))
            axes[1, j].plot(Ls, [recs[L]["rss_mib"] for L in Ls], style, marker="o", label=LABELS.get(method, method))
        for (m, amode), row in load_anchors().items():
            if amode == mode and m.startswith(("ft", "pp+")):
                Ls = sorted(row)
                axes[0, j].plot(Ls, [row[L][0] for L in Ls], ":", marker="x", label=f"{m} (anchor)")
                axes[1, j].plot(Ls, [row[L][1] for L in Ls], ":", marker="x", label=f"{m} (anchor)")
        axes[0, j].set_title(f"{mode}: forward + backward time")
        axes[1, j].set_title(f"{mode}: peak RSS of the process")
        axes[0, j].set_ylabel("seconds")
        axes[1, j].set_ylabel("MiB")
        for i in range(2):
            axes[i, j].set_xscale("log", base=2)
            axes[i, j].set_yscale("log")
            axes[i, j].set_xlabel("sequence length L")
            axes[i, j].grid(True, which="both", alpha=0.3)
        axes[0, j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    if acc:
        fig, axes = plt.subplots(1, len(acc["rows"]), figsize=(4 * len(acc["rows"]), 3.8), sharey=False)
        for ax, row in zip(axes, acc["rows"]):
            for kernel, name in (("softmax", "FAVOR+"), ("favor++", "FAVOR++"), ("trig", "trig"), ("pp", "perf-pytorch")):
                ys = [row.get(f"{kernel}/{r}") for r in acc["features"]]
                if ys[0] is None:
                    continue
                ax.plot(acc["features"], ys, marker="o", label=name)
            ax.axhline(row["uniform"], color="k", ls="--", label="uniform average")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"logit std {row['std']}")
            ax.set_xlabel("features r")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("relative error vs exact softmax")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_acc, dpi=110)
        plt.close(fig)


def parse_log(path: Path, args):
    """Rebuild (results, accuracy, matmul rate, lengths) from the stdout of an earlier run."""
    import re

    by_label = {v: k for k, v in LABELS.items()}
    results: dict = {}
    rows, mm = [], {"mm2048_gflops": float("nan"), "bmm_gflops": float("nan")}
    pat = re.compile(r"^  (.{32}) (causal|bidirectional)\s+(fwdbwd|fwd)\s+L=\s*(\d+)  (.*)$")
    for line in path.read_text().splitlines():
        if line.startswith("fp32 matmul:"):
            nums = re.findall(r"([\d.]+) GFLOP/s", line)
            mm = {"mm2048_gflops": float(nums[0]), "bmm_gflops": float(nums[1])}
        elif line.startswith("  accuracy "):
            rows.append(json.loads(line[len("  accuracy "):]))
        else:
            m = pat.match(line)
            if not m:
                continue
            method = by_label.get(m.group(1).strip(), m.group(1).strip())
            L, rest = int(m.group(4)), m.group(5)
            t = re.match(r"([\d.]+) s\s+(\d+) MiB", rest)
            rec = {"L": L, "time": float(t.group(1)), "rss_mib": float(t.group(2))} if t else {"L": L, "skipped": rest}
            results.setdefault(method, {}).setdefault((m.group(2), m.group(3)), {})[L] = rec
    lengths = sorted({L for res in results.values() for recs in res.values() for L in recs})
    acc = None
    if rows:
        feats = sorted({int(k.split("/")[1]) for k in rows[0] if "/" in k})
        acc = {"rows": rows, "features": feats, "draws": args.acc_draws, "L": args.acc_length, "heads": 4,
               "pp": any(k.startswith("pp/") for k in rows[0])}
    return results, acc, mm, lengths



# ----------------------------------------------------------------------------- focused speed table
SPEED_DOC = common.DOCS / "attention_speed.md"


def _unfused_favor(fm, q, k, v, causal=False, chunk_size=None):
    """FAVOR+ as before fused_favor.py: feature maps, then the plain product (bidirectional, or
    linear.py's chunked one), head group by head group (linear.head_groups), the maps' autograd
    backward over L x r: the fused paths' baseline."""
    import torch

    from protein_performer.attention import linear_attention
    from protein_performer.attention.linear import head_groups
    g = head_groups(q.shape[0], q.shape[1], q.shape[2], fm.num_features)
    outs = []
    for qg, kg, vg in zip(q.split(g, 1), k.split(g, 1), v.split(g, 1)):
        kf, s = fm(kg, is_query=False)
        outs.append(linear_attention(fm(qg, is_query=True), kf, vg, causal, chunk_size=chunk_size, k_log_scale=s))
    return torch.cat(outs, dim=1)


def speed_table(args) -> str:
    """Forward+backward of FAVOR+ (r = --nb-features), elu+1 and exact SDPA, causal and bidirectional
    (there also FAVOR+ without the fusion of fused_favor.py), interleaved in one process (rep by rep,
    so load drifts hit every method alike): medians and ratios to SDPA."""
    import torch

    from protein_performer.attention import build_feature_map, kernel_attention

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [2048, 4096]
    rows = []
    for causal in (True, False):
        mode = "causal" if causal else "bidirectional"
        for d in (32, 64):
            fav = build_feature_map("softmax", d, args.nb_features, generator=torch.Generator().manual_seed(0))
            elu = build_feature_map("elu", d)
            fa = f"FAVOR+ r={args.nb_features}"
            methods = {"exact SDPA": lambda q, k, v: kernel_attention(None, q, k, v, causal=causal),
                       fa: lambda q, k, v: kernel_attention(fav, q, k, v, causal=causal, chunk_size=args.chunk_size),
                       "elu+1": lambda q, k, v: kernel_attention(elu, q, k, v, causal=causal, chunk_size=args.chunk_size)}
            methods = {**dict(list(methods.items())[:2]), "elu+1": methods["elu+1"],
                       f"{fa} unfused": lambda q, k, v: _unfused_favor(fav, q, k, v, causal, args.chunk_size)}
            for L in lengths:
                g = torch.Generator().manual_seed(L)
                q, k, v = ((torch.randn(args.batch, args.heads, L, d, generator=g) * (0.5 ** 0.5 if i < 2 else 1))
                           .requires_grad_() for i in range(3))
                go = torch.randn(args.batch, args.heads, L, d, generator=g)

                def step(f):
                    q.grad = k.grad = v.grad = None
                    torch.autograd.backward(f(q, k, v), go)
                times = {name: [] for name in methods}
                for rep in range(args.reps + 1):  # the first round is the warm-up
                    for name, f in methods.items():
                        t = common.seconds(lambda: step(f))
                        if rep:
                            times[name].append(t)
                med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
                for name in methods:
                    rows.append([mode, d, L, name, f"{med[name]:.3f}", f"{med[name] / med['exact SDPA']:.2f}"])
                    print(f"  {mode} head_dim {d} L={L} {name:22s} {med[name]:.3f} s  "
                          f"{med[name] / med['exact SDPA']:.2f}x SDPA", flush=True)
                paired = sorted(b / a for a, b in zip(times[f"{fa} unfused"], times[fa]))
                rows[-3][-1] += f" (fused / unfused, paired median: {paired[len(paired) // 2]:.2f})"
    lines = ["# Attention speed: forward + backward against exact SDPA", "",
             "Generated by `benchmarks/speed/attention.py --speed` — do not edit by hand; rerun the script.", "",
             f"- command: `{args.command_line}` at commit {common.git_commit()}",
             f"- machine: {common.cpu()}, {os.cpu_count()} CPUs, {args.threads} thread(s), fp32; load average "
             f"{common.load_average()}",
             f"- what is timed: feature maps + attention on given q, k, v (batch {args.batch}, {args.heads} heads; "
             "no projections), forward + backward (gradient of sum(out * g) w.r.t. q, k, v); methods interleaved "
             f"rep by rep in one process, median of {args.reps} after a warm-up round; chunk size "
             f"{args.chunk_size or 'default'} (causal); q, k ~ N(0, 1/2), v ~ N(0, 1)",
             "- ratio = time / exact SDPA's time in the same run (issue 19's goal for causal FAVOR+ at head dim 32, "
             "r = 256, L = 4096: ≤ 0.5); FAVOR+ runs fused with its feature maps (fused_favor.py), "
             "the `unfused` row is the plain path it replaced (features, then the product), with the paired ratio", ""]
    lines += common.md_table(["mode", "head dim", "L", "method", "seconds", "× SDPA"], rows)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="L = 512..2048, fewer features and draws")
    ap.add_argument("--lengths", type=str, default=None, help="comma-separated L (default 512..65536)")
    ap.add_argument("--methods", type=str, default=None, help="comma-separated, default all")
    ap.add_argument("--modes", type=str, default="causal,bidirectional")
    ap.add_argument("--passes", type=str, default="fwdbwd,fwd")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=30.0, help="skip an L whose predicted time exceeds this")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--nb-features", type=int, default=256)
    ap.add_argument("--chunk-size", type=int, default=128)
    ap.add_argument("--acc-length", type=int, default=1024)
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--speed", action="store_true", help="only the fwd+bwd table against SDPA, causal and bidirectional "
                    "(docs/attention_speed.md; --lengths default 2048,4096)")
    ap.add_argument("--from-log", type=Path, default=None,
                    help="rebuild the report and plots from the saved stdout of an earlier run")
    ap.add_argument("--acc-draws", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--original-command", type=str, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=common.DOCS / "benchmarks.md")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", type=str, help=argparse.SUPPRESS)
    ap.add_argument("--mode", type=str, help=argparse.SUPPRESS)
    ap.add_argument("--pass", dest="pass_", type=str, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        worker(args)
        return
    args.command_line = common.command_line(__file__)
    if args.speed:
        if args.out == common.DOCS / "benchmarks.md":
            args.out = SPEED_DOC
        report = speed_table(args)
        common.write_doc(args.out, report + "\n")
        print(report)
        return
    if args.from_log:
        results, acc, mm, lengths = parse_log(args.from_log, args)
        args.command_line = args.original_command or common.command_line(__file__, [])
        args.load = "not recorded (report rebuilt from a log)"
        report = write_report(results, acc, mm, args, lengths, float("nan"))
        common.write_doc(args.out, report + "\n")
        plot(results, acc, lengths, args.out.with_suffix(".png"), args.out.with_name(args.out.stem + "_approx.png"))
        print(report)
        return
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else (QUICK_LENGTHS if args.quick else LENGTHS)
    if args.quick:
        args.reps = min(args.reps, 2)
    methods = args.methods.split(",") if args.methods else list(OURS)
    if not args.methods:
        import importlib.util

        for name, key in (("performer_pytorch", "pp"), ("fast_transformers", "ft")):
            if importlib.util.find_spec(name) is not None:
                methods.append(key)
    t_start = time.time()
    load_start = common.load_average()
    mm = matmul_rate(args.threads)
    print(f"fp32 matmul: {mm['mm2048_gflops']:.0f} GFLOP/s (2048^2), {mm['bmm_gflops']:.0f} GFLOP/s (batched)")
    results: dict = {}
    for method in methods:
        results[method] = {}
        for mode in args.modes.split(","):
            for pass_ in args.passes.split(","):
                Ls = lengths
                if method == "pp" and mode == "causal":  # CPU fallback: 8 GB and 5 s at L = 4096 (anchor)
                    Ls = [L for L in lengths if L <= 2048]
                results[method][(mode, pass_)] = run_worker(method, mode, pass_, Ls, args)
    acc = None if args.no_accuracy else accuracy_study(args)
    wall = time.time() - t_start
    args.load = f"{load_start} at the start, {common.load_average()} at the end"
    report = write_report(results, acc, mm, args, lengths, wall)
    common.write_doc(args.out, report + "\n")
    png = args.out.with_suffix(".png")
    plot(results, acc, lengths, png, args.out.with_name(args.out.stem + "_approx.png"))
    print()
    print(report)
    print(f"\nwrote {args.out} and {png}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Benchmark one training step of the language model for every attention kernel.

benchmarks/speed/attention.py times the attention core alone; training pays for the whole
step. This times ONE optimizer step (forward, cross entropy, backward, AdamW) of
``protein_performer.model.PerformerLM`` (dim 256, depth 4, 8 heads of 32, r = 128, rotary, one
local head as in the default model, ~3.2 M parameters) on random residues per kernel, shape
(batch x length) and mode (bidirectional, causal), and of performer-pytorch's PerformerLM (the
``bench`` extra) when importable. Each configuration runs in its own subprocess (the parent
never imports torch), so its peak RSS is its own. The markdown report (with the goal ratios), a
plot and the raw JSON go to ``--out``.

    flock /tmp/heavy.lock python benchmarks/speed/training.py            # full run, docs/benchmarks_training.*
    flock /tmp/heavy.lock python benchmarks/speed/training.py --quick    # smoke run, writes under /tmp
    python benchmarks/speed/training.py --from-json docs/benchmarks_training.json   # report only
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import re
import resource
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

PP = "performer-pytorch"
KERNELS = ["softmax", "favor++", "relu", "elu", "exact", PP]
LABELS = {"softmax": "FAVOR+ (softmax)", "favor++": "FAVOR++", "relu": "ReLU", "elu": "elu+1 (r = head dim)",
          "exact": "exact (SDPA)", PP: "performer-pytorch 1.1.4"}
SHAPES, QUICK_SHAPES = "8x1024,1x8192,1x16384", "2x256,1x1024"
WORKER_STARTUP_S = 60  # importing torch and building the model, on top of the per-step budget
# head_dim 32 and r = 128, twice conf/model/base.yaml's 64, so the feature cost here bounds the default's
# (more features do not pay: docs/fidelity.md);
# r = 256 until 2026-12-02, and --paired still times both (PAIRED_FEATURES)
# local_heads 1: the default model's one head of exact attention within 128 residues in every linear
# model (conf/model/base.yaml; exact softmax has none); performer-pytorch as it comes (local_attn_heads=0):
# its local attention (the local-attention package) took 5x our model's step at 2x256
MODEL_OPTIONS = {"dim": 256, "depth": 4, "heads": 8, "ff_mult": 4, "nb_features": 128, "local_heads": 1}
LOCAL_WINDOW = 128  # conf/model/base.yaml's model.attention.local_window
PAIRED_FEATURES = "128,256"
WORKER_OPTIONS = ("threads", "steps", "max_seconds", "max_mib", "malloc", *MODEL_OPTIONS)


def parse_shape(shape: str) -> tuple[int, int]:
    batch, length = shape.split("x")
    return int(batch), int(length)


def n_tokens(shape: str) -> int:
    batch, length = parse_shape(shape)
    return batch * length


# ----------------------------------------------------------------------------- worker side
def cap_address_space(max_mib: int) -> None:
    """Let the process grow by at most ``max_mib`` from here, so that an oversized configuration
    fails with an allocation error instead of sending a shared machine into the OOM killer."""
    vm_bytes = common.proc_memory("VmSize")
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + max_mib * 2 ** 20, resource.RLIM_INFINITY))


def build_model(args, vocab_size: int, length: int):
    """The model for ``args.kernel`` and a note on how it was built."""
    causal = args.mode == "causal"
    if args.kernel == PP:
        from performer_pytorch import FastAttention, PerformerLM as ReferencePerformerLM

        with redirect_stdout(sys.stderr):  # it prints its causal fallback notice to stdout
            model = ReferencePerformerLM(num_tokens=vocab_size, max_seq_len=length, dim=args.dim, depth=args.depth,
                                         heads=args.heads, dim_head=args.dim // args.heads, ff_mult=args.ff_mult,
                                         nb_features=args.nb_features, causal=causal, feature_redraw_interval=None)
        if not causal:
            return model, ""
        path = next(m for m in model.modules() if isinstance(m, FastAttention)).causal_linear_fn
        return model, f"causal path: {getattr(path, 'func', path).__name__}"
    from protein_performer.model import PerformerLM
    from protein_performer.tokenizer import Tokenizer

    kwargs = dict(vocab_size=Tokenizer().vocab_size, dim=args.dim, depth=args.depth, heads=args.heads,
                  ff_mult=args.ff_mult, dropout=0.0, causal=causal, position="rotary",
                  attention={"kernel": args.kernel, "nb_features": args.nb_features, "redraw_interval": 0,
                             "local_heads": 0 if args.kernel == "exact" else args.local_heads,
                             "local_window": LOCAL_WINDOW})
    model = PerformerLM(**kwargs)
    if args.compile:  # as train.py compile=true does (fixed shapes here: compiled once, in the warm-up step)
        model.compile()
    return model, "torch.compile" if args.compile else ""


def set_malloc(args) -> None:
    """``--malloc keep`` (the default): glibc keeps freed memory, as scripts/train.py sets it
    (protein_performer.allocator); ``system``: glibc's own defaults, the step as it was before."""
    if args.malloc == "keep":
        from protein_performer.allocator import keep_freed_memory

        keep_freed_memory()


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    from protein_performer.tokenizer import Tokenizer

    set_malloc(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch, length = parse_shape(args.shape)
    record = {"kernel": args.kernel, "mode": args.mode, "shape": args.shape}
    tokenizer = Tokenizer()
    try:
        model, record["note"] = build_model(args, tokenizer.vocab_size, length)
    except ImportError as e:  # performer-pytorch or one of its dependencies
        if args.kernel != PP:
            raise
        print(json.dumps(record | {"status": "not installed", "reason": str(e)}))
        return
    model.train()
    record["params"] = sum(p.numel() for p in model.parameters())
    if args.kernel != PP:
        record["chunk_size"] = getattr(model.blocks[0].attn, "chunk_size", None)
    tokens = torch.randint(tokenizer.aa_offset, tokenizer.vocab_size, (batch, length))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens.reshape(-1)).backward()
        optimizer.step()

    cap_address_space(args.max_mib)
    try:
        timing = common.measure(train_step, args.steps, warmup=1, limit_s=args.max_seconds)
    except common.TooSlow as e:
        print(json.dumps(record | {"status": "timeout", "reason": f"a step took {e.seconds[-1]:.0f} s "
                                   f"> --max-seconds {args.max_seconds:.0f}"}))
        return
    except (RuntimeError, MemoryError) as e:
        out_of_memory = isinstance(e, MemoryError) or "alloc" in str(e)
        print(json.dumps(record | {"status": "out of memory" if out_of_memory else "error",
                                   "reason": f"over --max-mib {args.max_mib}" if out_of_memory else str(e)[:200]}))
        return
    print(json.dumps(record | {"status": "ok", "seconds": timing.median, "step_seconds": timing.all,
                               "tokens_per_s": batch * length / timing.median, "rss_mib": common.peak_rss_mib()}))


# ----------------------------------------------------------------------------- driver side
def run_config(kernel: str, mode: str, shape: str, args) -> dict:
    record = {"kernel": kernel, "mode": mode, "shape": shape}
    cmd = ["--worker", "--kernel", kernel, "--mode", mode, "--shape", shape]
    for option in WORKER_OPTIONS:
        cmd += ["--" + option.replace("_", "-"), str(getattr(args, option))]
    cmd += ["--compile"] if args.compile else []
    child = common.run_child(__file__, cmd, timeout=WORKER_STARTUP_S + (1 + args.steps) * args.max_seconds)
    if child.timed_out:
        return record | {"status": "timeout", "reason": f"worker {child.reason}"}
    if child.records:
        return child.records[-1]
    return record | {"status": "error", "reason": child.reason}


def skip_reason(kernel: str, mode: str, shape: str, done: list[dict], args) -> str | None:
    """Why not to run a configuration: a no-larger shape already failed, or the time predicted
    from the largest finished shape (linear in tokens; times length for exact) is too long."""
    length = parse_shape(shape)[1]
    same = [r for r in done if r["kernel"] == kernel and r["mode"] == mode]
    for r in same:
        if (r["status"] in ("timeout", "out of memory") and n_tokens(r["shape"]) <= n_tokens(shape)
                and parse_shape(r["shape"])[1] <= length):
            return f"{r['shape']} already hit {r['status']}"
    finished = [r for r in same if r["status"] == "ok"]
    if finished:
        largest = max(finished, key=lambda r: n_tokens(r["shape"]))
        predicted = largest["seconds"] * n_tokens(shape) / n_tokens(largest["shape"])
        if kernel == "exact":
            predicted *= length / parse_shape(largest["shape"])[1]
        if predicted > args.max_seconds:
            return f"predicted {predicted:.0f} s per step > --max-seconds {args.max_seconds:.0f}"
    return None


def run_all(args) -> list[dict]:
    pp_installed = importlib.util.find_spec("performer_pytorch") is not None
    results = []
    for mode in args.modes:
        for kernel in args.kernels:
            for shape in args.shapes:
                reason = skip_reason(kernel, mode, shape, results, args)
                record = {"kernel": kernel, "mode": mode, "shape": shape}
                if kernel == PP and not pp_installed:
                    record |= {"status": "not installed", "reason": "pip install performer-pytorch==1.1.4"}
                elif reason:
                    record |= {"status": "skipped", "reason": reason}
                else:
                    record = run_config(kernel, mode, shape, args)
                results.append(record)
                shown = (f"{record['tokens_per_s']:8.0f} tokens/s  {record['seconds']:.3f} s/step  "
                         f"{record['rss_mib']:.0f} MiB" if record["status"] == "ok"
                         else f"{record['status']}: {record.get('reason', '')}")
                print(f"  {mode:13s} {kernel:17s} {shape:8s} {shown}", flush=True)
    return results


# ----------------------------------------------------------------------------- report
def goal_checks(lookup: dict, meta: dict) -> list[tuple[str, float | None, float]]:
    """(what, measured ratio or None, goal) for every goal ratio, from one run's records."""
    def seconds(kernel, mode, shape):
        record = lookup.get((kernel, mode, shape))
        return record["seconds"] if record and record["status"] == "ok" else None

    def ratio(numerator, denominator):
        return numerator / denominator if numerator and denominator else None

    checks = [(f"causal FAVOR+ speed-up over exact at {shape} (exact s/step / FAVOR+ s/step)",
               ratio(seconds("exact", "causal", shape), seconds("softmax", "causal", shape)), goal)
              for shape, goal in (("1x8192", 2.5), ("1x16384", 4.0))]
    checks += [(f"FAVOR+ / elu tokens/s, {mode} {shape}",
                ratio(seconds("elu", mode, shape), seconds("softmax", mode, shape)), 0.7)
               for mode in meta["modes"] for shape in meta["shapes"]]
    checks += [(f"FAVOR+ / exact tokens/s, {mode} 8x1024",
                ratio(seconds("exact", mode, "8x1024"), seconds("softmax", mode, "8x1024")), 1.0)
               for mode in meta["modes"]]
    return checks


def cell(record: dict | None) -> str:
    if record is None:
        return "—"
    if record["status"] != "ok":
        return record["status"]
    return f"{record['tokens_per_s']:.0f} ({record['seconds']:.3g} s, {record['rss_mib']:.0f} MiB)"


def write_report(results: list[dict], meta: dict, png_name: str) -> str:
    lookup = {(r["kernel"], r["mode"], r["shape"]): r for r in results}
    params = {r["kernel"]: r["params"] for r in results if "params" in r}
    notes = sorted({f"{LABELS[r['kernel']]}: {r['note']}" for r in results if r.get("note")})
    chunk_sizes = ", ".join(sorted({str(r["chunk_size"]) for r in results if r.get("chunk_size")}))
    torch_mib = common.machine_anchors()["torch_rss_mib"]
    lines = ["# Training-step benchmark", "",
             "Generated by `benchmarks/speed/training.py`; rerun it (or `--from-json`) instead of editing.", "",
             f"- command: `{meta['command']}`",
             f"- date: {meta['date']}" + (f", commit {meta['commit']}" if meta.get("commit") else "")
             + f", total wall time {meta['wall_minutes']:.1f} min",
             f"- machine: {meta['machine']}, torch {meta['torch']}, {meta['threads']} threads, fp32",
             f"- model: dim {meta['dim']}, depth {meta['depth']}, {meta['heads']} heads of "
             f"{meta['dim'] // meta['heads']}, ff x{meta['ff_mult']}, dropout 0, rotary, r = {meta['nb_features']} "
             f"(elu+1: r = head dim), no redraw, causal chunk size {chunk_sizes or 'model default'}, "
             + (f"{meta['local_heads']} local head(s) of exact attention within "
                f"{meta.get('local_window', 128)} residues in every linear model of this project (exact softmax "
                "and performer-pytorch have none)"
                if meta.get("local_heads") else "no local heads"),
             "- parameters: " + ", ".join(f"{LABELS[k]} {n / 1e6:.2f} M" for k, n in params.items()),
             f"- one step = forward + cross entropy over all positions + backward + AdamW step on random residue "
             f"tokens; 1 warm-up step, then the median of {meta['steps']}; cells are `tokens/s (s/step, peak RSS "
             f"MiB)`, the RSS of a process running only that configuration (~{torch_mib} MiB of it is Python + "
             "torch: docs/anchors.md)",
             f"- limits: a step over {meta['max_seconds']:.0f} s is a timeout, growth over {meta['max_mib']} MiB "
             "is out of memory (the worker's address space is capped); larger shapes after a failure, or "
             "predicted over the time limit, are skipped"]
    if PP in meta["kernels"]:
        lines.append("- performer-pytorch: its PerformerLM, same sizes, dim_head = dim / heads, no redraw, its rotary "
                     "positions, max_seq_len = L; causal on CPU runs `causal_linear_attention_noncuda` (chunked cumsum "
                     "keeping a d x r state per position for backward; fast-transformers' kernel needs CUDA)")
    lines += [f"- note: {note}" for note in notes] + [""]
    for mode in meta["modes"]:
        lines += [f"## {mode.capitalize()}", ""]
        lines += common.md_table(["kernel", *meta["shapes"]],
                                 [[LABELS[k], *(cell(lookup.get((k, mode, s))) for s in meta["shapes"])]
                                  for k in meta["kernels"]])
        lines.append("")
    failures = [r for r in results if r["status"] != "ok"]
    if failures:
        lines += ["Cells that did not run:", ""]
        lines += [f"- {r['mode']} {LABELS[r['kernel']]} {r['shape']}: {r['status']} ({r.get('reason', '')})"
                  for r in failures]
        lines.append("")
    lines += ["## Ratios (same run)", ""]
    lines += common.md_table(["ratio", "measured", "goal", ""],
                             [[what, "—" if value is None else f"{value:.2f}x", f">= {goal}x",
                               "not measured" if value is None else ("met" if value >= goal else "NOT met")]
                              for what, value, goal in goal_checks(lookup, meta)])
    lines += ["", f"![tokens/s per kernel]({png_name})", ""]
    return "\n".join(lines)


def plot(results: list[dict], meta: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(meta["modes"]), figsize=(6 * len(meta["modes"]), 4.5), squeeze=False)
    width = 0.8 / len(meta["kernels"])
    for ax, mode in zip(axes[0], meta["modes"]):
        for i, kernel in enumerate(meta["kernels"]):
            ok = {r["shape"]: r["tokens_per_s"] for r in results
                  if r["kernel"] == kernel and r["mode"] == mode and r["status"] == "ok"}
            xs = [j + i * width for j, s in enumerate(meta["shapes"]) if s in ok]
            ax.bar(xs, [ok[s] for s in meta["shapes"] if s in ok], width, label=LABELS[kernel])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(meta["shapes"]))], meta["shapes"])
        ax.set_yscale("log")
        ax.set_title(f"{mode}: one training step")
        ax.set_xlabel("batch x length")
        ax.set_ylabel("tokens/s")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


PAIRED_DOC = common.DOCS / "benchmarks_training_paired.md"


def paired_table(args) -> str:
    """The goal ratios measured paired: FAVOR+, elu+1 and exact built in one process and stepped in
    turn, rep by rep (the separate-process cells above drift 20-40 % between runs on a shared machine,
    more than the differences they compare); medians of the per-rep ratios."""
    import copy

    import torch
    import torch.nn.functional as F

    from protein_performer.tokenizer import Tokenizer

    set_malloc(args)
    torch.set_num_threads(args.threads)
    tokenizer, rows = Tokenizer(), []
    for mode, shape in itertools.product(args.modes, args.shapes):
        batch, length = parse_shape(shape)
        tokens = torch.randint(tokenizer.aa_offset, tokenizer.vocab_size, (batch, length),
                               generator=torch.Generator().manual_seed(0))
        steps = {}  # (kernel, r) -> one optimizer step; elu+1 and exact do not use r
        for kernel, r in [("softmax", r) for r in args.paired_features] + [("elu", None), ("exact", None)]:
            a = copy.copy(args)
            a.kernel, a.mode, a.nb_features = kernel, mode, r or args.nb_features
            torch.manual_seed(0)
            model = build_model(a, tokenizer.vocab_size, length)[0].train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                logits = model(tokens)
                F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens.reshape(-1)).backward()
                opt.step()
            steps[kernel, r] = step
        times = common.paired_times(steps, args.steps)

        def ratio(num, den):
            return common.paired_ratio(times, num, den)
        med = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
        for r in args.paired_features:
            favor = ("softmax", r)
            rows.append([mode, str(r), shape, *(f"{med[k]:.2f}" for k in (favor, ("elu", None), ("exact", None))),
                         f"{ratio(('elu', None), favor):.2f}", f"{ratio(('exact', None), favor):.2f}"])
            print("  " + " | ".join(rows[-1]), flush=True)
    lines = ["# Training step, paired: FAVOR+ against elu+1 and exact in one process", "",
             "Generated by `benchmarks/speed/training.py --paired` — do not edit by hand; rerun the script.", "",
             f"- command: `{args.command_line}` at commit {common.git_commit()}",
             f"- machine: {common.cpu()}, {os.cpu_count()} CPUs, {args.threads} threads, fp32; load average "
             f"{common.load_average()}; malloc: {args.malloc}",
             f"- model and step as docs/benchmarks_training.md (dim {args.dim}, depth {args.depth}, {args.heads} heads, "
             f"r = {' and '.join(map(str, args.paired_features))} for FAVOR+, {args.local_heads} local head(s) of "
             f"{LOCAL_WINDOW} residues beside FAVOR+'s and elu+1's, none beside exact); the models (FAVOR+ at "
             "each r, elu+1, exact) are built in one process and stepped in turn, rep by rep, "
             f"{args.steps} reps after a warm-up round; s/step medians, ratios the medians of the per-rep ratios",
             "- issue 19's goals: FAVOR+ / elu+1 tokens/s >= 0.7 (= the elu/FAVOR+ time ratio); causal FAVOR+ over "
             "exact >= 2.5x at 1 x 8,192 and 4x at 1 x 16,384; FAVOR+ / exact tokens/s >= 1 at 8 x 1,024", ""]
    lines += common.md_table(["mode", "FAVOR+ r", "shape", "FAVOR+ s", "elu+1 s", "exact s", "FAVOR+ / elu+1 tokens/s",
                              "FAVOR+ / exact tokens/s"], rows)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help=f"batch x length list (default {SHAPES})")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--modes", default="bidirectional,causal")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, 2 steps, output under /tmp")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (as train.py compile=true)")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="per-step time limit (observed or predicted)")
    ap.add_argument("--max-mib", type=int, default=12288, help="memory a worker may add after building its model")
    ap.add_argument("--malloc", choices=("keep", "system"), default="keep",
                    help="keep: glibc reuses freed memory, as train.py sets it (default); system: glibc's defaults")
    for option, default in MODEL_OPTIONS.items():
        ap.add_argument("--" + option.replace("_", "-"), type=int, default=default)
    ap.add_argument("--out", type=Path, default=None, help="markdown report; .png and .json go beside it "
                    "(default docs/benchmarks_training.md, with --quick /tmp/benchmarks_training_quick/)")
    ap.add_argument("--from-json", type=Path, default=None, help="rebuild report + plot from an earlier run's JSON")
    ap.add_argument("--paired", action="store_true", help="FAVOR+, elu+1 and exact in one process, stepped in turn "
                    f"(the goal ratios without the drift between processes) -> {PAIRED_DOC.name}")
    ap.add_argument("--paired-features", default=PAIRED_FEATURES, help="--paired: FAVOR+'s r values (default "
                    f"{PAIRED_FEATURES}: the default model's and the earlier benchmark's)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kernel", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--vs-compiled", action="store_true", help="the default model eager against compile=true, "
                    "paired (benchmarks/speed/compiled_step.py) -> docs/benchmarks_compile.md")
    args = ap.parse_args()
    if args.vs_compiled:
        from benchmarks.speed import compiled_step
        compiled_step.main(["--threads", str(args.threads)])
        return
    args.steps = args.steps or (2 if args.quick else 3)
    if args.worker:
        worker(args)
        return
    if args.paired:
        args.shapes, args.modes = (args.shapes or SHAPES).split(","), args.modes.split(",")
        for shape in args.shapes:
            if not re.fullmatch(r"\d+x\d+", shape):
                ap.error(f"--shapes: {shape!r} is not BATCHxLENGTH (e.g. 8x1024)")
        if set(args.modes) - {"bidirectional", "causal"}:
            ap.error(f"--modes: {args.modes}; choose from bidirectional,causal")
        if not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", args.paired_features):
            ap.error(f"--paired-features: {args.paired_features!r} is not a list of positive integers (e.g. 128,256)")
        args.paired_features = [int(r) for r in args.paired_features.split(",")]
        args.command_line = common.command_line(__file__)
        text = paired_table(args)
        out = args.out or PAIRED_DOC
        common.write_doc(out, text, keep_below=True)  # hand-written notes below the marker survive a rerun
        print(text + f"\n\nwrote {out}")
        return
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        meta, results = saved["meta"], saved["results"]
        out = args.out or args.from_json.with_suffix(".md")
    else:
        out = args.out or (Path("/tmp/benchmarks_training_quick/benchmarks_training.md") if args.quick
                           else common.DOCS / "benchmarks_training.md")
        args.shapes = (args.shapes or (QUICK_SHAPES if args.quick else SHAPES)).split(",")
        args.kernels, args.modes = args.kernels.split(","), args.modes.split(",")
        unknown = set(args.kernels) - set(KERNELS)
        if unknown:
            ap.error(f"unknown kernels {sorted(unknown)}; choose from {','.join(KERNELS)}")
        meta = {"command": common.command_line(__file__),
                "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "commit": common.git_commit(),
                "machine": f"{platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs",
                "torch": importlib.metadata.version("torch"), "kernels": args.kernels, "modes": args.modes,
                "shapes": args.shapes, "compile": args.compile, "local_window": LOCAL_WINDOW,
                **{k: getattr(args, k) for k in WORKER_OPTIONS}}
        wall_start = time.time()
        results = run_all(args)
        meta["wall_minutes"] = (time.time() - wall_start) / 60
        print(f"total {meta['wall_minutes']:.1f} min")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.from_json:
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    report = write_report(results, meta, out.with_suffix(".png").name)
    common.write_doc(out, report, keep_below=True)  # hand-written analysis below the marker survives a rerun
    plot(results, meta, out.with_suffix(".png"))
    print("\n" + report)
    print(f"wrote {out}, {out.with_suffix('.png').name}" + ("" if args.from_json else ", and .json beside it"))


if __name__ == "__main__":
    main()

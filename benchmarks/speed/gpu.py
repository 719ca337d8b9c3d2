#!/usr/bin/env python
"""GPU benchmark (issue 42): what users run, on one CUDA device, written row by row to
docs/benchmarks_gpu.md and a JSON file (each row as soon as it is measured, so a killed run keeps
its rows).

1. The LM training step as training runs it: bf16 autocast, forward, cross entropy (masked LM for the
   bidirectional model, next token for the causal one), backward, AdamW; at L = 1k, 4k, 16k, 64k with
   batch = max(1, 65,536 // L) (64k tokens a step).  Models composed from conf/ like
   ``scripts/train.py model=VARIANT [model/size=SIZE]``: the default model (conf/model/base.yaml:
   FAVOR+ r = 64 and one local head of 128 residues), and the 35m and 150m presets (ESM-2's shapes,
   conf/model/size/), each against the same model with exact attention (``model=transformer``: SDPA on
   its FlashAttention backend) and with elu+1 (``model=linear``).  ``model.attention.backend=auto``;
   the path each row ran is read from its attention layers after the first step.  Median of 3 timed
   steps after 2 warm-ups (CUDA events); peak = torch.cuda.max_memory_allocated over the row.
2. Embedding one protein of 35,000 residues with an ESM-2-650M-shaped model (33 layers, dim 1280,
   20 heads; ``model/size=650m``, random weights) through the embed command's Embedder (bf16 autocast,
   inference mode): the default attention, elu+1, exact; time and peak memory.
3. Seconds from model build to the end of the first training step, per backend (auto, parallel,
   torch, fla; exact beside them), the default model, causal, 16 x 4,096 tokens.  Goal: <= 30 s.
4. Compiled steps (issue 63): the default model and exact attention as section 1 runs them, compiled as
   ``compile=true`` does (training/compiled.py: fullgraph, static shape) in the default mode and in
   ``compile_mode=reduce-overhead`` (CUDA graphs: a step replayed with one launch), at L = 16k, 4k and
   64k (that order), bidirectional and causal; beside each, section 1's eager row.  Goals: the default
   model's best step >= 1x exact's best at 4k, >= 3x at 16k, >= 6x at 64k.

Rows not started within ``--budget`` seconds say "not run (budget)"; a row that runs out of memory
says "OOM"; a backend that refuses this machine (fla on a stack it cannot run) says why.  The rows
run in order of priority (3, then 1 for the default model, 2, then 1 for the presets); the doc shows
them by section.  Nothing here depends on fla working.

    python benchmarks/speed/gpu.py                                  # about 2 minutes on one H200 (the check's budget)
    python benchmarks/speed/gpu.py --budget 1800                    # every row
    python benchmarks/speed/gpu.py --device cpu --quick --out /tmp/b.md   # a tiny smoke run on the CPU (its test)
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

TOKENS = 65536                              # tokens per training step: batch = max(1, TOKENS // L)
LENGTHS = [1024, 4096, 16384, 65536]
MODELS = {"default": [], "35m": ["model/size=35m"], "150m": ["model/size=150m"]}
KERNELS = {"default": "performer", "elu": "linear", "exact": "transformer"}   # the conf/model variant of each
KERNEL_NAMES = {"default": "FAVOR+ (default)", "elu": "elu+1", "exact": "exact (SDPA)"}
EMBED_SIZE, EMBED_LENGTH = "650m", 35000
STARTUP_BACKENDS = ["auto", "parallel", "torch", "fla"]
STARTUP_L = 4096
STARTUP_GOAL_S = 30.0
COMPILE_LENGTHS = [16384, 4096, 65536]       # section 4, in order of priority
COMPILE_MODES = ["default", "reduce-overhead"]
WARMUP, REPEATS = 2, 3
# --quick: every model shrunk to this, L = 64 and 256, 512 tokens a step, a protein of 300 residues
QUICK = dict(lengths=[64, 256], tokens=512, shrink=["model.depth=1", "model.dim=32", "model.heads=2"],
             embed_length=300, startup_l=128, models=["default", "35m"],
             compiled=dict(lengths=[64], directions=["bidirectional"], kernels=["default"], modes=["reduce-overhead"]))
AMINO = "ACDEFGHIKLMNPQRSTVWY"


# ----------------------------------------------------------------------------- facts
def versions() -> dict:
    import torch
    out = {"torch": torch.__version__, "cuda": torch.version.cuda or "-"}
    for pkg in ("triton", "fla-core", "flash-linear-attention", "flash-attn"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def machine(device) -> dict:
    import torch
    if device.type != "cuda":
        return {"device": f"CPU ({common.cpu()}, {os.cpu_count()} cores)", "driver": "-"}
    facts = {"device": torch.cuda.get_device_name(device), "driver": "unknown",
             "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2 ** 30, 1)}
    try:
        facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    return facts


def commit() -> str:
    sha = common.git_commit()
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=common.ROOT, timeout=10)
        if dirty.returncode == 0 and dirty.stdout.strip():
            sha += " + uncommitted changes"
    except (OSError, subprocess.SubprocessError):
        pass
    return sha


# ----------------------------------------------------------------------------- models from conf/
_composed: dict = {}


def model_config(variant: str, size: list[str], causal: bool, extra: list[str]):
    """The ModelConfig ``scripts/train.py model=VARIANT [model/size=...] EXTRA`` builds (``causal`` as the
    clm objective sets it)."""
    from omegaconf import OmegaConf

    from protein_performer.compare import compose_train_config
    from protein_performer.model import ModelConfig
    key = (variant, tuple(size), tuple(extra))
    if key not in _composed:
        cfg = compose_train_config([f"model={variant}", *size, *extra])
        _composed[key] = OmegaConf.to_container(cfg.model, resolve=True)
    return ModelConfig.from_dict(_composed[key], causal=causal)


def shape(config) -> dict:
    a = config.attention
    return {"dim": config.dim, "depth": config.depth, "heads": config.heads, "ff_mult": config.ff_mult,
            "kernel": a.kernel, "nb_features": a.nb_features, "local_heads": a.local_heads,
            "local_window": a.local_window}


def ran(net, kernel: str, flash: bool) -> str:
    """The path the kernel heads ran: read from the attention layers (resolved at the first forward);
    exact attention: SDPA, held to its FlashAttention backend (``flash``) on a GPU."""
    if kernel == "exact":
        return "sdpa flash" if flash else "sdpa"
    paths = {b.attn._resolved[1] for b in net.blocks if getattr(b.attn, "_resolved", None)}
    return ",".join(sorted(paths)) or "?"


# ----------------------------------------------------------------------------- the runner
class Bench:
    def __init__(self, args, device):
        import torch
        self.args, self.dev, self.torch = args, device, torch
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.measured = 0
        self.broken: str | None = None           # a CUDA error poisons the context: no row runs after it
        self.facts, self.versions, self.commit = machine(device), versions(), commit()
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.cached: tuple | None = None         # (key, net, opt): one model serves the lengths of a series
        self.finished = False

    # -- timing
    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def timed(self, fn) -> float:
        """Seconds of one call: CUDA events on a GPU, the wall clock on the CPU."""
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def reset_peak(self):
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.dev)

    def peak_gib(self):
        return self.torch.cuda.max_memory_allocated(self.dev) / 2 ** 30 if self.cuda else None

    def autocast(self):
        return self.torch.autocast("cuda", dtype=self.torch.bfloat16) if self.cuda else contextlib.nullcontext()

    def sdpa(self, kernel: str, flash: bool):
        if kernel != "exact" or not self.cuda or not flash:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)

    def free(self):
        self.cached = None
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    # -- rows
    def plan(self, **row) -> dict:
        row.setdefault("status", "pending")
        self.rows.append(row)
        return row

    def run(self, row: dict, fn) -> None:
        """Measure one row with ``fn(row) -> dict`` unless over budget; write the files either way."""
        torch = self.torch
        if self.broken:
            row["status"] = f"not run ({self.broken})"
        elif time.perf_counter() - self.t0 > self.args.budget:
            row["status"] = "not run (budget)"
        else:
            row["status"] = "running"
            self.write()
            status = "ok"
            try:
                row.update(fn(row))
            except torch.cuda.OutOfMemoryError:
                status = "OOM"
            except Exception as e:  # noqa: BLE001 - one row's failure is that row's cell, the others go on
                from protein_performer.errors import UserError
                text = " ".join(str(e).split())
                if isinstance(e, UserError):
                    status = f"refused: {text[:300]}"
                elif "out of memory" in text.lower():
                    status = "OOM"
                else:
                    status = f"error: {type(e).__name__}: {text[:300]}"
                    if self.cuda and ("CUDA error" in text or "illegal memory" in text
                                      or type(e).__name__ == "AcceleratorError"):
                        self.broken = "a CUDA error in an earlier row"
            row["status"] = status
            if status != "ok":
                self.free()
            self.measured += 1
        self.write()
        if self.args.stop_after_rows and self.measured >= self.args.stop_after_rows and row["status"] != "pending":
            os._exit(3)  # testing aid: ends the process as a kill would, after this row's files are written

    # -- 1 and 3: the training step
    def batch(self, batch: int, L: int, causal: bool):
        import torch

        from protein_performer.objectives import clm_labels, mask_tokens
        from protein_performer.tokenizer import Tokenizer
        tok = Tokenizer()
        g = torch.Generator().manual_seed(L)
        aa = torch.tensor(tok.standard_aa_ids)
        ids = aa[torch.randint(len(aa), (batch, L + int(causal)), generator=g)]
        inputs, labels = clm_labels(ids, tok.pad_id) if causal else mask_tokens(ids, tok, g)
        return inputs.to(self.dev), labels.to(self.dev)

    def config(self, variant, size, causal, backend):
        return model_config(variant, size, causal, list(self.args.shrink) + [f"model.attention.backend={backend}"])

    def build(self, config):
        import torch

        from protein_performer.model import PerformerLM
        torch.manual_seed(0)
        net = PerformerLM(config).to(self.dev).train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        return net, opt

    def train_row(self, row: dict, *, variant: str, size: list[str], causal: bool, L: int, batch: int,
                  backend: str = "auto", steps: bool = True, reuse: bool = True, compile_mode: str | None = None) -> dict:
        """One row of sections 1 / 3 / 4: (build,) the first step, then WARMUP - 1 more and REPEATS timed;
        ``compile_mode``: compiled as compile=true does, in that mode (a fresh model, not kept)."""
        import torch
        import torch.nn.functional as F

        from protein_performer.attention.layer import count_forwards
        from protein_performer.training.compiled import compile_model
        kernel = row["kernel"]
        key = (variant, tuple(size), causal, backend)
        reuse = reuse and compile_mode is None
        self.reset_peak()
        start = time.perf_counter()
        if reuse and self.cached and self.cached[0] == key:
            _, config, net, opt = self.cached
            built = False
        else:
            self.free()
            config = self.config(variant, size, causal, backend)   # composed (Hydra) before the clock starts
            self.reset_peak()
            start = time.perf_counter()
            net, opt = self.build(config)
            if compile_mode is not None:
                compile_model(net, self.dev, compile_mode)
            built = True
        self.cached = None
        inputs, labels = self.batch(batch, L, causal)
        flash = [self.cuda]

        def step():
            if compile_mode is not None:
                count_forwards(net)
            with self.sdpa(kernel, flash[0]), self.autocast():
                logits = net(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        try:
            step()
        except RuntimeError as e:  # no FlashAttention kernel for this shape: SDPA's own choice, said so
            if kernel != "exact" or "No available kernel" not in str(e):
                raise
            flash[0] = False
            step()
        self.sync()
        first = time.perf_counter() - start
        out = {"shape": shape(config), "ran": ran(net, kernel, flash[0]), "dtype": "bf16 autocast" if self.cuda else
               "float32"}
        if built:
            out["build_to_first_step_s"] = first
        if steps:
            limit = self.args.row_limit
            for _ in range(WARMUP - 1):
                if time.perf_counter() - start > limit / 2:
                    break
                step()
            times = []
            for _ in range(REPEATS):
                times.append(self.timed(step))
                if time.perf_counter() - start > limit:
                    break
            ms = statistics.median(times) * 1e3
            out.update(ms=ms, times_ms=[t * 1e3 for t in times], n=len(times), tokens_per_s=batch * L / (ms / 1e3))
        out["peak_gib"] = self.peak_gib()
        if reuse:
            self.cached = (key, config, net, opt)
        return out

    # -- 2: embedding
    def embed_row(self, row: dict, *, variant: str, L: int) -> dict:
        import numpy as np
        import torch

        from protein_performer.embed.embedder import Embedder
        from protein_performer.model import PerformerLM
        from protein_performer.tokenizer import Tokenizer
        self.free()
        config = model_config(variant, [f"model/size={EMBED_SIZE}"], False, list(self.args.shrink))
        torch.manual_seed(0)
        net = PerformerLM(config).to(self.dev).eval()
        kernel = row["kernel"]
        emb = Embedder(net, [config.depth], ["mean"], precision="bf16" if self.cuda else "32",
                       kernel=config.attention.kernel)
        tok = Tokenizer()
        seq = "".join(np.random.default_rng(0).choice(list(AMINO), L))
        batch = [tok.encode(seq)]
        flash = [self.cuda]

        def forward():
            with self.sdpa(kernel, flash[0]):
                return emb.forward(batch, tok.pad_id)
        self.reset_peak()
        start = time.perf_counter()
        try:
            first = forward()
        except RuntimeError as e:
            if kernel != "exact" or "No available kernel" not in str(e):
                raise
            flash[0] = False
            first = forward()
        vec = first[0]["pooled"]["mean"][config.depth]
        if not np.isfinite(vec).all():
            raise FloatingPointError("the embedding holds NaN or inf")
        times = []
        for _ in range(REPEATS):
            times.append(self.timed(forward))
            if time.perf_counter() - start > self.args.row_limit:
                break
        ms = statistics.median(times) * 1e3
        return {"shape": shape(config), "ran": ran(net, kernel, flash[0]), "ms": ms,
                "times_ms": [t * 1e3 for t in times],
                "n": len(times), "peak_gib": self.peak_gib(), "residues_per_s": L / (ms / 1e3),
                "dtype": "bf16 autocast" if self.cuda else "float32"}

    # -- files
    def write(self) -> None:
        data = {"facts": self.facts, "versions": self.versions, "commit": self.commit, "date": self.date,
                "command": self.command(), "budget_s": self.args.budget, "finished": self.finished,
                "elapsed_s": time.perf_counter() - self.t0, "rows": self.rows}
        atomic_write(Path(self.args.json), json.dumps(data, indent=1, default=str) + "\n")
        atomic_write(Path(self.args.out), report(self), keep_below=True)

    def command(self) -> str:
        return common.command_line(Path(__file__), self.args.argv)


def atomic_write(path: Path, text: str, keep_below: bool = False) -> None:
    """Write beside, flush to disk, rename over: a reader (or a kill) never sees half a file.  With
    ``keep_below``, what stands below common.KEEP_BELOW in the old file is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if keep_below:
        old = path.read_text() if path.is_file() else ""
        kept = old.split(common.KEEP_BELOW, 1)[1] if common.KEEP_BELOW in old else "\n"
        text = text.rstrip("\n") + "\n\n" + common.KEEP_BELOW + kept
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- report
def _num(x, fmt="{:,.1f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return {"pending": "not reached", "running": "running (or stopped in it)"}.get(r["status"], r["status"])
    text = f"{r['ms']:,.1f}" + (f" ({r['peak_gib']:.1f})" if r.get("peak_gib") is not None else "")
    return text + ("" if r.get("n", REPEATS) >= REPEATS else f" [n={r['n']}]")


def ratio(a: dict | None, b: dict | None) -> str:
    """a's time / b's time, where both were measured."""
    if not a or not b or a["status"] != "ok" or b["status"] != "ok":
        return "-"
    return f"{a['ms'] / b['ms']:.2f}x"


def describe(s: dict | None) -> str:
    if not s:
        return "shape not read yet"
    if s["kernel"] == "exact":
        att = "exact attention in every head"
    else:
        att = {"elu": "elu+1", "softmax": f"FAVOR+ r = {s['nb_features']}"}.get(
            s["kernel"], f"{s['kernel']} r = {s['nb_features']}")
        if s["local_heads"]:
            att += f", {s['local_heads']} local head(s) of {s['local_window']}"
    return f"depth {s['depth']}, dim {s['dim']}, {s['heads']} heads, ff {s['ff_mult']} x dim; {att}"


def report(b: Bench) -> str:
    a = b.args
    done = [r for r in b.rows if r["status"] == "ok"]
    state = ("complete" if b.finished and all(r["status"] not in ("pending", "running") for r in b.rows)
             else "IN PROGRESS, or stopped before its end: rows marked 'not reached' were not measured")
    lines = ["# GPU benchmarks" if b.cuda else "# GPU benchmark, CPU smoke run (not GPU figures)", "",
             f"Measured on **{b.facts['device']}** (driver {b.facts['driver']}), {b.date}, commit {b.commit}, "
             f"command `{b.command()}`. Versions: " + ", ".join(f"{k} {v}" for k, v in b.versions.items()) + ".",
             "", f"Run {state}; {len(done)} of {len(b.rows)} rows measured, budget {a.budget:.0f} s "
             f"(rows not started within it: 'not run (budget)'). Raw rows: `{Path(a.json).name}` "
             "(benchmarks/gpu_check.sh --out DIR: in DIR).", ""]
    dtype = "bf16 autocast" if b.cuda else "float32 (CPU)"
    lines += ["## 1. LM training step", "",
              f"{dtype}, forward + cross entropy + backward + AdamW step; batch = max(1, {a.tokens:,} // L) "
              f"({a.tokens:,} tokens a step); bidirectional = masked LM (15 %), causal = next token. Milliseconds "
              f"per step, median of {REPEATS} timed steps after {WARMUP} warm-ups "
              f"({'CUDA events' if b.cuda else 'wall clock'}); in brackets the peak GiB allocated over the row "
              "(weights, AdamW state, activations). `model.attention.backend=auto`; 'ran' is the path the kernel "
              "heads took, read from the model after its first step. Exact attention runs on SDPA's "
              "FlashAttention backend ('sdpa' where it had no kernel for the shape). [n=k]: fewer timed steps "
              f"(a row stops timing after {a.row_limit:.0f} s).", ""]
    train = [r for r in b.rows if r["section"] == "train"]
    for model in dict.fromkeys(r["model"] for r in train):
        for direction in ("bidirectional", "causal"):
            rows = [r for r in train if r["model"] == model and r["direction"] == direction]
            if not rows:
                continue
            shapes = {k: next((r.get("shape") for r in rows if r["kernel"] == k and r.get("shape")), None)
                      for k in KERNELS}
            label = "default model (conf/model/base.yaml)" if model == "default" else f"preset model/size={model}"
            lines += [f"### {label}, {direction}", "", f"FAVOR+: {describe(shapes['default'])}.", ""]
            header = ["batch x L", *(f"{KERNEL_NAMES[k]} ms (GiB)" for k in KERNELS), "exact / FAVOR+",
                      "exact / elu+1", "FAVOR+ / elu+1", "FAVOR+ tokens/s", "ran (FAVOR+; elu+1)"]
            table = []
            for L in dict.fromkeys(r["L"] for r in rows):
                by = {r["kernel"]: r for r in rows if r["L"] == L}
                d, e, x = by.get("default"), by.get("elu"), by.get("exact")
                table.append([f"{d['batch']} x {L:,}", cell(d), cell(e), cell(x), ratio(x, d), ratio(x, e), ratio(d, e),
                              _num(d.get("tokens_per_s"), "{:,.0f}") if d else "-",
                              f"{d.get('ran', '-') if d else '-'}; {e.get('ran', '-') if e else '-'}"])
            lines += common.md_table(header, table) + [""]
    embed = [r for r in b.rows if r["section"] == "embed"]
    if embed:
        s = next((r.get("shape") for r in embed if r.get("shape")), None)
        L = embed[0]["L"]
        lines += ["## 2. Embedding one long protein, ESM-2 650M shape", "",
                  f"One protein of {L:,} residues, model/size={EMBED_SIZE} ("
                  + (f"depth {s['depth']}, dim {s['dim']}, {s['heads']} heads" if s else "shape not read yet")
                  + f"), random weights, the embed command's Embedder ({'bf16 autocast' if b.cuda else 'float32'}, "
                  "inference mode, mean of the last layer): milliseconds (median of up to "
                  f"{REPEATS} after one warm-up) and the peak GiB allocated (weights included).", ""]
        exact = next((r for r in embed if r["kernel"] == "exact"), None)
        table = [[KERNEL_NAMES[r["kernel"]], cell(r), ratio(exact, r) if r is not exact else "1.00x", r.get("ran", "-"),
                  _num(r.get("residues_per_s"), "{:,.0f}")] for r in embed]
        lines += common.md_table(["attention", "ms (GiB)", "exact / this", "ran", "residues/s"], table) + [""]
    start = [r for r in b.rows if r["section"] == "startup"]
    if start:
        r0 = start[0]
        lines += ["## 3. From model build to the end of the first training step", "",
                  f"The default model (and its exact twin), causal, {r0['batch']} x {r0['L']:,} tokens, {dtype}: "
                  "seconds from building the model (composed from conf/) to the end of its first training step, "
                  "compiles included, in this order in one process (CUDA initialised before the first row; a "
                  f"backend that ran a path an earlier row ran finds it warm). Goal: <= {STARTUP_GOAL_S:.0f} s.", ""]
        table = []
        for r in start:
            s = r.get("build_to_first_step_s")
            goal = "-" if s is None else ("met" if s <= STARTUP_GOAL_S else "NOT met")
            table.append([r["backend"] if r["kernel"] != "exact" else "exact (SDPA)", r.get("ran", "-"),
                          _num(s, "{:.2f}") if r["status"] == "ok" else cell(r), goal])
        lines += common.md_table(["backend", "ran", "seconds", f"<= {STARTUP_GOAL_S:.0f} s"], table) + [""]
    lines += compiled_report(b, dtype)
    return "\n".join(lines) + "\n"


def compiled_report(b: "Bench", dtype: str) -> list[str]:
    """Section 4's table: eager (section 1's row), compiled and reduce-overhead per kernel, and the
    default model's best against exact's best."""
    rows = [r for r in b.rows if r["section"] == "compiled"]
    if not rows:
        return []
    eager = {(r["direction"], r["kernel"], r["L"]): r for r in b.rows if r["section"] == "train" and r["model"] == "default"}
    lines = ["## 4. Compiled steps (compile=true; compile_mode=reduce-overhead: CUDA graphs)", "",
             f"The default model and exact attention, {dtype}, as section 1 (its eager rows beside); compiled as "
             "training/compiled.py does (fullgraph, static shape), the first step (the compile) not timed. "
             "best = the fastest of a kernel's three rows; goal: FAVOR+ best >= 1x exact best at 4k, 3x at 16k, "
             "6x at 64k.", ""]
    table = []
    for direction in ("bidirectional", "causal"):
        for L in dict.fromkeys(r["L"] for r in rows):
            by = {(r["kernel"], r["compile_mode"]): r for r in rows if r["direction"] == direction and r["L"] == L}
            if not by:  # --quick plans one direction
                continue
            cells, best = [], {}
            for kernel in ("default", "exact"):
                trio = [eager.get((direction, kernel, L))] + [by.get((kernel, m)) for m in COMPILE_MODES]
                cells += [cell(r) for r in trio]
                ok = [r for r in trio if r and r.get("status") == "ok" and r.get("ms")]
                best[kernel] = min(ok, key=lambda r: r["ms"]) if ok else None
            batch = next(iter(by.values()))["batch"]
            table.append([direction, f"{batch} x {L:,}", *cells, ratio(best["exact"], best["default"])])
    header = ["direction", "batch x L", *(f"{KERNEL_NAMES[k]} {m} ms (GiB)" for k in ("default", "exact")
                                          for m in ("eager", *COMPILE_MODES)), "exact best / FAVOR+ best"]
    return lines + common.md_table(header, table) + [""]


# ----------------------------------------------------------------------------- main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run: pass --out)")
    p.add_argument("--quick", action="store_true", help="tiny models (depth 1, dim 32, 2 heads), L = 64 and 256")
    p.add_argument("--budget", type=float, default=110.0, help="start no new row after this many seconds")
    p.add_argument("--row-limit", type=float, default=20.0,
                   help="a row stops its warm-ups / timed steps after this many seconds (its n says how many)")
    p.add_argument("--models", default=None, help="comma-separated, of: " + ", ".join(MODELS))
    p.add_argument("--lengths", default=None, help="comma-separated L of section 1")
    p.add_argument("--sections", default="1,2,3,4",
                   help="which sections to run (1 training, 2 embedding, 3 startup, 4 compiled)")
    p.add_argument("--out", default=None, help="the markdown (default on a GPU: docs/benchmarks_gpu.md)")
    p.add_argument("--json", default=None, help="the raw rows (default: --out with .json)")
    p.add_argument("--stop-after-rows", type=int, default=0, help=argparse.SUPPRESS)  # tests: exit as a kill would
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    import torch
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/speed/gpu.py needs a CUDA GPU (or --device cpu --quick --out FILE for a smoke run)")
    if args.out is None:
        if device.type != "cuda":
            sys.exit("--device cpu: pass --out FILE (docs/benchmarks_gpu.md is for GPU figures)")
        args.out = str(common.DOCS / "benchmarks_gpu.md")
    args.json = args.json or str(Path(args.out).with_suffix(".json"))
    q = QUICK if args.quick else {}
    args.tokens = q.get("tokens", TOKENS)
    args.shrink = q.get("shrink", [])
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else q.get("lengths", LENGTHS)
    models = args.models.split(",") if args.models else q.get("models", list(MODELS))
    for m in models:
        if m not in MODELS:
            sys.exit(f"--models: {m!r} is not one of {', '.join(MODELS)}")
    sections = set(args.sections.split(","))

    b = Bench(args, device)
    if b.cuda:  # CUDA context and cuBLAS made before any row: not counted in section 3
        x = torch.randn(256, 256, device=device)
        (x @ x).sum().item()

    # the plan, in the doc's order; measured in order of priority below
    startup_l = q.get("startup_l", STARTUP_L)
    startup = []
    if "3" in sections:
        for backend in STARTUP_BACKENDS + ["exact"]:
            kernel = "exact" if backend == "exact" else "default"
            startup.append(b.plan(section="startup", model="default", direction="causal", kernel=kernel,
                                  backend="auto" if backend == "exact" else backend, L=startup_l,
                                  batch=max(1, args.tokens // startup_l)))
    train = {}
    if "1" in sections:
        for model in models:
            for direction in ("bidirectional", "causal"):
                for kernel in KERNELS:
                    for L in lengths:
                        train[model, direction, kernel, L] = b.plan(
                            section="train", model=model, direction=direction, kernel=kernel, backend="auto", L=L,
                            batch=max(1, args.tokens // L))
    compiled = []
    if "4" in sections:  # --quick: one compile (inductor on a CPU takes tens of seconds a graph)
        c = q.get("compiled", {})
        for L in c.get("lengths", COMPILE_LENGTHS):
            for direction in c.get("directions", ["bidirectional", "causal"]):
                for kernel in c.get("kernels", ["default", "exact"]):
                    for mode in c.get("modes", COMPILE_MODES):
                        compiled.append(b.plan(section="compiled", model="default", direction=direction, kernel=kernel,
                                               backend="auto", L=L, batch=max(1, args.tokens // L), compile_mode=mode))
    embed = []
    if "2" in sections:
        for kernel in KERNELS:
            embed.append(b.plan(section="embed", model=EMBED_SIZE, direction="bidirectional", kernel=kernel,
                                backend="auto", L=q.get("embed_length", EMBED_LENGTH), batch=1))
    b.write()

    for r in startup:
        b.run(r, lambda r: b.train_row(r, variant=KERNELS[r["kernel"]], size=[], causal=True, L=r["L"],
                                       batch=r["batch"], backend=r["backend"], steps=False, reuse=False))

    for r in compiled:  # after startup: what issue 63 asks of a GPU comes before the rest
        b.run(r, lambda r: b.train_row(r, variant=KERNELS[r["kernel"]], size=[], causal=r["direction"] == "causal",
                                       L=r["L"], batch=r["batch"], compile_mode=r["compile_mode"]))
    b.free()

    def series(model):
        for direction in ("bidirectional", "causal"):
            for kernel in KERNELS:
                for L in lengths:
                    r = train[model, direction, kernel, L]
                    b.run(r, lambda r: b.train_row(r, variant=KERNELS[r["kernel"]], size=MODELS[r["model"]],
                                                   causal=r["direction"] == "causal", L=r["L"], batch=r["batch"]))
        b.free()
    if "default" in models and train:
        series("default")
    for r in embed:
        b.run(r, lambda r: b.embed_row(r, variant=KERNELS[r["kernel"]], L=r["L"]))
    b.free()
    for model in models:
        if model != "default" and train:
            series(model)
    b.finished = True
    b.write()
    print(Path(args.out).read_text().split(common.KEEP_BELOW)[0])
    print(f"written: {args.out}, {args.json}")


if __name__ == "__main__":
    main()

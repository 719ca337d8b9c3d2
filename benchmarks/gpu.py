#!/usr/bin/env python
"""GPU benchmark (issue 20): causal attention forward+backward and the LM training step on one CUDA
device, side by side in one process, written to docs/benchmarks_gpu.md with the GPU's name, the
driver and the versions.

1. Attention core, bf16, batch 1, 8 heads, head dim 64, L = 1k ... 64k: FAVOR+ (r = 256) through
   fla (fla_backend.py) and through the torch chunked path (linear.py), elu+1 (r = 64) through
   fla, exact causal SDPA on its FlashAttention backend, and flash-attn's own kernel when it is
   installed.  Timed: the gradient of sum(out * g) w.r.t. q, k, v (feature maps included).
2. The LM training step (forward, cross entropy, backward, AdamW; bf16 autocast) at 1 x 8k / 16k /
   32k, FAVOR+ (backend fla, and torch) against exact attention: tokens/s and peak memory.

Every figure is the median of ``--repeats`` timed calls after ``--warmup`` untimed ones (the first
calls compile fla's Triton kernels), timed with CUDA events; peak memory is
torch.cuda.max_memory_allocated over the timed calls, inputs included.  A row that runs out of
memory says so; measurements not started within ``--budget`` seconds (60 % of it for the attention
rows) say that instead.

    python benchmarks/gpu.py                    # about 2-3 minutes on one H200
    python benchmarks/gpu.py --quick            # L = 1k, 4k; LM at 8k: a smoke run
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks import common  # noqa: E402

LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
LM_LENGTHS = [8192, 16384, 32768]
LM = dict(dim=512, depth=4, heads=8, ff_mult=4, dropout=0.0)   # head dim 64, as the attention rows
HEADS, HEAD_DIM, FEATURES = 8, 64, 256
METHODS = {"favor_fla": "FAVOR+ via fla", "favor_torch": "FAVOR+ via torch", "elu_fla": "elu+1 via fla (r = 64)",
           "sdpa": "exact SDPA (flash)", "flash_attn": "flash-attn"}
LM_METHODS = {"favor_fla": "FAVOR+ (backend fla)", "favor_torch": "FAVOR+ (backend torch)", "exact": "exact (SDPA)"}


class OutOfBudget(Exception):
    pass


def versions() -> dict:
    import torch
    out = {"torch": torch.__version__, "cuda": torch.version.cuda or "-"}
    for pkg in ("triton", "fla-core", "flash-linear-attention", "flash-attn"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def gpu_facts() -> dict:
    import torch
    facts = {"gpu": torch.cuda.get_device_name(0), "driver": "unknown"}
    try:
        facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    return facts


class Clock:
    """Median CUDA-event time of ``fn`` and the peak memory over the timed calls; a global budget."""

    def __init__(self, budget_s: float, warmup: int, repeats: int):
        self.deadline, self.warmup, self.repeats = time.perf_counter() + budget_s, warmup, repeats

    def __call__(self, fn) -> tuple[float, float]:
        import torch
        if time.perf_counter() > self.deadline:
            raise OutOfBudget
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times), torch.cuda.max_memory_allocated() / 2**20


def measured(clock: Clock, fn) -> dict:
    import torch
    try:
        seconds, peak = clock(fn)
        return {"s": seconds, "mib": peak}
    except OutOfBudget:
        return {"skip": "time budget"}
    except torch.cuda.OutOfMemoryError:
        return {"skip": "out of memory"}
    finally:
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- 1. attention core
def attention_rows(lengths, clock: Clock) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from protein_performer.attention import EluFeatures, FavorPlus
    from protein_performer.attention.fla_backend import fla_import_problem
    from protein_performer.attention.layer import kernel_attention
    favor = FavorPlus(HEAD_DIM, FEATURES, generator=torch.Generator().manual_seed(0)).cuda()
    elu = EluFeatures(HEAD_DIM)
    fla_missing = fla_import_problem()
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        flash_attn_func = None

    def step(attend, layout="bhld"):
        def run():
            q, k, v = (t.detach().requires_grad_() for t in qkv)
            x = (q, k, v) if layout == "bhld" else tuple(t.transpose(1, 2) for t in (q, k, v))
            out = attend(*x)
            out = out if layout == "bhld" else out.transpose(1, 2)
            torch.autograd.grad(out, (q, k, v), grad)
        return run

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fns = {"favor_fla": lambda q, k, v: kernel_attention(favor, q, k, v, True, backend="fla"),
               "favor_torch": lambda q, k, v: kernel_attention(favor, q, k, v, True, chunk_size=128, backend="torch"),
               "elu_fla": lambda q, k, v: kernel_attention(elu, q, k, v, True, backend="fla"),
               "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
        rows = []
        for L in lengths:
            g = torch.Generator(device="cuda").manual_seed(L)
            qkv = [torch.randn(1, HEADS, L, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3)]
            grad = torch.randn_like(qkv[0])
            row = {"L": L}
            for name, fn in fns.items():
                if fla_missing and name.endswith("_fla"):
                    row[name] = {"skip": "fla missing"}
                    continue
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    row[name] = measured(clock, step(fn))
            row["flash_attn"] = (measured(clock, step(lambda q, k, v: flash_attn_func(q, k, v, causal=True), "blhd"))
                                 if flash_attn_func else {"skip": "not installed"})
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ----------------------------------------------------------------------------- 2. LM training step
def lm_rows(lengths, clock: Clock) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from protein_performer.attention.fla_backend import fla_import_problem
    from protein_performer.model import PerformerLM
    fla_missing = fla_import_problem()
    kinds = {"favor_fla": {"kernel": "softmax", "nb_features": FEATURES, "backend": "fla"},
             "favor_torch": {"kernel": "softmax", "nb_features": FEATURES, "backend": "torch"},
             "exact": {"kernel": "exact"}}
    rows = []
    for L in lengths:
        row = {"L": L}
        g = torch.Generator(device="cuda").manual_seed(0)
        tokens = torch.randint(4, 24, (1, L + 1), device="cuda", generator=g)
        for name, attention in kinds.items():
            if fla_missing and name.endswith("_fla"):
                row[name] = {"skip": "fla missing"}
                continue
            torch.manual_seed(0)
            model = PerformerLM(**LM, causal=True, attention={**attention, "redraw_interval": 0}).cuda()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def train_step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            r = measured(clock, train_step)
            if "s" in r:
                r["tokens_s"] = L / r["s"]
            row[name] = r
            model = opt = None           # freed before the next model's peak is read
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ----------------------------------------------------------------------------- report
def cell(r: dict, key="s", scale=1e3, fmt="{:.2f}") -> str:
    return fmt.format(r[key] * scale) if key in r else r.get("skip", "-")


def ratio(a: dict, b: dict, key="s") -> str:
    return f"{a[key] / b[key]:.2f}x" if key in a and key in b else "-"


def goal(text: str, ok) -> str:
    return f"- {text}: {'not measured' if ok is None else ('met' if ok else 'NOT met')}"


def report(att: list[dict], lm: list[dict], facts: dict, vers: dict, args, seconds: float) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# GPU benchmarks", "",
             f"Measured on **{facts['gpu']}** (driver {facts['driver']}), {when}, commit {common.git_commit()}, "
             f"command `{common.command_line(Path(__file__).relative_to(common.ROOT), sys.argv[1:])}` "
             f"({seconds:.0f} s). Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()) + ".", "",
             f"Median of {args.repeats} timed calls after {args.warmup} warm-up calls (CUDA events); peak memory ="
             " torch.cuda.max_memory_allocated during the timed calls, inputs included.", "",
             f"## Causal attention, forward + backward (bf16, batch 1, {HEADS} heads, head dim {HEAD_DIM}, "
             f"r = {FEATURES})", "", "Milliseconds per step (peak MiB):", ""]
    header = ["L", *METHODS.values(), "FAVOR+ fla speed-up over SDPA", "FAVOR+ fla time / elu+1 fla",
              "FAVOR+ torch time / fla"]
    rows = [[f"{r['L']:,}"] + [f"{cell(r[m])} ({cell(r[m], 'mib', 1, '{:.0f}')})" if "s" in r[m] else cell(r[m])
                               for m in METHODS]
            + [ratio(r["sdpa"], r["favor_fla"]), ratio(r["favor_fla"], r["elu_fla"]),
               ratio(r["favor_torch"], r["favor_fla"])] for r in att]
    lines += common.md_table(header, rows)
    lines += ["", f"## LM training step (bf16 autocast, AdamW; dim {LM['dim']}, depth {LM['depth']}, "
              f"{LM['heads']} heads, causal, batch 1)", "", "Tokens/s (peak MiB):", ""]
    header = ["L"] + list(LM_METHODS.values()) + ["FAVOR+ fla speed-up over exact"]
    rows = [[f"1 x {r['L']:,}"] + [f"{r[m]['tokens_s']:,.0f} ({r[m]['mib']:,.0f})" if "s" in r[m] else cell(r[m])
                                   for m in LM_METHODS]
            + [ratio(r["exact"], r["favor_fla"])] for r in lm]
    lines += common.md_table(header, rows)
    by_l = {r["L"]: r for r in att}
    lm_by_l = {r["L"]: r for r in lm}

    def faster(L, times):
        r = by_l.get(L)
        if not r or "s" not in r["sdpa"] or "s" not in r["favor_fla"]:
            return None
        return r["sdpa"]["s"] >= times * r["favor_fla"]["s"]
    from4k = [faster(L, 1.0) for L in by_l if L >= 4096]
    lm16 = lm_by_l.get(16384)
    elu = [r["favor_fla"]["s"] <= 1.5 * r["elu_fla"]["s"] for r in att if "s" in r["favor_fla"] and "s" in r["elu_fla"]]
    lines += ["", "## Goals of issue 20", "",
              goal("causal FAVOR+ fwd+bwd faster than FlashAttention SDPA from 4k tokens",
                   all(from4k) if from4k and None not in from4k else None),
              goal("at least 3x SDPA at 16k", faster(16384, 3.0)),
              goal("at least 8x SDPA at 64k", faster(65536, 8.0)),
              goal("LM training step at least 2x exact at 16k",
                   None if not lm16 or "s" not in lm16["exact"] or "s" not in lm16["favor_fla"]
                   else lm16["exact"]["s"] >= 2 * lm16["favor_fla"]["s"]),
              goal("FAVOR+ within 1.5x of fla's elu+1", all(elu) if elu else None)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="L = 1k, 4k; LM at 8k")
    p.add_argument("--budget", type=float, default=170.0, help="start no new measurement after this many seconds")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(common.DOCS / "benchmarks_gpu.md"))
    p.add_argument("--json", default=None, help="also write the raw rows here")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU")
    t0 = time.perf_counter()
    att = attention_rows([1024, 4096] if args.quick else LENGTHS, Clock(0.6 * args.budget, args.warmup, args.repeats))
    lm = lm_rows([8192] if args.quick else LM_LENGTHS,
                 Clock(args.budget - (time.perf_counter() - t0), args.warmup, args.repeats))
    facts, vers = gpu_facts(), versions()
    text = report(att, lm, facts, vers, args, time.perf_counter() - t0)
    common.write_doc(args.out, text, keep_below=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"facts": facts, "versions": vers, "attention": att, "lm": lm}, indent=1))
    print(text)


if __name__ == "__main__":
    main()

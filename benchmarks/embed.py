"""Embedding speed and peak memory against protein length on this machine's CPU.

    nice python benchmarks/embed.py [--ckpt PATH] [--lengths 256 1024 4096 8192 16384]

Each (model, length) runs in a fresh process so that its peak RSS is its own: one
protein of L residues, embedded through ``protein_performer.embed_sequences`` (mean of the last
layer), one warm-up and ``--repeats`` timed runs; the median is reported. A second table
embeds real proteins from the bundled sample in token-budget batches (the usual use).
Models: the default config (conf/model/performer.yaml, FAVOR+) and, for comparison, the
same size with exact attention (conf/model/transformer.yaml); random weights unless
``--ckpt`` (speed does not depend on the weights). The tables are printed and written
into docs/embeddings.md between the benchmark markers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "embeddings.md"
START, END = "<!-- benchmark:start -->", "<!-- benchmark:end -->"


def build(model_name: str, ckpt: str | None):
    import torch
    from omegaconf import OmegaConf

    from protein_performer.tasks import ProteinLM, load_checkpoint
    if ckpt and model_name == "performer":
        return load_checkpoint(ckpt)
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{model_name}.yaml"))
    cfg.pop("name")
    torch.manual_seed(0)
    return ProteinLM(model=cfg).eval()


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(args) -> None:
    """One measurement in this process; prints a JSON line."""
    import numpy as np
    import torch

    from protein_performer import embed as E
    torch.set_num_threads(args.threads)
    model = build(args.model, args.ckpt)
    before = rss_mib()
    if args.length:
        rng = np.random.default_rng(0)
        seqs = ["".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), args.length))]
    else:
        from protein_performer.io import read_records
        seqs = []
        for rec in read_records(ROOT / "data" / "sample" / "swissprot_sample_20k.fasta.gz"):
            seqs.append(rec.sequence)
            if len(seqs) == args.n_proteins:
                break
    residues = sum(len(s) for s in seqs)
    times = []
    for i in range(args.repeats + 1):
        t = time.perf_counter()
        E.embed_sequences(model, seqs, max_tokens=args.token_budget)
        if i:  # the first run is a warm-up
            times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"model": args.model, "length": args.length, "proteins": len(seqs), "residues": residues,
                      "median_s": statistics.median(times), "peak_mib": peak, "model_rss_mib": before}))


def run_child(model: str, length: int, a) -> dict | None:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--length", str(length), "--repeats",
           str(a.repeats if length <= 4096 or length == 0 else max(1, a.repeats // 2)),
           "--threads", str(a.threads), "--n-proteins", str(a.n_proteins), "--token-budget", str(a.token_budget)]
    if a.ckpt:
        cmd += ["--ckpt", a.ckpt]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        print(f"{model} L={length}: failed ({last})", file=sys.stderr)
        return {"model": model, "length": length, "failed": last}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=None, help="checkpoint for the performer rows (default: random weights)")
    p.add_argument("--models", nargs="+", default=["performer", "transformer"])
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-proteins", type=int, default=200)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--no-doc", action="store_true", help="print only; do not update docs/embeddings.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="performer", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)

    rows = [run_child(m, L, a) for L in a.lengths for m in a.models]
    batch = [run_child(m, 0, a) for m in a.models]
    import platform

    import torch
    lines = [f"CPU: {platform.processor() or platform.machine()}, {a.threads} threads, torch {torch.__version__}, "
             f"fp32, batch of one protein, mean of the last layer; median of {a.repeats} runs "
             f"({max(1, a.repeats // 2)} above 4,096) after a warm-up; peak = the process's peak RSS "
             f"(model and torch included), model = RSS after loading the model.",
             "", "| model | L | seconds | residues/s | peak MiB | model MiB | peak − model MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['model']} | {r['length']} | failed: {r['failed'][:60]} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['length']:,} | {r['median_s']:.3f} | {r['residues'] / r['median_s']:,.0f} "
                     f"| {r['peak_mib']:.0f} | {r['model_rss_mib']:.0f} | {r['peak_mib'] - r['model_rss_mib']:.0f} |")
    perf = {r["length"]: r for r in rows if r.get("model") == "performer" and "failed" not in r}
    exact = {r["length"]: r for r in rows if r.get("model") == "transformer" and "failed" not in r}
    common = sorted(set(perf) & set(exact))
    if common:
        lines += ["", "Time ratio exact / FAVOR+ (same size): " + ", ".join(
            f"L={L:,}: {exact[L]['median_s'] / perf[L]['median_s']:.2f}" for L in common)]
    lines += ["", f"Real proteins: the first {a.n_proteins} of the bundled Swiss-Prot sample, token budget "
              f"{a.token_budget:,}, sorted-by-length batches:", "",
              "| model | proteins | residues | seconds | residues/s | peak MiB |", "|---|---|---|---|---|---|"]
    for r in batch:
        if "failed" in r:
            lines.append(f"| {r['model']} | failed: {r['failed'][:60]} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['proteins']} | {r['residues']:,} | {r['median_s']:.2f} | "
                     f"{r['residues'] / r['median_s']:,.0f} | {r['peak_mib']:.0f} |")
    table = "\n".join(lines)
    print(table)
    if not a.no_doc and DOC.exists():
        text = DOC.read_text()
        if START in text and END in text:
            text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{table}\n{END}", text,
                          flags=re.S)
            DOC.write_text(text)
            print(f"\nwritten into {DOC}")


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

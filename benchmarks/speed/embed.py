"""Embedding speed and peak memory against protein length on this machine's CPU.

    nice python benchmarks/speed/embed.py [--ckpt PATH] [--lengths 256 1024 4096 8192 16384]

Each (model, length) runs in a fresh process so that its peak RSS is its own: one
protein of L residues, embedded through ``protein_performer.embed_sequences`` (mean of the last
layer), one warm-up and ``--repeats`` timed runs; the median is reported. A second table
embeds real proteins from the bundled sample in token-budget batches (the usual use).
Models: the default config (conf/model/performer.yaml, FAVOR+) and, for comparison, the
same size with exact attention (conf/model/transformer.yaml); random weights unless
``--ckpt`` (speed does not depend on the weights). The tables are printed and written
into docs/embeddings.md (or ``--doc``) between the benchmark markers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

DOC = common.DOCS / "embeddings.md"
START, END = "<!-- benchmark:start -->", "<!-- benchmark:end -->"


def build(model_name: str, ckpt: str | None):
    import torch
    from omegaconf import OmegaConf

    from protein_performer.compare import compose_train_config
    from protein_performer.training.task import ProteinLM, load_checkpoint
    if ckpt and model_name == "performer":
        return load_checkpoint(ckpt)
    # the model as scripts/train.py model=NAME builds it (conf/model/NAME.yaml over base.yaml)
    cfg = OmegaConf.to_container(compose_train_config([f"model={model_name}"]).model)
    torch.manual_seed(0)
    return ProteinLM(model=cfg).eval()


def child(args) -> None:
    """One measurement in this process; prints a JSON line."""
    import numpy as np
    import torch

    from protein_performer import embed as E
    torch.set_num_threads(args.threads)
    model = build(args.model, args.ckpt)
    before = common.rss_mib()
    if args.length:
        rng = np.random.default_rng(0)
        seqs = ["".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), args.length))]
    else:
        from protein_performer.formats import read_records
        seqs = []
        for rec in read_records(common.SAMPLE):
            seqs.append(rec.sequence)
            if len(seqs) == args.n_proteins:
                break
    residues = sum(len(s) for s in seqs)
    timing = common.measure(lambda: E.embed_sequences(model, seqs, max_tokens=args.token_budget), args.repeats)
    print(json.dumps({"model": args.model, "length": args.length, "proteins": len(seqs), "residues": residues,
                      "median_s": timing.median, "peak_mib": common.peak_rss_mib(), "model_rss_mib": before}))


def run_child(model: str, length: int, a) -> dict:
    cmd = ["--child", "--model", model, "--length", length, "--repeats",
           a.repeats if length <= 4096 or length == 0 else max(1, a.repeats // 2),
           "--threads", a.threads, "--n-proteins", a.n_proteins, "--token-budget", a.token_budget]
    if a.ckpt:
        cmd += ["--ckpt", a.ckpt]
    child = common.run_child(__file__, cmd)
    if not child.ok or not child.records:
        print(f"{model} L={length}: failed ({child.reason})", file=sys.stderr)
        return {"model": model, "length": length, "failed": child.reason}
    return child.records[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=None, help="checkpoint for the performer rows (default: random weights)")
    p.add_argument("--models", nargs="+", default=["performer", "transformer"])
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-proteins", type=int, default=200)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--doc", type=Path, default=DOC,
                   help="markdown file whose benchmark markers receive the tables (default docs/embeddings.md)")
    p.add_argument("--no-doc", action="store_true", help="print only; do not update the doc")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="performer", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)

    rows = [run_child(m, L, a) for L in a.lengths for m in a.models]
    batch = [run_child(m, 0, a) for m in a.models]
    import torch
    lines = [f"CPU: {common.cpu()}, {a.threads} threads, torch {torch.__version__}, "
             f"fp32, batch of one protein, mean of the last layer; median of {a.repeats} runs "
             f"({max(1, a.repeats // 2)} above 4,096) after a warm-up; peak = the process's peak RSS "
             f"(model and torch included), model = RSS after loading the model.", ""]
    lines += common.md_table(
        ["model", "L", "seconds", "residues/s", "peak MiB", "model MiB", "peak − model MiB"],
        [[r["model"], r["length"], f"failed: {r['failed'][:60]}", "", "", "", ""] if "failed" in r else
         [r["model"], f"{r['length']:,}", f"{r['median_s']:.3f}", f"{r['residues'] / r['median_s']:,.0f}",
          f"{r['peak_mib']:.0f}", f"{r['model_rss_mib']:.0f}", f"{r['peak_mib'] - r['model_rss_mib']:.0f}"]
         for r in rows])
    perf = {r["length"]: r for r in rows if r.get("model") == "performer" and "failed" not in r}
    exact = {r["length"]: r for r in rows if r.get("model") == "transformer" and "failed" not in r}
    both = sorted(set(perf) & set(exact))
    if both:
        lines += ["", "Time ratio exact / FAVOR+ (same size): " + ", ".join(
            f"L={L:,}: {exact[L]['median_s'] / perf[L]['median_s']:.2f}" for L in both)]
    lines += ["", f"Real proteins: the first {a.n_proteins} of the bundled Swiss-Prot sample, token budget "
              f"{a.token_budget:,}, sorted-by-length batches:", ""]
    lines += common.md_table(
        ["model", "proteins", "residues", "seconds", "residues/s", "peak MiB"],
        [[r["model"], f"failed: {r['failed'][:60]}", "", "", "", ""] if "failed" in r else
         [r["model"], r["proteins"], f"{r['residues']:,}", f"{r['median_s']:.2f}",
          f"{r['residues'] / r['median_s']:,.0f}", f"{r['peak_mib']:.0f}"]
         for r in batch])
    table = "\n".join(lines)
    print(table)
    if not a.no_doc and common.write_between(a.doc, START, END, table):
        print(f"\nwritten into {a.doc}")


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

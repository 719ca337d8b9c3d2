"""Recovery after the swap: an exact-softmax model's weights under linear attention, then a short
fine-tune (distillation from the softmax teacher, or continued masked-LM), by held-out length.

    nice python benchmarks/quality/esm_recovery.py [--teacher CKPT] [--kernels softmax elu hedgehog] [--steps 50 200]

1. The teacher: ``scripts/train.py model=transformer`` (exact softmax; crops up to 1,024 residues, as
   ESM-2 was trained), unless ``--teacher`` names a checkpoint already trained.
2. For each kernel: the teacher's weights with that attention and no training (``init_from=`` with
   ``trainer.max_steps=0``), then ``--steps`` steps of each recovery from the same start:
   ``distill`` (``distill.teacher=`` the teacher: masked-LM loss + KL to the teacher's logits +
   per-layer attention-output matching) and ``mlm`` (continued masked-LM only).
3. ``scripts/evaluate.py`` on a seeded subset of the bundled held-out proteins (every protein above
   2,048 residues, and ``--n-short`` others drawn with ``--seed``), every model in one call; the
   teacher sees proteins above 4,096 tokens through windows (evaluate's ``window``), the linear models
   see them whole. Perplexity by length goes into docs/esm.md between the esm-recovery markers.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

DOC = common.DOCS / "esm.md"
START, END = "<!-- esm-recovery:start -->", "<!-- esm-recovery:end -->"
HELDOUT = common.ROOT / "data" / "heldout" / "uniprotkb_mix_heldout_2k.fasta.gz"
TEACHER = ["model=transformer", "seed=0", "data.max_len=1024", "data.crop_schedule=[[0,256],[50,1024]]",
           "trainer.val_check_interval=1000"]
#: the recovery runs' shared settings (a fine-tune: short warm-up, lower peak rate, crops as the teacher's)
RECOVERY = ["seed=1", "data.max_len=1024", "data.crop_schedule=null", "data.max_tokens=2048",
            "optim.warmup_steps=10", "trainer.val_check_interval=1000000"]
#: the long recipe: the same, but crops growing to 8,192 residues (the README default's longest), so
#: the student adapts to long proteins too (the teacher, in distillation, then sees whole crops)
LONG_CROPS = ["data.max_len=8192", "data.crop_schedule=[[0,1024],[50,4096],[100,8192]]", "data.max_tokens=8192"]
DISTILL = ["distill.weight=1.0", "distill.attention_weight=1.0"]
GROUPS = (("<=1024", ("<=256", "257-512", "513-1024")), ("1025-4096", ("1025-2048", "2049-4096")),
          (">4096", (">4096",)))


def local_window() -> int:
    """The students' local window: conf/model/base.yaml's, which the recovery runs do not override."""
    from protein_performer.compare import compose_train_config
    return int(compose_train_config([]).model.attention.local_window)


def train(overrides: list[str], run_dir: Path, log: Path) -> float:
    """``scripts/train.py OVERRIDES`` into ``run_dir`` (skipped when it already holds last.ckpt);
    returns the wall-clock seconds of the run (kept in run_dir/wall_seconds.json; 0 if unknown)."""
    timing = run_dir / "wall_seconds.json"
    if (run_dir / "checkpoints" / "last.ckpt").is_file():
        return json.loads(timing.read_text())["seconds"] if timing.is_file() else 0.0
    cmd = [sys.executable, str(common.ROOT / "scripts" / "train.py"), *overrides, "logger=none",
           f"hydra.run.dir={run_dir}"]
    print(" ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    with open(log, "a") as fh:
        subprocess.run(cmd, check=True, stdout=fh, stderr=subprocess.STDOUT, cwd=common.ROOT)
    seconds = time.perf_counter() - start
    timing.write_text(json.dumps({"seconds": round(seconds, 1), "overrides": overrides}) + "\n")
    return seconds


def subset(out: Path, n_short: int, seed: int, long_above: int = 2048) -> tuple[Path, int, int]:
    """Every held-out protein above ``long_above`` residues and ``n_short`` others drawn with ``seed``."""
    records, name, seq = [], None, []
    with gzip.open(HELDOUT, "rt") as fh:
        for line in fh:
            if line.startswith(">"):
                if name is not None:
                    records.append((name, "".join(seq)))
                name, seq = line, []
            else:
                seq.append(line.strip())
    records.append((name, "".join(seq)))
    long = [r for r in records if len(r[1]) > long_above]
    short = random.Random(seed).sample([r for r in records if len(r[1]) <= long_above], n_short)
    chosen = [r for r in records if r in long or r in short]  # file order
    out.write_text("".join(f"{n}{s}\n" for n, s in chosen))
    return out, len(long), len(chosen)


def grouped(m: dict, labels) -> float:
    """Perplexity over several of evaluate's length buckets (token-weighted mean NLL)."""
    b = [m["buckets"][k] for k in labels if m["buckets"].get(k) and m["buckets"][k].get("num_tokens")]
    n = sum(x["num_tokens"] for x in b)
    return math.exp(sum(x["loss"] * x["num_tokens"] for x in b) / n) if n else math.nan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=common.ROOT / "outputs" / "esm_recovery")
    p.add_argument("--teacher", default=None, help="an exact-softmax checkpoint (default: train one)")
    p.add_argument("--teacher-steps", type=int, default=250)
    p.add_argument("--kernels", nargs="+", default=["softmax", "elu", "hedgehog"])
    p.add_argument("--steps", nargs="+", type=int, default=[50, 200])
    p.add_argument("--long", nargs="*", default=["elu:mlm", "hedgehog:mlm", "hedgehog:distill"],
                   help="KERNEL:RECOVERY runs repeated with crops to 8,192 (LONG_CROPS), at the largest --steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--local-heads", type=int, default=1,
                   help="the student's heads of exact attention within model.attention.local_window residues "
                        "(conf/model/base.yaml's default: 1; 0 swaps every head to the kernel, as before local heads existed)")
    p.add_argument("--n-short", type=int, default=265, help="held-out proteins up to 2,048 residues drawn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-doc", action="store_true")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / "runs.log"
    seconds = {}
    teacher = a.teacher
    if teacher is None:
        seconds["teacher"] = train(TEACHER + [f"trainer.max_steps={a.teacher_steps}"], a.out / "teacher", log)
        teacher = str(a.out / "teacher" / "checkpoints" / "last.ckpt")
    models = {"teacher (exact)": teacher}
    for k in a.kernels:
        start = [f"init_from={teacher}", f"model.attention.kernel={k}", f"model.attention.local_heads={a.local_heads}",
                 f"optim.lr={a.lr}"] + RECOVERY
        name = f"{k} swapped"
        tag = f"{k}-local{a.local_heads}"  # run folders are reused: each setting gets its own
        seconds[name] = train(start + ["trainer.max_steps=0"], a.out / f"{tag}-0", log)
        models[name] = str(a.out / f"{tag}-0" / "checkpoints" / "last.ckpt")
        recipes = {"distill": [f"distill.teacher={teacher}"] + DISTILL, "mlm": []}
        runs = [(how, n, "") for how in recipes for n in a.steps]
        runs += [(how, max(a.steps), "long") for kh in a.long for how in [kh.split(":")[1]] if kh.split(":")[0] == k]
        for how, n, crops in runs:
            name = f"{k} {how} {n}" + (", crops to 8,192" if crops else "")
            folder = f"{tag}-{how}-{n}" + (f"-{crops}" if crops else "")
            extra = recipes[how] + (LONG_CROPS if crops else [])
            seconds[name] = train(start + extra + [f"trainer.max_steps={n}"], a.out / folder, log)
            models[name] = str(a.out / folder / "checkpoints" / "last.ckpt")
    data, n_long, n_all = subset(a.out / "heldout_subset.fasta", a.n_short, a.seed)
    ev = a.out / "evaluate"
    names = [n.replace(" ", "_").replace("(", "").replace(")", "").replace(",", "") for n in models]
    cmd = [sys.executable, str(common.ROOT / "scripts" / "evaluate.py"), f"ckpt=[{','.join(models.values())}]",
           f"names=[{','.join(names)}]", f"data.path={data}", f"output_dir={ev}", "progress=false",
           "hydra.run.dir=" + str(ev / "hydra")]
    print(" ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=common.ROOT)
    eval_s = time.perf_counter() - start
    results = json.loads((ev / "metrics.json").read_text())["checkpoints"]
    ref = results[names[0]]
    rows = []
    for label, key in zip(models, names):
        m = results[key]
        cells = [label, f"{seconds.get(label, 0):.0f}" if label in seconds and seconds[label] else "",
                 f"{m['perplexity']:.3f}", f"{100 * (m['perplexity'] / ref['perplexity'] - 1):+.1f} %"]
        for _, labels in GROUPS:
            v, r = grouped(m, labels), grouped(ref, labels)
            cells.append(f"{v:.3f} ({100 * (v / r - 1):+.1f} %)")
        rows.append(cells)
    import torch
    lines = [f"Generated by `{common.command_line(__file__)}` (CPU: {common.cpu()}, torch {torch.__version__}; "
             f"training and evaluation {sum(seconds.values()) + eval_s:.0f} s).", "",
             f"* Teacher: `python scripts/train.py {' '.join(TEACHER)} trainer.max_steps={a.teacher_steps}` "
             f"(exact softmax, 0.8 M parameters, the README model with `model=transformer`; shortened from 600 steps "
             f"with crops to 8,192 to 250 steps with crops to 1,024, ESM-2's training length)." if a.teacher is None
             else f"* Teacher: `{a.teacher}`.",
             f"* Every recovery: `python scripts/train.py init_from=TEACHER model.attention.kernel=K "
             f"model.attention.local_heads={a.local_heads} optim.lr={a.lr} "
             f"{' '.join(RECOVERY)} trainer.max_steps=N`; distill adds `distill.teacher=TEACHER {' '.join(DISTILL)}`; "
             f"`swapped` is the same with `trainer.max_steps=0` (the teacher's weights, no step); "
             f"`crops to 8,192` adds `{' '.join(LONG_CROPS)}`.",
             f"* Held-out: {n_all} proteins of `data/heldout/uniprotkb_mix_heldout_2k.fasta.gz`: all {n_long} above "
             f"2,048 residues and {a.n_short} others drawn with seed {a.seed}; `scripts/evaluate.py` (masked LM, "
             f"seed 0); the teacher windows proteins above 4,096 tokens (evaluate's default window), the linear "
             f"models see them whole. Evaluation of all models: {eval_s:.0f} s.",
             (f"* The student: the teacher's first {a.local_heads} head(s) keep exact softmax within {local_window()} residues "
              f"(local heads, `conf/model/base.yaml`), the others swap to the kernel K." if a.local_heads else
              "* The student: every head swaps to the kernel K (no local heads)."),
             "* Cells: perplexity (change against the teacher). `train s`: wall-clock seconds of the run.", ""]
    lines += common.md_table(["model", "train s", "perplexity", "vs teacher"] + [f"ppl {g}" for g, _ in GROUPS], rows)
    common.publish(lines, None if a.no_doc else DOC, START, END)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

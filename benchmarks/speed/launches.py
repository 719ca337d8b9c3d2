#!/usr/bin/env python
"""Aten ops per layer, forward + backward, for every attention path and kernel at 1k-64k residues
(issue 42, item 7): a CPU-side proxy for a GPU's kernel launches, tracked without a GPU.

Why: at protein lengths a GPU step of this model is launch-bound (a few microseconds per kernel), so
the number of ops a layer dispatches, and whether it grows with L, predicts the GPU's time better than
the CPU's time does.  Every aten op that reaches the dispatcher is counted (TorchDispatchMode), views
included ("all"), and again without the view-like ops that launch no kernel ("kernels").

Per layer = ops of a depth-2 model minus ops of a depth-1 model (dim 64, 2 heads, batch 1, the LM head
and the loss included in both, so they cancel): what each extra layer costs.  Work a model does once
per forward (the padding check, the local heads' band mask) is not per layer.

Paths (``model.attention.backend``): "torch" is the CPU's (cache-sized blocks, a loop over chunks);
"parallel" is what CUDA runs where fla does not (whole sequence, chunks at once).  fla's Triton
kernels cannot run here (a few launches per layer on a GPU by construction).

    python benchmarks/speed/launches.py                 # writes docs/launches.md (about a minute on 2 cores)
    python benchmarks/speed/launches.py --lengths 1024,4096 --no-doc
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from benchmarks import common  # noqa: E402

LENGTHS = [1024, 4096, 16384, 65536]
#: exact attention is quadratic on a CPU: counted up to this length (its count does not depend on L)
EXACT_MAX = 16384
#: name -> model.attention overrides; "default" is conf/model/base.yaml's attention
KERNELS = {
    "default (FAVOR+ r = 64 + local head)": dict(kernel="softmax", nb_features=64, local_heads=1, local_window=128),
    "FAVOR+ r = 64": dict(kernel="softmax", nb_features=64, local_heads=0),
    "elu+1 + local head": dict(kernel="elu", local_heads=1, local_window=128),
    "elu+1": dict(kernel="elu", local_heads=0),
    "exact": dict(kernel="exact", local_heads=0),
}
VIEW_OPS = {"view", "_unsafe_view", "reshape", "alias", "as_strided", "expand", "permute", "transpose", "t",
            "unsqueeze", "squeeze", "select", "slice", "detach", "unbind", "split", "split_with_sizes", "chunk",
            "narrow", "view_as", "unflatten", "flatten", "lift_fresh", "_reshape_alias", "diagonal"}


def count_aten_ops(fn) -> tuple[int, int]:
    """(all aten ops, non-view ops) that ``fn()`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.all = self.kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.all += 1
            self.kernels += func.overloadpacket.__name__ not in VIEW_OPS
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    return c.all, c.kernels


def layer_ops(attention: dict, causal: bool, L: int, backend: str) -> tuple[int, int]:
    """Ops per layer (depth 2 minus depth 1), forward + backward of the LM loss, one protein of L tokens."""
    import torch

    from protein_performer.model import ModelConfig, PerformerLM
    counts = []
    for depth in (1, 2):
        torch.manual_seed(0)
        cfg = ModelConfig(dim=64, depth=depth, heads=2, causal=causal, dropout=0.0,
                          attention=dict(attention, backend=backend))
        model = PerformerLM(cfg)
        tokens = torch.randint(4, 24, (1, L))

        def step():
            model(tokens).float().logsumexp(-1).mean().backward()
        step()                                   # first call: lazy work (backend resolution) out of the count
        counts.append(count_aten_ops(step))
    return counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]


#: compiled models: the kernels inductor generates (C++ on a CPU, Triton on a GPU) and the calls it leaves to
#: libraries (GEMMs, SDPA: extern_kernels.*, aten fallbacks), counted in the generated code's call()
COMPILED_CALL = re.compile(r"^\s+(?:\w+ = )?(?:(?P<fused>(?:cpp|triton)_\w+)(?:\.run)?\(|"
                           r"(?P<extern>extern_kernels\.\w+|torch\.ops\.aten\.\w+)(?:\.\w+)?\()", re.M)
COMPILED_KERNELS = {k: v for k, v in KERNELS.items() if "elu+1 + local" not in k}


def compiled_calls(attention: dict, causal: bool, L: int, depth: int) -> tuple[int, int]:
    """(generated kernels, extern calls) of the compiled forward + backward of a depth-``depth`` model."""
    import torch
    from torch._inductor.utils import run_and_get_code

    from protein_performer.model import ModelConfig, PerformerLM
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PerformerLM(ModelConfig(dim=64, depth=depth, heads=2, causal=causal, dropout=0.0, attention=attention))
    model.compile(fullgraph=True, dynamic=False)
    tokens = torch.randint(4, 24, (1, L))
    _, codes = run_and_get_code(lambda: model(tokens).float().logsumexp(-1).mean().backward())
    calls = [m for code in codes for m in COMPILED_CALL.finditer(code[code.index("def call("):])]
    return sum(m["fused"] is not None for m in calls), sum(m["extern"] is not None for m in calls)


def measure_compiled(lengths: list[int], out=print) -> list[dict]:
    """Compiled kernels per layer (depth 2 minus depth 1), forward + backward."""
    rows = []
    for causal in (False, True):
        for name, att in COMPILED_KERNELS.items():
            for L in lengths:
                if att["kernel"] == "exact" and L > EXACT_MAX:
                    continue
                (f1, e1), (f2, e2) = (compiled_calls(att, causal, L, depth) for depth in (1, 2))
                rows.append(dict(objective="causal" if causal else "bidirectional", kernel=name, L=L,
                                 fused=f2 - f1, extern=e2 - e1))
                out(rows[-1])
    return rows


def compiled_table(rows: list[dict], lengths: list[int]) -> list[str]:
    exact = {r["objective"]: r["fused"] + r["extern"] for r in rows if r["kernel"] == "exact"}
    lines = []
    for objective in ("bidirectional", "causal"):
        lines += [f"### {objective}, compiled", "", "Per layer, forward + backward: generated kernels + extern calls "
                  "(GEMMs, SDPA) = launches (× exact's launches in brackets).", ""]
        body = []
        for kernel in COMPILED_KERNELS:
            cells = [kernel]
            for L in lengths:
                r = next((r for r in rows if (r["objective"], r["kernel"], r["L"]) == (objective, kernel, L)), None)
                n = None if r is None else r["fused"] + r["extern"]
                cells.append("-" if r is None else f"{r['fused']} + {r['extern']} = {n} ({n / exact[objective]:.2f}×)")
            body.append(cells)
        lines += common.md_table(["kernel"] + [f"L = {L:,}" for L in lengths], body) + [""]
    return lines


def measure(lengths: list[int], out=print) -> list[dict]:
    rows = []
    for causal in (False, True):
        for name, att in KERNELS.items():
            for backend in (("torch",) if att["kernel"] == "exact" else ("torch", "parallel")):
                for L in lengths:
                    if att["kernel"] == "exact" and L > EXACT_MAX:
                        continue
                    n_all, n_kernels = layer_ops(att, causal, L, backend)
                    rows.append(dict(objective="causal" if causal else "bidirectional", kernel=name,
                                     backend="-" if att["kernel"] == "exact" else backend, L=L, all=n_all,
                                     kernels=n_kernels))
                    out(rows[-1])
    return rows


def table(rows: list[dict], lengths: list[int]) -> list[str]:
    exact = {(r["objective"]): r["all"] for r in rows if r["kernel"] == "exact"}
    lines = []
    for objective in ("bidirectional", "causal"):
        lines += [f"### {objective}", "", "Aten ops per layer, forward + backward: all / without views "
                  f"(× exact's all-op count in brackets).", ""]
        keys = sorted({(r["kernel"], r["backend"]) for r in rows if r["objective"] == objective},
                      key=lambda k: (list(KERNELS).index(k[0]), k[1]))
        body = []
        for kernel, backend in keys:
            cells = [kernel, backend]
            for L in lengths:
                r = next((r for r in rows if (r["objective"], r["kernel"], r["backend"], r["L"]) ==
                          (objective, kernel, backend, L)), None)
                cells.append("-" if r is None else f"{r['all']:,} / {r['kernels']:,} "
                             f"({r['all'] / exact[objective]:.2f}×)")
            body.append(cells)
        lines += common.md_table(["kernel", "backend"] + [f"L = {L:,}" for L in lengths], body) + [""]
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--doc", default=str(common.DOCS / "launches.md"))
    p.add_argument("--no-doc", action="store_true")
    p.add_argument("--compiled", action="store_true", help="the compiled models' kernels instead (inductor; "
                   f"about 10 minutes on 2 cores) -> {COMPILED_DOC.name}")
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.compiled:
        main_compiled(a, argv, lengths)
        return
    rows = measure(lengths, out=lambda r: print(r, flush=True))
    lines = ["# Aten ops per layer (a CPU proxy for GPU kernel launches)", "",
             f"`{common.command_line('benchmarks/speed/launches.py', argv)}` at {common.git_commit()}: dim 64, "
             "2 heads (head dim 32), batch 1; per layer = a depth-2 model minus a depth-1 model, forward + "
             "backward of the LM loss. backend `torch` is the CPU's path, `parallel` what CUDA runs where fla "
             f"does not. Exact attention counted up to L = {EXACT_MAX:,} (quadratic on a CPU; its count does "
             "not depend on L). Goals (issue 42): the path CUDA runs, causal, constant in L (within 5 %) and "
             "≤ 3× exact's; the bidirectional default ≤ 1.5× exact's.", ""] + table(rows, lengths)
    print("\n".join(lines))
    if not a.no_doc:
        common.write_doc(a.doc, "\n".join(lines) + "\n", keep_below=True)
        print(f"wrote {a.doc}")


COMPILED_DOC = common.DOCS / "launches_compiled.md"
COMPILED_LENGTHS = "1024,65536"


def main_compiled(a, argv, lengths) -> None:
    rows = measure_compiled(lengths, out=lambda r: print(r, flush=True))
    lines = ["# Kernels per layer of the compiled model (what a GPU would launch)", "",
             f"`{common.command_line('benchmarks/speed/launches.py', argv)}` at {common.git_commit()}: the model "
             "compiled as compile=true does (fullgraph, static shape; training/compiled.py), dim 64, 2 heads, batch 1, "
             "dropout 0; per layer = a depth-2 model minus a depth-1 model, forward + backward of the LM loss; "
             "counted in the code inductor generates on this CPU (C++ kernels; a GPU's Triton kernels are fused "
             "the same way, one kernel each) and its extern calls (GEMMs, SDPA). Exact attention counted up to "
             f"L = {EXACT_MAX:,}. Goals (issue 63): the default ≤ 1.5× exact's launches bidirectional, ≤ 3× "
             "causal, constant in L.", ""] + compiled_table(rows, lengths)
    print("\n".join(lines))
    if not a.no_doc:
        common.write_doc(COMPILED_DOC, "\n".join(lines) + "\n", keep_below=True)
        print(f"wrote {COMPILED_DOC}")


if __name__ == "__main__":
    main()

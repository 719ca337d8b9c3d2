"""Memory and speed of ESM-2's architectures converted to linear attention, beside ESM-2 in fair-esm.

    nice python benchmarks/speed/esm_memory.py [--points 8M:1024,8192 650M:35000 ...] [--fair 150M:1024 ...]

Each point runs in a fresh process, so its peak RSS (model and torch included) is its own: one
random protein of L residues embedded (mean of the last layer) by ``protein_performer.embed_sequences``
through the model ``convert-esm`` builds for that ESM-2 size (ESM's vocabulary, token dropout, biased
q/k/v, ESM's LM head; random weights: speed and memory do not depend on them) with the attention
kernel of ``--kernel`` (FAVOR+ by default). ``--fair`` points run fair-esm's own ``ESM2`` (random
weights, forward with the last layer's representations, as docs/anchors.md's ESM-2 table); the
8M / 35M fair-esm figures up to 8,192 are quoted from docs/anchors.md with their provenance.
At most 4,096 residues: a warm-up and 3 timed runs (median); above: one run (its cost dwarfs the
first-call overhead). The table goes into docs/esm.md between the esm-memory markers.
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

DOC = common.DOCS / "esm.md"
START, END = "<!-- esm-memory:start -->", "<!-- esm-memory:end -->"
#: fair-esm's ESM-2 models (esm/pretrained.py): name -> (layers, dim, heads)
SHAPES = {"8M": (6, 320, 20), "35M": (12, 480, 20), "150M": (30, 640, 20), "650M": (33, 1280, 20)}
POINTS = ["8M:1024,4096,8192,16384,32768", "35M:1024,8192,32768", "150M:1024,8192,32768", "650M:1024,8192,35000"]
FAIR = ["150M:1024", "650M:1024"]


def converted(size: str, kernel: str):
    """The PerformerLM convert-esm builds for ESM-2 ``size`` (convert_esm.build's config), random weights."""
    import torch

    from protein_performer.model import AttentionConfig, ModelConfig, PerformerLM
    from protein_performer.tokenizer import ESM_TOKENS
    layers, dim, heads = SHAPES[size]
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=len(ESM_TOKENS), vocabulary="esm", qkv_bias=True, lm_head="esm",
                         rotary_inv_freq="float32", position="rotary", rotary_base=10000.0, dim=dim, depth=layers,
                         heads=heads, ff_mult=4, norm_eps=1e-5, token_dropout=True, dropout=0.0,
                         attention=AttentionConfig(kernel=kernel, local_heads=0))
    return PerformerLM(config).eval()


def child(a) -> None:
    """One measurement in this process; prints a JSON line."""
    import numpy as np
    import torch
    torch.set_num_threads(a.threads)
    seq = "".join(np.random.default_rng(0).choice(list("ACDEFGHIKLMNPQRSTVWY"), a.length))
    if a.run_fair:
        import esm
        layers, dim, heads = SHAPES[a.size]
        alphabet = esm.Alphabet.from_architecture("ESM-1b")
        torch.manual_seed(0)
        model = esm.model.esm2.ESM2(num_layers=layers, embed_dim=dim, attention_heads=heads, alphabet=alphabet,
                                    token_dropout=True).eval()
        _, _, tokens = alphabet.get_batch_converter()([("p", seq)])

        def run():
            with torch.no_grad():
                return model(tokens, repr_layers=[layers])["representations"][layers][0, 1:-1].mean(0)
    else:
        from protein_performer.embed import embed_sequences
        model = converted(a.size, a.kernel)

        def run():
            return embed_sequences(model, [seq], max_tokens=a.length + 2)
    params = sum(p.numel() for p in model.parameters())
    before = common.rss_mib()
    long = a.length > 4096
    timing = common.measure(run, 1 if long else 3, warmup=0 if long else 1)
    print(json.dumps({"impl": "fair-esm" if a.run_fair else a.kernel, "size": a.size, "length": a.length,
                      "params": params, "median_s": timing.median, "peak_mib": common.peak_rss_mib(),
                      "model_rss_mib": before}))


def parse(points: list[str]) -> list[tuple[str, int]]:
    out = []
    for p in points:
        size, lengths = p.split(":")
        if size not in SHAPES:
            raise SystemExit(f"unknown ESM-2 size {size!r}: choose from {', '.join(SHAPES)}")
        out += [(size, int(L)) for L in lengths.split(",")]
    return out


def measure_point(size: str, length: int, a, fair: bool) -> dict:
    args = ["--child", "--size", size, "--length", length, "--threads", a.threads, "--kernel", a.kernel]
    child = common.run_child(__file__, args + (["--run-fair"] if fair else []), timeout=a.timeout)
    impl = "fair-esm" if fair else a.kernel
    if not child.ok or not child.records:
        print(f"{impl} {size} L={length}: failed ({child.reason})", file=sys.stderr)
        return {"impl": impl, "size": size, "length": length, "failed": child.reason}
    r = child.records[-1]
    print(json.dumps(r), flush=True)
    return r


def cell(r: dict | None) -> str:
    if r is None:
        return ""
    if "failed" in r:
        return f"failed ({r['failed'][:40]})"
    return f"{r['median_s']:.2f} / {r['length'] / r['median_s']:,.0f} / {r['peak_mib'] / 1024:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", nargs="+", default=POINTS, help="SIZE:L1,L2,... for the converted models")
    p.add_argument("--fair", nargs="*", default=FAIR, help="SIZE:L1,... run with fair-esm (beside the anchors)")
    p.add_argument("--kernel", default="softmax", help="attention kernel of the converted models (softmax = FAVOR+)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="seconds before a point is killed")
    p.add_argument("--no-doc", action="store_true", help="print only; do not update docs/esm.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", default="8M", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--run-fair", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    ours = {(s, L): measure_point(s, L, a, False) for s, L in parse(a.points)}
    fair = {(s, L): measure_point(s, L, a, True) for s, L in parse(a.fair or [])}
    for row in common.anchors("ESM-2 embedding"):  # fair-esm, measured earlier (docs/anchors.md)
        L = int(common.number(row["L"]))
        for size in ("8M", "35M"):
            text = row.get(f"ESM-2 {size}", "")
            parts = [t.strip() for t in text.split("/")]
            if len(parts) == 3 and (size, L) not in fair:
                fair[(size, L)] = {"impl": "fair-esm (anchor)", "size": size, "length": L, "median_s": common.number(parts[0]),
                                   "peak_mib": common.number(parts[2]) * 1024, "anchor": True}
            elif text.startswith("does not fit"):
                fair.setdefault((size, L), {"failed": text})
    import torch
    lengths = sorted({L for _, L in ours} | {L for _, L in fair})
    sizes = [s for s in SHAPES if any(k[0] == s for k in ours) or any(k[0] == s for k in fair)]
    header = ["L"] + [h for s in sizes for h in (f"{s} converted ({a.kernel})", f"{s} fair-esm")]
    rows = [[f"{L:,}"] + [c for s in sizes for c in (cell(ours.get((s, L))), cell(fair.get((s, L))))]
            for L in lengths]
    params = {s: next((r["params"] for (t, _), r in ours.items() if t == s and "params" in r), None) for s in sizes}
    lines = [f"Generated by `{common.command_line(__file__)}` (CPU: {common.cpu()}, {a.threads} threads, torch "
             f"{torch.__version__}, fp32, load {common.load_average()} at the end).", "",
             "Cells: seconds / residues per second / peak GiB (the process's peak RSS, model and torch included). "
             "One random protein, batch of one, mean of the last layer; random weights. fair-esm cells marked "
             "with * are quoted from docs/anchors.md (same machine, measured earlier); the others ran here. "
             "Parameters: " + ", ".join(f"{s} {n / 1e6:.1f} M" for s, n in params.items() if n) + ".", ""]
    for (s, L), r in fair.items():
        if r.get("anchor"):
            i = lengths.index(L)
            j = 1 + 2 * sizes.index(s) + 1
            rows[i][j] += " *"
    lines += common.md_table(header, rows)
    common.publish(lines, None if a.no_doc else DOC, START, END)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()

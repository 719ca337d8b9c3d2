"""benchmarks/quality/long_context.py --per-protein: each protein's figures are evaluate's on that protein
alone, the gap is their ratio, and the repeat measure is zlib's size (a repeat compresses)."""
import math
import random
import statistics
import zlib
from types import SimpleNamespace

import torch

from benchmarks.quality import long_context
from conftest import TINY_MODEL, save_checkpoint
from protein_performer import evaluate as E
from protein_performer.hub.load import load_model
from protein_performer.training.task import ProteinLM


def test_per_protein_reports_each_protein_alone_and_its_compressed_size(tmp_path):
    models = []
    for seed, kernel in ((0, "softmax"), (1, "elu")):
        torch.manual_seed(seed)
        task = ProteinLM(model={**TINY_MODEL, "attention": {"kernel": kernel, "nb_features": 16}}, objective="mlm")
        models.append(load_model(save_checkpoint(task, tmp_path / f"{kernel}.ckpt")))
    repeat = "MKTAYIAKQRQISFVKSHFSRQ" * 12                 # a protein made of one repeat: compresses well
    rng = random.Random(0)
    other = "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(264))   # no repeat
    half = other[:132] * 2                                           # half repeat
    records = [SimpleNamespace(id="rep", sequence=repeat), SimpleNamespace(id="other", sequence=other),
               SimpleNamespace(id="half", sequence=half)]
    lines = long_context.per_protein(["a", "b"], models, records)
    rows = {line.strip("| ").split(" | ")[0]: line.strip("| ").split(" | ") for line in lines
            if line.startswith(("| rep", "| other", "| half"))}
    exact_gap, exact_size = {}, {}
    for r in records:
        pa, pb = (E.evaluate_model(m, [r.sequence], progress=False)["perplexity"] for m in models)
        exact_gap[r.id] = 100 * (pa / pb - 1)
        exact_size[r.id] = len(zlib.compress(r.sequence.encode(), 9)) / len(r.sequence)
        cells = [c.strip() for c in rows[r.id]]
        assert cells[2] == f"{pa:.3f}" and cells[3] == f"{pb:.3f}" and pa != pb
        assert cells[4] == f"{100 * (pa / pb - 1):+.2f} %"
        assert cells[5] == f"{len(zlib.compress(r.sequence.encode(), 9)) / len(r.sequence):.3f}"
    assert float(rows["rep"][5]) < 0.5 * float(rows["other"][5])
    gaps = {k: float(v[4].rstrip(" %")) for k, v in rows.items()}
    order = [line.strip("| ").split(" | ")[0] for line in lines if line.startswith(("| rep", "| other", "| half"))]
    assert order == sorted(gaps, key=gaps.get, reverse=True)              # largest gap first
    r = statistics.correlation([exact_gap[k] for k in order], [exact_size[k] for k in order])
    scores = {r.id: [E.evaluate_model(m, [r.sequence], progress=False) for m in models] for r in records}
    nll = [sum(v[i]["loss"] * v[i]["num_tokens"] for v in scores.values()) for i in (0, 1)]
    n = sum(v[0]["num_tokens"] for v in scores.values())
    pooled = 100 * (math.exp(nll[0] / n) / math.exp(nll[1] / n) - 1)       # as evaluate pools a bucket
    assert lines[-3].startswith(f"a against b over the 3 proteins (pooled as a length bucket): {pooled:+.2f} % (95 % interval ")
    assert lines[-1] == (f"a behind on {sum(g > 0 for g in gaps.values())} of 3 proteins; correlation of the gap "
                         f"with the compressed size: r = {r:.2f}")


def test_set_gap_pools_tokens_and_its_interval_covers_the_spread_between_proteins():
    # by hand: NLL 2 + 4 against 1 + 1 over 1 + 3 tokens -> exp(6/4 - 2/4) - 1
    gap, low, high = long_context.set_gap([2.0, 4.0], [1.0, 1.0], [1, 3])
    assert abs(gap - 100 * (math.e - 1)) < 1e-9 and low <= gap <= high
    # per-token gaps of 1 and 2/3 nats: pooled by tokens (3/4 nat), not the mean of the proteins' gaps
    gap, _, _ = long_context.set_gap([2.0, 3.0], [1.0, 1.0], [1, 3])
    assert abs(gap - 100 * math.expm1(0.75)) < 1e-9
    # the same per-token shift in every protein: every resample gives it, the interval is a point
    b, n = [30.0, 55.0, 12.0, 80.0], [10, 20, 5, 30]
    a = [x + 0.01 * k for x, k in zip(b, n)]
    gap, low, high = long_context.set_gap(a, b, n)
    assert abs(gap - 100 * math.expm1(0.01)) < 1e-9 and abs(low - gap) < 1e-9 and abs(high - gap) < 1e-9
    # one protein far behind, the rest level: the pooled gap is positive, the interval reaches 0 (the
    # resamples without that protein) and above the pooled gap (those with it twice)
    a = b[:3] + [b[3] + 0.2 * n[3]]
    gap, low, high = long_context.set_gap(a, b, n)
    assert gap > 0 and abs(low) < 1e-9 and high > gap

"""benchmarks/long_context.py --per-protein: each protein's figures are evaluate's on that protein
alone, the gap is their ratio, and the repeat measure is zlib's size (a repeat compresses)."""
import random
import statistics
import zlib
from types import SimpleNamespace

import torch

from benchmarks import long_context
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
    assert lines[-1] == (f"a behind on {sum(g > 0 for g in gaps.values())} of 3 proteins; correlation of the gap "
                         f"with the compressed size: r = {r:.2f}")

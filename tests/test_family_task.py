"""The fifth downstream task's builder (data/labeled/scripts/family_task.py) and the recipe study's table
(benchmarks/quality/recipes.py), on inputs written here."""
import csv
import gzip
import io
import json

import pytest

import family_task  # data/labeled/scripts/ (pyproject: pytest pythonpath)
from benchmarks.quality import recipes

HEADERS = [  # (UniProt header, the family it names: by hand)
    ("tr|A1|A1_ECOLI Threonine--tRNA ligase OS=Escherichia coli PE=3 SV=1", "tRNA ligase"),
    ("tr|A2|A2_BACSU Threonine--tRNA ligase OS=Bacillus subtilis PE=3 SV=1", "tRNA ligase"),
    ("tr|A3|A3_BACSU Threonine--tRNA ligase (Fragment) OS=Bacillus subtilis PE=3 SV=1", "tRNA ligase"),
    ("sp|B1|RL2_ECOLI 50S ribosomal protein L2 OS=Escherichia coli PE=1 SV=1", "ribosomal protein"),
    ("tr|C1|C1_HUMAN Serine/threonine-protein kinase OS=Homo sapiens PE=2 SV=1", "kinase"),
    ("tr|C2|C2_HUMAN Uncharacterized protein OS=Homo sapiens PE=4 SV=1", None),
    ("tr|C3|C3_HUMAN Kinase-associated peptidase OS=Homo sapiens PE=4 SV=1", None),   # two families: dropped
    ("tr|C4|C4_HUMAN Glucose dehydrogenase OS=Homo sapiens PE=4 SV=1", "oxidoreductase"),
]


def write_fasta(path, long_one=False):
    text = "".join(f">{h}\n{'MKV' * (400 if long_one and k == 0 else 10)}\n" for k, (h, _) in enumerate(HEADERS))
    path.write_text(text)
    return path


def test_families_by_hand_and_one_name_stays_in_one_split(tmp_path):
    rows = family_task.labeled(write_fasta(tmp_path / "in.fasta"), 1000)
    assert [(acc, label) for acc, _, label, _ in rows] == [
        (h.split("|")[1], f) for h, f in HEADERS if f is not None]
    # "(Fragment)" is not part of the name: A1-A3 are one name, so one split
    split = dict(zip([r[0] for r in rows], family_task.split_by_name(rows, seed=0)))
    assert len({split["A1"], split["A2"], split["A3"]}) == 1
    assert [r[0] for r in family_task.labeled(write_fasta(tmp_path / "long.fasta", True), 1000)][0] == "A2"


def test_the_built_file_is_the_same_bytes_every_time_and_reads_back(tmp_path):
    src = write_fasta(tmp_path / "in.fasta")
    outs = []
    for k in range(2):
        family_task.main(["--input", str(src), "--output", str(tmp_path / f"out{k}.csv.gz")])
        outs.append((tmp_path / f"out{k}.csv.gz").read_bytes())
    assert outs[0] == outs[1]
    rows = list(csv.DictReader(io.StringIO(gzip.decompress(outs[0]).decode())))
    assert [r["label"] for r in rows] == [f for _, f in HEADERS if f is not None]
    assert {r["split"] for r in rows} <= {"train", "valid", "test"} and rows[0]["sequence"] == "MKV" * 10
    assert not list(tmp_path.glob("*.part"))


def test_the_recipe_table_means_spreads_and_changes_by_hand(tmp_path):
    raw = tmp_path / "rows.jsonl"
    rows = []
    for seed, (base, other, som, probe, comp) in enumerate([(0.60, 0.70, 0.66, 0.55, 0.50),
                                                            (0.64, 0.66, 0.64, 0.57, 0.52)]):
        for recipe, acc, kept in (("base", base, "epoch 3"), ("freeze_2", other, "probe"),
                                  ("stop_on_metric", som, "0.5 epoch 2 + 0.5 probe" if seed == 0 else "epoch 2")):
            rows.append({"kind": "finetune", "recipe": recipe, "task": "scop", "seed": seed,
                         "test": {"accuracy": acc}, "selection": {"kept": kept}})
        rows.append({"kind": "baseline", "recipe": None, "task": "scop", "seed": seed,
                     "probe": {"accuracy": probe}, "composition": {"accuracy": comp}})
    rows.append(dict(rows[0], test={"accuracy": 0.62}))  # a later row replaces the earlier one
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = recipes.render(recipes.read_rows(raw))
    lines = {line.split(" | ")[0]: line for line in table if line.startswith("| ")}
    # base: seeds 0.62 and 0.64 -> 0.630 ± 0.010; freeze_2: 0.70, 0.66 -> 0.680 ± 0.020, Δ vs base
    # ((0.70 - 0.62) + (0.66 - 0.64)) / 2, vs stop_on_metric ((0.70 - 0.66) + (0.66 - 0.64)) / 2; stop_on_metric:
    # 0.66, 0.64, Δ vs base ((0.66 - 0.62) + 0) / 2; kept: the probe, then a mix (names with " + ")
    assert lines["| base"] == "| base | 0.630 ± 0.010 | – | -0.020 | 0, 0 of 2 |"
    assert lines["| freeze_2"] == "| freeze_2 | 0.680 ± 0.020 | +0.050 | +0.030 | 2, 0 of 2 |"
    assert lines["| stop_on_metric"] == "| stop_on_metric | 0.650 ± 0.010 | +0.020 | – | 0, 1 of 2 |"
    assert lines["| probe"] == "| probe | 0.560 ± 0.010 | – | – | – |"
    assert lines["| composition"] == "| composition | 0.510 ± 0.010 | – | – | – |"


def test_the_gate_table_by_hand(tmp_path):
    """min_confidence read off stop_on_metric and ensemble rows: a fine-tuned candidate is kept at a
    threshold only when its confidence reaches it, else the probe (the baseline row's test value)."""
    raw = tmp_path / "rows.jsonl"
    runs = [("stop_on_metric", "scop", 0, 0.60, "epoch 2", 0.95, 0.55),
            ("stop_on_metric", "scop", 1, 0.54, "epoch 3", 0.60, 0.57),
            ("stop_on_metric", "signalp", 0, 0.88, "probe", None, 0.88),
            ("stop_on_metric", "family", 0, 0.42, "epoch 2", 0.85, 0.44),
            ("ensemble", "scop", 0, 0.62, "ensemble: 0.5 epoch 2 + 0.5 probe", 0.97, 0.55),
            ("ensemble", "family", 0, 0.47, "ensemble: 0.5 epoch 2 + 0.5 probe", 0.92, 0.44)]
    rows = []
    for recipe, task, seed, acc, kept, confidence, probe in runs:
        selection = {"kept": kept, **({"confidence": confidence} if confidence is not None else {})}
        rows += [{"kind": "finetune", "recipe": recipe, "task": task, "seed": seed,
                  "test": {"accuracy": acc}, "selection": selection},
                 {"kind": "baseline", "recipe": None, "task": task, "seed": seed,
                  "probe": {"accuracy": probe}, "composition": {"accuracy": 0.3}}]
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = recipes.render_gate(recipes.read_rows(raw))
    assert ("by run: `stop_on_metric`: signalp 0: nan, scop 0: 0.950, scop 1: 0.600, family 0: 0.850; "
            "`ensemble`: scop 0: 0.970, family 0: 0.920 (") in table[0]
    lines = {tuple(line.split(" | ")[:2]): line for line in table if line.startswith("| ") and "Δ" not in line}
    # bundled, thresholds 0 and 0.5: both scop epochs kept, (+0.05 - 0.03 + 0) / 3, scop 1 below, signalp's
    # probe kept on its own; from 0.8 scop 1 (0.60) gives way to its probe: 0.05 / 3; at 0.95 scop 0 (0.95)
    # still reaches it. family: its epoch (0.85) kept up to 0.8, -0.02 below the probe; the probe from 0.9.
    s = "| stop_on_metric"
    assert lines[s, "0"] == f"{s} | 0 | +0.007 | 1 of 3 | 1 | -0.020 | 1 of 1 | 0 |"
    assert lines[s, "0.5"] == f"{s} | 0.5 | +0.007 | 1 of 3 | 1 | -0.020 | 1 of 1 | 0 |"
    assert lines[s, "0.8"] == f"{s} | 0.8 | +0.017 | 0 of 3 | 2 | -0.020 | 1 of 1 | 0 |"
    assert lines[s, "0.9"] == f"{s} | 0.9 | +0.017 | 0 of 3 | 2 | +0.000 | 0 of 1 | 1 |"
    assert lines[s, "0.95"] == f"{s} | 0.95 | +0.017 | 0 of 3 | 2 | +0.000 | 0 of 1 | 1 |"
    # the ensemble: scop 0 +0.07 kept at every threshold (0.97); family +0.03 kept up to 0.9 (0.92), the probe at 0.95
    e = "| ensemble"
    assert lines[e, "0.9"] == f"{e} | 0.9 | +0.070 | 0 of 1 | 0 | +0.030 | 0 of 1 | 0 |"
    assert lines[e, "0.95"] == f"{e} | 0.95 | +0.070 | 0 of 1 | 0 | +0.000 | 0 of 1 | 1 |"


@pytest.mark.parametrize("text", ["", "\n"])
def test_no_rows_no_table_rows(tmp_path, text):
    (tmp_path / "rows.jsonl").write_text(text)
    assert recipes.read_rows(tmp_path / "rows.jsonl") == {}

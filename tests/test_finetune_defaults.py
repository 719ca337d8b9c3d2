"""benchmarks/quality/finetune_defaults.py: the drawn task's proteins against the family file's own split column,
and the table's differences against hand-computed ones."""
import csv
import gzip

from benchmarks.quality import finetune_defaults as B
from protein_performer import finetune as FT


def file_splits() -> dict[str, str]:
    with gzip.open(B.downstream.LABELED / "uniprot_family_names.csv.gz", "rt") as fh:
        return {r["id"]: r["split"] for r in csv.DictReader(fh)}


def test_draw_takes_train_and_test_proteins_from_their_splits_and_no_validation(tmp_path):
    ex, chosen = B.draw(30, 10, seed=0)
    split = file_splits()
    assert [len(chosen["train"]), len(chosen["test"])] == [30, 10]
    assert {split[ex.ids[i]] for i in chosen["train"]} == {"train"}
    assert {split[ex.ids[i]] for i in chosen["test"]} == {"test"}
    assert B.draw(30, 10, seed=0)[1] == chosen and B.draw(30, 10, seed=1)[1] != chosen
    back = FT.read_examples(B.downstream.write_labels(tmp_path / "t.csv", ex, chosen), "classification")
    assert sorted(back.split) == ["test"] * 10 + ["train"] * 30  # finetune holds out its own validation
    assert back.labels == [ex.labels[i] for i in chosen["train"] + chosen["test"]]


def test_table_differences_by_hand():
    def run(seed, acc, minutes):
        return {"seed": seed, "wall_seconds": minutes * 60, "metrics": {
            "epochs": 3, "accuracy": acc, "macro_f1": acc / 2, "selection": {"kept": "probe"},
            "pooling": {"chosen": "mean"}}}
    res = {"meta": {"commit": "abc", "date": "d", "cpu": "x", "threads": 2, "load": "l", "ckpt": "c", "data_seed": 0,
                    "used": {"train": 30, "test": 10}},
           "baselines": {"probe": {"accuracy": 0.40}, "composition": {"accuracy": 0.30}},
           "runs": [run(0, 0.45, 12.0), run(1, 0.38, 21.5)]}
    text = B.render(res, "cmd")
    assert "| 0 | 12.0 min | 3 | 0.450 | 0.225 | +0.050 | +0.150 | probe | mean |" in text
    assert "| 1 | 21.5 min | 3 | 0.380 | 0.190 | -0.020 | +0.080 | probe | mean |" in text
    assert "Longest run 21.5 min (goal: 20); mean change against the probe +0.015, 1 of 2 runs below it." in text
    assert "output_dir=D seed=S`, nothing else set" in text
    res["meta"]["overrides"] = ["pooling_by=cv"]  # an option timed as a user runs it: the command line says so
    assert "output_dir=D seed=S pooling_by=cv`, nothing else set" in B.render(res, "cmd")

"""Equal time measured side by side (training/step_cost.py): the budget walk, the timing, compare's use of it."""
import json
from pathlib import Path

import pytest
from conftest import ROOT, sample_fasta

from protein_performer.errors import UserError
from protein_performer.training import step_cost
from protein_performer.training.step_cost import crop_schedule, measure_step_costs, steps_within


def test_steps_within_walks_the_curriculum_at_each_crops_cost():
    schedule = [(0, 256), (3, 1024), (5, 4096)]
    cost = {256: 1.0, 1024: 2.0, 4096: 5.0}
    # steps 0-2 at 1 s (3 s), 3-4 at 2 s (7 s), then 5 s each: 12, 17, ...
    assert steps_within(schedule, cost, 2.5) == 2
    assert steps_within(schedule, cost, 7.0) == 5
    assert steps_within(schedule, cost, 16.9) == 6
    assert steps_within(schedule, cost, 17.0) == 7
    assert steps_within([(0, 64)], {64: 0.5}, 10.0) == 20
    assert steps_within(schedule, cost, 0.5) == 0


def test_crop_schedule_of_a_data_config():
    from omegaconf import OmegaConf
    assert crop_schedule(OmegaConf.create({"max_len": 512, "max_tokens": None, "crop_schedule": None})) == [(0, 512)]
    cfg = OmegaConf.create({"max_len": 8192, "max_tokens": 8192, "crop_schedule": [[0, 256], [50, 1024]]})
    assert crop_schedule(cfg) == [(0, 256), (50, 1024)]
    capped = OmegaConf.create({"max_len": 512, "max_tokens": 8192, "crop_schedule": [[0, 256], [50, 1024]]})
    assert crop_schedule(capped) == [(0, 256), (50, 512)]  # the sampler caps crops at max_len


def test_measured_costs_grow_with_the_crop_and_the_model(tmp_path):
    from protein_performer.compare import compose_train_config
    common = [f"data.path={sample_fasta(tmp_path / 'train.fasta', 200)}", "data.max_len=1024", "data.max_tokens=1024",
              "data.crop_schedule=[[0,32],[2,1024]]", "model.depth=1", "model.attention.nb_features=16",
              "logger=none", "seed=0"]
    cfgs = {"small": compose_train_config(["model=linear", *common, "model.dim=32", "model.heads=2"]),
            "wide": compose_train_config(["model=linear", *common, "model.dim=256", "model.heads=4"])}
    costs = measure_step_costs(cfgs, reps=3)
    assert set(costs) == {"small", "wide"} and set(costs["small"]) == {32, 1024}
    assert all(t > 0 for per in costs.values() for t in per.values())
    assert costs["wide"][1024] > costs["small"][1024]  # 8x the width: 64x the matmul work per token


def test_the_cost_is_the_mean_of_the_timed_steps_after_the_warm_up(tmp_path, monkeypatch):
    # a clock read once before the (untimed) warm-up, then twice per timed step: 1, 1 and 4 s, mean 2 (median 1)
    from types import SimpleNamespace

    from protein_performer.compare import compose_train_config
    ticks = iter([0.0, 100.0, 101.0, 101.0, 102.0, 102.0, 106.0])
    cfg = compose_train_config(["model=linear", f"data.path={sample_fasta(tmp_path / 'train.fasta', 100)}",
                                "data.max_len=64", "model.dim=32", "model.depth=1", "model.heads=2", "logger=none"])
    monkeypatch.setattr(step_cost, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert measure_step_costs({"m": cfg}, reps=3) == {"m": {64: 2.0}}


def test_compare_refuses_a_bad_time_budget_in_one_line_before_any_work(tmp_path):
    from protein_performer.compare import compare
    heldout = ROOT / "data/heldout/uniprotkb_mix_heldout_2k.fasta.gz"
    for budget, reps, message in ((0, None, "time_budget must be a positive number of seconds"),
                                  ("7min", None, "time_budget must be a positive number of seconds"),
                                  (60, 0, "calibration_reps must be a whole number >= 1"),
                                  (60, 2.5, "calibration_reps must be a whole number >= 1")):
        with pytest.raises(UserError, match=message):
            compare(["linear"], ["logger=none"], heldout, tmp_path / "out", time_budget=budget, calibration_reps=reps)
    assert not (tmp_path / "out").exists()


def test_compare_with_a_time_budget_trains_each_model_for_its_measured_steps(tmp_path):
    # the default data's curriculum (256 -> 8192) capped at max_len 64: one crop, 64
    from protein_performer.compare import compare
    overrides = [f"data.path={sample_fasta(tmp_path / 'train.fasta', 300)}", "data.max_len=64", "data.batch_size=8",
                 "data.valid_fraction=0.1", "model.dim=32", "model.depth=1", "model.heads=2",
                 "model.attention.nb_features=16", "trainer.max_steps=-1", "trainer.val_check_interval=1000000",
                 "trainer.enable_progress_bar=false", "logger=none", "seed=0"]
    heldout = ROOT / "data/heldout/uniprotkb_mix_heldout_2k.fasta.gz"
    doc = tmp_path / "comparison.md"
    res = compare(["linear", "transformer"], overrides, heldout, tmp_path / "out", doc=doc, max_records=8,
                  progress=False, time_budget=4.0, calibration_reps=2)
    cal = json.loads((tmp_path / "out/calibration.json").read_text())
    for name in ("linear", "transformer"):
        per_step = cal["seconds_per_step"][name]["64"]
        assert cal["steps"][name] == steps_within([(0, 64)], {64: per_step}, 4.0) > 0
        assert res[name]["step"] == cal["steps"][name]  # trained for exactly its measured count
    assert "Equal time, measured side by side (`time_budget=4`)" in doc.read_text()
    with pytest.raises(UserError, match="time_budget=0.001 s buys no training step of linear"):
        compare(["linear"], overrides, heldout, tmp_path / "out2", max_records=8, progress=False, time_budget=0.001,
                calibration_reps=1)
    assert not (tmp_path / "out2" / "runs").exists()  # refused before any training
    assert f"| linear | {cal['seconds_per_step']['linear']['64']:.3f} | {cal['steps']['linear']} |" in doc.read_text()


def test_long_proteins_budget_is_paired_and_not_a_sequential_max_time():
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("long_proteins")
    assert cfg.time_budget == 420 and cfg.train.trainer.get("max_time") is None
    with pytest.raises(KeyError):
        steps_within([(0, 64)], {}, 1.0)  # a crop without a measured cost is an error, not a free step

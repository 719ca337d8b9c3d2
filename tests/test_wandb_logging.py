"""A wandb run holds what is needed to compare it: the whole resolved config, throughput and
peak memory, and with ``logger.log_model=true`` the final checkpoints. wandb runs offline
(no login); the test reads the run back from its ``.wandb`` record log."""
import base64
import glob
import hashlib
import json
import resource
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from protein_performer.training import run_logging
from protein_performer.formats.fasta import read_fasta
from protein_performer.training.run_logging import Throughput
from protein_performer.training.run import train

from conftest import ROOT



def wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: a LevelDB-style log (7-byte file header, 32 KiB
    blocks, records split into FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4 pieces with 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2 as pb
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    pos, pieces = 7, b""
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer (padding)
            pos += left
            continue
        if pos + 7 + n > len(raw):  # a record still being written
            return
        pieces += raw[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


def read_offline_run(save_dir: Path, wait_s: float = 60) -> dict:
    """The run's config, history rows and artifacts, once its log holds the final ``exit`` record:
    ``wandb.finish()`` can return before wandb-core has flushed the log to disk (a run read at
    once was seen without its config records under load)."""
    deadline, path, kinds = time.monotonic() + wait_s, None, []
    while True:
        paths = glob.glob(str(save_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(paths) <= 1, paths
        if paths:
            path = Path(paths[0])
            records = list(wandb_records(path))
            kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert "exit" in kinds, f"{path}: no exit record after {wait_s} s; records: {kinds}"
    run = {"config": {}, "history": [], "artifacts": []}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "config":
            run["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            run["history"].append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
        elif kind == "artifact":
            run["artifacts"].append(r.artifact)
    return run


def test_throughput_counts_real_tokens_per_training_second(monkeypatch):
    """Against a hand count: padding excluded, validation time excluded, rank 0's count times
    the world size, logged at Lightning's own steps and cadence."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(run_logging, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    logged = []
    loop = SimpleNamespace(_batches_that_stepped=0)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop), global_step=0, log_every_n_steps=2,
                              world_size=2, is_global_zero=True, sanity_checking=False,
                              state=SimpleNamespace(fn="fit"), strategy=SimpleNamespace(root_device=torch.device("cpu")),
                              loggers=[SimpleNamespace(log_metrics=lambda m, step: logged.append((step, m)))])
    cb = Throughput()
    cb.on_train_start(trainer, None)

    def batch_ends(at: float, real: int, padded: int):
        clock.now = at
        batch = {"padding_mask": torch.tensor([False] * real + [True] * padded)}
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, None, None, batch, 0)
        loop._batches_that_stepped += 1  # Lightning counts the step after the hook

    batch_ends(1.0, real=10, padded=6)
    batch_ends(2.0, real=6, padded=10)  # step 1: (1 + 1) % 2 == 0 -> 16 tokens in 2 s
    clock.now = 2.0
    cb.on_validation_start(trainer, None)
    clock.now = 5.0  # 3 s of validation, not training
    cb.on_validation_end(trainer, None)
    batch_ends(6.0, real=5, padded=0)
    batch_ends(7.0, real=7, padded=1)  # step 3: 12 tokens in (2 - 2) + (7 - 5) = 2 s
    assert [(s, m["perf/tokens_per_s"]) for s, m in logged] == [(1, 16 / 2 * 2), (3, 12 / 2 * 2)]
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert all(0 < m["perf/peak_rss_mb"] <= rss_mb for _, m in logged)
    assert all("perf/peak_cuda_mb" not in m for _, m in logged)  # CPU run


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    for var, sub in (("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_ARTIFACT_DIR", "artifacts")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_offline_run_holds_config_throughput_and_final_checkpoints(tmp_path, offline_wandb):
    fasta = tmp_path / "small.fasta"
    with open(fasta, "w") as f:
        for i, r in enumerate(read_fasta(ROOT / "data" / "sample" / "swissprot_sample_20k.fasta.gz")):
            if i == 200:
                break
            f.write(f">{r.id}\n{r.sequence}\n")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[
            "model.dim=16", "model.depth=1", "model.heads=2", "model.attention.nb_features=8",
            f"data.path={fasta}", "data.max_len=48", "data.batch_size=16", "data.max_tokens=null",
            "data.crop_schedule=null", "data.valid_fraction=0.1", "optim.warmup_steps=2",
            "trainer.max_steps=4", "trainer.log_every_n_steps=2", "trainer.enable_progress_bar=false",
            "logger=wandb", f"logger.save_dir={tmp_path}", "logger.log_model=true"])
    summary, task = train(cfg, tmp_path)
    run = read_offline_run(tmp_path)

    # the whole resolved config, not only the module's hyperparameters
    want = OmegaConf.to_container(cfg, resolve=True)
    for key in ("data", "trainer", "objective", "model", "optim", "seed"):
        assert run["config"][key] == want[key], key
    assert run["config"]["trainer"]["max_steps"] == 4 and run["config"]["objective"]["name"] == "mlm"
    module = run["config"]["module"]
    assert module["parameters"] == sum(p.numel() for p in task.parameters())
    assert module["aa_frequencies"] == [round(f, 5) for f in task.hparams.aa_frequencies]  # rounded

    # throughput rows at the steps Lightning gives its own training metrics
    perf = {h["trainer/global_step"]: h for h in run["history"] if "perf/tokens_per_s" in h}
    loss_steps = {h["trainer/global_step"] for h in run["history"] if "train/loss" in h}
    assert sorted(perf) == sorted(loss_steps) == [1, 3]
    assert all(h["perf/tokens_per_s"] > 0 and h["perf/peak_rss_mb"] > 0 for h in perf.values())

    # the final checkpoints, as stored on disk (max_steps below val_check_interval: best-4 from the final validation)
    (art,) = run["artifacts"]
    assert art.type == "model" and art.name.startswith("model-") and "latest" in art.aliases
    assert json.loads(art.metadata)["step"] == 4
    ckpts = tmp_path / "checkpoints"
    assert {c.path for c in art.manifest.contents} == {p.name for p in ckpts.iterdir()} == {"last.ckpt", "best-4.ckpt"}
    for c in art.manifest.contents:
        assert c.digest == base64.b64encode(hashlib.md5((ckpts / c.path).read_bytes()).digest()).decode()
    assert abs(json.loads(art.metadata)["val/loss"] - summary["val/loss"]) < 1e-9

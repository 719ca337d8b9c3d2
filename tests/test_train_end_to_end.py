"""Tiny real training runs through the same code path as scripts/train.py."""
import csv
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from hydra import compose, initialize_config_dir

from protein_performer.data.collate import Collator
from protein_performer.training.task import load_checkpoint
from protein_performer.training.run import train

from conftest import ROOT, sample_fasta
from forkserver import forks

TINY = ["model.dim=32", "model.depth=2", "model.heads=2", "model.attention.nb_features=16",
        "model.dropout=0.0", "data.max_len=64", "data.batch_size=16", "data.valid_fraction=0.1",
        "optim.warmup_steps=5", "optim.lr=3e-3"]


@pytest.fixture(scope="module")
def small_fasta(tmp_path_factory):
    return sample_fasta(tmp_path_factory.mktemp("data") / "small.fasta.gz", 400)


def _read_losses(run_dir: Path) -> list[float]:
    rows = list(csv.DictReader(open(next(run_dir.rglob("metrics.csv")))))
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


@pytest.mark.parametrize("objective,kernel", [("mlm", "softmax"), ("clm", "relu")])
def test_tiny_run_learns_checkpoints_and_reloads(tmp_path, small_fasta, objective, kernel):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=TINY + [
            f"objective={objective}", f"model.attention.kernel={kernel}", f"data.path={small_fasta}",
            "trainer.max_steps=50", "trainer.val_check_interval=30", "trainer.log_every_n_steps=5",
            "trainer.enable_progress_bar=false", "logger=csv", f"logger.save_dir={tmp_path}"])
    metrics, task = train(cfg, tmp_path)
    losses = _read_losses(tmp_path)
    assert len(losses) >= 10
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.1, f"loss did not fall: {losses}"
    assert (tmp_path / "config.yaml").read_text().count(f"name: {objective}") == 1
    ckpts = {p.name for p in (tmp_path / "checkpoints").iterdir()}
    assert "last.ckpt" in ckpts and any(n.startswith("best-") for n in ckpts)
    assert metrics["val/perplexity"] > 1 and 0 <= metrics["val/accuracy"] <= 1
    # the unigram baseline of real proteins is near 2^4.19 ~ 18 (residues only, also for clm)
    assert 15 < metrics["val/baseline_perplexity"] < 21
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 50

    # reload: identical outputs (feature-map projections are saved, not redrawn)
    reloaded = load_checkpoint(str(tmp_path / "checkpoints" / "last.ckpt"))
    task.eval()
    seqs = [torch.from_numpy(task.tokenizer.encode(s)).long() for s in ["MKTAYIAKQRQISFVKSHFSRQ", "MVLSPADKTNV"]]
    batch = Collator(task.tokenizer, objective, fixed_seed=0)(seqs)
    with torch.no_grad():
        a = task(batch["inputs"], batch["padding_mask"])
        b = reloaded(batch["inputs"], batch["padding_mask"])
    assert torch.equal(a, b)
    assert reloaded.hparams.objective == objective and reloaded.model.causal == (objective == "clm")
    assert abs(sum(reloaded.hparams.aa_frequencies) - 1) < 1e-9


def test_command_line_run_with_wandb_offline(tmp_path, small_fasta):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    run_dir = tmp_path / "run"
    out = forks().run([sys.executable, str(ROOT / "scripts" / "train.py"), *TINY, f"data.path={small_fasta}",
                       "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.enable_progress_bar=false",
                       f"hydra.run.dir={run_dir}"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "validation: perplexity" in out.stdout and "amino-acid frequency baseline" in out.stdout
    recorded = OmegaConf.load(run_dir / "config.yaml")
    assert recorded.model.attention.kernel == "softmax"
    assert recorded.compile is False and recorded.data.buckets is None  # compile=auto on a CPU: eager, no buckets
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb wrote an offline run"

    # resume from the checkpoint for a few more steps
    out2 = forks().run([sys.executable, str(ROOT / "scripts" / "train.py"), *TINY, f"data.path={small_fasta}",
                        "trainer.max_steps=9", "trainer.val_check_interval=3", "trainer.enable_progress_bar=false",
                        "logger=none", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", "data.buckets=[128,64]",
                        f"hydra.run.dir={tmp_path / 'resumed'}"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert out2.returncode == 0, out2.stderr[-3000:]
    ck = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ck["global_step"] == 9
    # buckets asked for in an eager run (auto: only when compiled): the set in force recorded, sorted, and
    # logged with the padding
    assert list(OmegaConf.load(tmp_path / "resumed" / "config.yaml").data.buckets) == [64, 128]
    assert "length buckets (data.buckets): 64, 128\n" in out2.stdout + out2.stderr
    assert re.search(r"padding: [\d.]+ % of this epoch's batch tokens with buckets", out2.stdout + out2.stderr)


def test_bad_config_key_and_missing_checkpoint_are_clear(tmp_path):
    out = forks().run([sys.executable, str(ROOT / "scripts" / "train.py"), "model.no_such_key=1",
                       f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode != 0 and "no_such_key" in out.stderr
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        load_checkpoint(str(tmp_path / "nope.ckpt"))


def test_a_file_that_is_not_a_checkpoint_is_a_one_line_error(tmp_path):
    junk = tmp_path / "notes.ckpt"
    junk.write_text("this is not a checkpoint\n")
    with pytest.raises(ValueError, match=r"checkpoint .*notes\.ckpt: cannot load"):
        load_checkpoint(str(junk))

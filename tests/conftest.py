"""Shared test helpers."""
from pathlib import Path

import pytest
import pytorch_lightning as pl

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def root() -> Path:
    """The repository root (bundled data under ``root / "data"``, configs under ``root / "conf"``)."""
    return ROOT


def _fit_recording(model, dm, steps, tmp, ckpt=None, save_every=None):
    """Train ``model`` (a module that records what each training step saw in ``model.seen``) for
    ``steps`` steps on ``dm``, optionally checkpointing every ``save_every`` steps into ``tmp``
    or resuming from ``ckpt``; returns ``model.seen``."""
    cbs = [pl.callbacks.ModelCheckpoint(dirpath=tmp, every_n_train_steps=save_every, save_top_k=-1)] if save_every else []
    t = pl.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   limit_val_batches=0, callbacks=cbs, enable_checkpointing=bool(save_every), accelerator="cpu")
    t.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model.seen


@pytest.fixture
def fit_recording():
    return _fit_recording

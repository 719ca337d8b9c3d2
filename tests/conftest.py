"""Shared test helpers."""
import importlib
import os
import sys
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: N processes on N cores, one torch thread each
    os.environ["OMP_NUM_THREADS"] = "1"     # (and in the child processes the tests start)
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "sample" / "swissprot_sample_20k.fasta.gz"
HELDOUT = ROOT / "data" / "heldout" / "uniprotkb_mix_heldout_2k.fasta.gz"
#: a model small enough for tests (ProteinLM's ``model`` argument)
TINY_MODEL = dict(dim=32, depth=2, heads=2, dropout=0.0, attention=dict(kernel="softmax", nb_features=16))


def save_checkpoint(task, path) -> str:
    """Write ``task`` (a ProteinLM) as a Lightning checkpoint, as training would."""
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, max_steps=0, accelerator="cpu")
    trainer.strategy.connect(task)
    trainer.save_checkpoint(str(path))
    return str(path)


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


def run_command(name: str, capsys, *overrides: str) -> tuple[int, str, str]:
    """``protein-performer <name> OVERRIDES`` in this process, its config composed by Hydra and run
    inside the CLI's error wrapper: (exit status, stdout, stderr)."""
    import importlib

    from hydra import compose, initialize_config_dir

    from protein_performer.cli import COMMANDS
    from protein_performer.errors import cli
    module, function = COMMANDS[name].target.split(":")
    job = cli(getattr(importlib.import_module(module), function))
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(COMMANDS[name].config, overrides=list(overrides))
    capsys.readouterr()
    try:
        job(cfg)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def dead_pid() -> int:
    """The pid of a process that has exited: what a killed writer's temporary file is named by."""
    import subprocess
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def sample_fasta(path: Path, n: int) -> Path:
    """The first ``n`` proteins of the bundled sample as a FASTA file (gzipped when ``path`` ends in .gz)."""
    import gzip
    from protein_performer.formats.fasta import read_fasta
    with (gzip.open(path, "wt") if path.suffix == ".gz" else open(path, "w")) as f:
        for i, r in enumerate(read_fasta(SAMPLE)):
            if i == n:
                break
            f.write(f">{r.id}\n{r.sequence}\n")
    return path


@pytest.fixture(scope="module")
def small_fasta(tmp_path_factory):
    """The first 200 proteins of the bundled sample as a plain FASTA file."""
    return sample_fasta(tmp_path_factory.mktemp("data") / "small.fasta", 200)


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    """transformers, offline, its remote-code cache in a temporary folder (not ~/.cache)."""
    with pytest.MonkeyPatch.context() as mp:
        if "transformers" not in sys.modules:  # remote code is copied here, not into ~/.cache
            mp.setenv("HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf_modules")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]')")


def import_fla(module: str):
    """(fla's ``module``, None), or (None, why it cannot be imported here: the skip reason)."""
    with warnings.catch_warnings():   # fla warns that Triton has no GPU here
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(module), None
        except Exception as e:  # noqa: BLE001 - any import failure means: no fla here
            return None, f"flash-linear-attention not installed (pip install '.[gpu]'): {type(e).__name__}"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """A tiny masked-LM and a tiny causal-LM checkpoint (training amino-acid frequencies uniform over the
    25 residue tokens): {"mlm": path, "clm": path}."""
    import torch

    from protein_performer.training.task import ProteinLM
    d = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    freqs = [0.0] * 5 + [1 / 25] * 25
    return {obj: save_checkpoint(ProteinLM(model=TINY_MODEL, objective=obj, aa_frequencies=freqs), d / f"{obj}.ckpt")
            for obj in ("mlm", "clm")}

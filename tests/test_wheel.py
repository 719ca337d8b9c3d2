"""`pip install` of the built wheel (not this checkout) gives working commands, run from a
directory that is not the checkout: train, evaluate, embed and generate on the bundled data
give the same numbers as the checkout's commands (run in this process, through the console entry
point: a subprocess each would only add its start-up). The wheel goes into a fresh venv with
--no-deps; the dependencies come from this environment through a .pth file."""
import json
import os
import re
import fcntl
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from protein_performer.cli import COMMANDS

from conftest import ROOT
from inprocess import run_main

TINY = ["model.dim=32", "model.depth=1", "model.heads=2", "model.attention.nb_features=16", "model.dropout=0.0",
        "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
        "trainer.enable_progress_bar=false", "logger=none", "data.max_records=300", "data.max_len=128",
        "data.max_tokens=1024", "data.crop_schedule=null"]
VALIDATION = re.compile(r"validation: perplexity ([\d.]+)")


def sh(cmd, cwd, **kw):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def built_wheel(shared: Path) -> Path:
    """The checkout's wheel, built once for the session: pytest-xdist's workers share ``shared`` and
    take turns on a lock (two builds at once collide in the checkout's build/ folder)."""
    with open(shared / "wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        dist = shared / "wheel-dist"
        if not any(dist.glob("protein_performer-*.whl")):
            sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ROOT, "-w", dist],
               cwd=shared)
        return next(dist.glob("protein_performer-*.whl"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(protein-performer executable, the venv's python, a working directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    base = tmp_path_factory.getbasetemp()  # under xdist each worker's; their parent is this session's
    wheel = built_wheel(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)
    venv = tmp / "venv"
    sh([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    py = venv / "bin" / "python"
    site = Path(sh([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    (site / "outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the dependencies
    sh([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel], cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    where = sh([py, "-c", "import protein_performer; print(protein_performer.__file__)"], cwd=work).strip()
    assert where.startswith(str(site)), where  # the wheel's copy, not this checkout
    return venv / "bin" / "protein-performer", py, work


def here(capsys, *args):
    """``protein-performer ARGS`` from this checkout, in this process: its stdout."""
    code, out, err = run_main(capsys, *map(str, args))
    assert code == 0, f"{args}\n{out[-2000:]}\n{err[-3000:]}"
    return out


def test_help_is_fast_and_lists_the_commands(installed):
    exe, _, work = installed
    start = time.perf_counter()
    out = sh([exe, "--help"], cwd=work)
    assert time.perf_counter() - start < 2.0
    assert all(c in out for c in COMMANDS)
    start = time.perf_counter()
    out = sh([exe, "evaluate", "--help"], cwd=work)
    assert time.perf_counter() - start < 2.0 and "data.path" in out and "== Keys ==" in out
    r = subprocess.run([exe, "trian"], cwd=work, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == ("error: unknown command 'trian' (did you mean train?); "
                                                      f"choose one of {', '.join(COMMANDS)}")
    assert {"train", "prepare", "evaluate", "embed", "probe", "generate", "compare", "export", "score", "finetune",
            "convert-esm"} <= set(COMMANDS)


def test_installed_commands_match_the_checkout(installed, tmp_path, capsys):
    exe, py, work = installed
    runs = {}
    for objective in ("mlm", "clm"):
        args = [*TINY, f"objective={objective}"]
        wheel = sh([exe, "train", *args, f"hydra.run.dir={work / objective}"], cwd=work)
        checkout = here(capsys, "train", *args, f"hydra.run.dir={tmp_path / objective}")
        assert VALIDATION.search(wheel).group(1) == VALIDATION.search(checkout).group(1)
        runs[objective] = work / objective / "checkpoints" / "last.ckpt"
        assert runs[objective].is_file()

    # evaluate on the bundled held-out proteins (the default data.path), from outside the checkout
    sh([exe, "evaluate", f"ckpt={runs['mlm']}", "data.max_records=20", "progress=false", "output_dir=eval"], cwd=work)
    here(capsys, "evaluate", f"ckpt={runs['mlm']}", "data.max_records=20", "progress=false",
         f"output_dir={tmp_path / 'eval'}")
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (work / "eval", tmp_path / "eval"))
    assert a["num_sequences"] == 20 and a["perplexity"] == b["perplexity"] and a["num_tokens"] == b["num_tokens"]

    # embed a bundled file shipped in the wheel
    heldout = sh([py, "-c", "from protein_performer.resources import bundled; "
                  "print(bundled('heldout/uniprotkb_mix_heldout_2k.fasta.gz'))"], cwd=work).strip()
    assert "site-packages" in heldout
    fasta = work / "few.fasta"
    lines = sh([py, "-c", f"import gzip; print(''.join(list(gzip.open({heldout!r}, 'rt'))[:150]))"], cwd=work)
    fasta.write_text(lines)
    sh([exe, "embed", f"ckpt={runs['mlm']}", f"input={fasta}", "output=few.h5", "progress=false"], cwd=work)
    here(capsys, "embed", f"ckpt={runs['mlm']}", f"input={fasta}", f"output={tmp_path / 'few.h5'}", "progress=false")
    with h5py.File(work / "few.h5") as f, h5py.File(tmp_path / "few.h5") as g:
        assert f["ids"].shape[0] > 5
        np.testing.assert_array_equal(f["mean"][:], g["mean"][:])

    # generate from the causal model
    sh([exe, "generate", f"ckpt={runs['clm']}", "num_samples=2", "max_length=20", "seed=1", "output=s.fasta"], cwd=work)
    here(capsys, "generate", f"ckpt={runs['clm']}", "num_samples=2", "max_length=20", "seed=1",
         f"output={tmp_path / 's.fasta'}")
    assert (work / "s.fasta").read_text() == (tmp_path / "s.fasta").read_text()
    assert (work / "s.fasta").read_text().count(">") == 2

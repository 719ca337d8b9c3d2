"""Which linear-attention path runs (fla_backend.resolve_backend), on faked GPU stacks: the CPU
cannot run fla's kernels, so the facts the choice reads (CUDA, the GPU's compute capability and
name, the Triton version, whether fla imports) are replaced, and the choice is held to a table
written out here.  The table's one rule from outside: fla 0.6.0 raises in the backward of its
gated chunk kernel on Hopper (compute capability 9.x) with 3.4.0 <= Triton < 3.7.1 (fla #640);
the tests needing fla check that this is the guard fla has."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
import torch

from protein_performer.attention import fla_backend
from protein_performer.attention.fla_backend import (BACKENDS, GATED_KERNELS, check_backend, fla_stack_problem,
                                                     resolve_backend, training_device)
from protein_performer.errors import UserError

from conftest import import_fla

fla_chunk_o, FLA = import_fla("fla.ops.common.chunk_o")
needs_fla = pytest.mark.skipif(FLA is not None, reason=FLA or "")

H200, A100, B200 = ((9, 0), "NVIDIA H200"), ((8, 0), "NVIDIA A100-SXM4-80GB"), ((10, 0), "NVIDIA B200")
NO_FLA = "flash-linear-attention does not import (No module named 'fla'); pip install 'protein-performer[gpu]'"
LOGGER = "protein_performer.attention.fla_backend"


@pytest.fixture
def stack(monkeypatch):
    """stack(gpu, triton, importable=True): CUDA present with that GPU and Triton version."""
    def fake(gpu=H200, triton="3.6.0", importable=True, hip=None):
        (cap, name) = gpu
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(fla_backend, "_triton_version", lambda: triton)
        monkeypatch.setattr(fla_backend, "fla_import_problem", lambda: None if importable else NO_FLA)
        monkeypatch.setattr(fla_backend, "_announced", set())
    return fake


# refused: the fla guard's window on Hopper, nothing else
@pytest.mark.parametrize("gpu, triton, refused", [
    (H200, "3.6.0", True), (H200, "3.7.0", True), (H200, "3.4.0", True), (H200, "3.7.1", False),
    (H200, "3.9.0", False), (H200, "3.3.1", False), (H200, "3.7.1+git5f1c2a0", False),
    ((((9, 0), "NVIDIA H100 80GB HBM3")), "3.7.0", True),
    (A100, "3.6.0", False), (A100, "3.7.0", False), (B200, "3.6.0", False)])
def test_fla_stack_problem_is_hopper_with_triton_from_3_4_0_below_3_7_1(stack, gpu, triton, refused):
    stack(gpu, triton)
    problem = fla_stack_problem("cuda")
    assert (problem is not None) == refused
    if refused:
        assert f"Triton {triton}" in problem and gpu[1] in problem and "9.0" in problem
        assert f"torch {torch.__version__}" in problem and "\n" not in problem
    assert fla_stack_problem("cpu") is None                     # nothing to refuse off CUDA


def test_fla_stack_problem_is_nvidia_only_and_needs_triton(stack):
    stack(((9, 4), "AMD Instinct MI300X"), "3.6.0", hip="6.4")   # ROCm's MI300 reports 9.4: not fla's guard
    assert fla_stack_problem("cuda") is None
    stack(H200, None)                                           # no Triton: fla_import_problem says so
    assert fla_stack_problem("cuda") is None


# backend, causal, gated, gpu, triton, importable -> the path (or the UserError's pattern)
REFUSED_LINE = r"^model\.attention\.backend=fla: fla 0\.6\.0 refuses the gated backward .*Triton 3\.(6|7)\.0 .*; " \
               r"install torch>=2\.12\.1 \(it pins Triton>=3\.7\.1\) or use backend=parallel$"
CASES = [
    ("auto", True, True, H200, "3.6.0", True, "parallel"),
    ("auto", True, True, H200, "3.7.0", True, "parallel"),
    ("auto", True, False, H200, "3.6.0", True, "fla"),          # elu+1 / relu: no gate, fla's guard is silent
    ("auto", True, True, H200, "3.7.1", True, "fla"),
    ("auto", True, True, H200, "3.9.0", True, "fla"),
    ("auto", True, True, A100, "3.6.0", True, "fla"),
    ("auto", True, True, A100, "3.9.0", False, "parallel"),     # fla not installed
    ("auto", False, True, A100, "3.9.0", True, "parallel"),     # bidirectional: no fla path
    ("auto", False, False, H200, "3.7.1", True, "parallel"),
    ("fla", True, True, H200, "3.6.0", True, REFUSED_LINE),
    ("fla", True, True, H200, "3.7.0", True, REFUSED_LINE),
    ("fla", True, False, H200, "3.6.0", True, "fla"),
    ("fla", True, True, H200, "3.7.1", True, "fla"),
    ("fla", True, True, A100, "3.6.0", True, "fla"),
    ("fla", True, True, A100, "3.9.0", False, r"^model\.attention\.backend=fla: flash-linear-attention does not import "
                                              r"\(No module named 'fla'\); pip install 'protein-performer\[gpu\]'$"),
    ("fla", False, True, A100, "3.9.0", True, r"^model\.attention\.backend=fla: fla has no bidirectional path here, "
                                              r"use backend=auto or parallel$"),
    ("fla", False, False, H200, "3.7.1", True, r"bidirectional"),
]
CASES += [(b, causal, gated, gpu, tv, True, b) for b in ("torch", "parallel") for causal in (True, False)
          for gated in (True, False) for gpu in (H200, A100) for tv in ("3.6.0", "3.9.0")]


@pytest.mark.parametrize("backend, causal, gated, gpu, triton, importable, expected", CASES)
def test_resolve_backend_on_cuda(stack, backend, causal, gated, gpu, triton, importable, expected):
    stack(gpu, triton, importable)
    if expected in ("torch", "parallel", "fla"):
        assert resolve_backend(backend, "cuda", causal, gated) == expected
        assert resolve_backend(backend, torch.device("cuda", 0), causal=causal, gated=gated) == expected
    else:
        with pytest.raises(UserError, match=expected) as e:
            resolve_backend(backend, "cuda", causal, gated)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_resolve_backend_on_cpu(stack, causal, gated):
    stack(H200, "3.6.0")   # whatever the GPU: the model is on the CPU
    assert resolve_backend("auto", "cpu", causal, gated) == "torch"
    assert resolve_backend("torch", "cpu", causal, gated) == "torch"
    assert resolve_backend("parallel", "cpu", causal, gated) == "parallel"
    why = " needs a CUDA device \\(the model runs on cpu\\)" if causal else ": fla has no bidirectional"
    with pytest.raises(UserError, match="^model.attention.backend=fla" + why):
        resolve_backend("fla", "cpu", causal, gated)
    with pytest.raises(UserError, match="needs a CUDA device \\(the model runs on mps\\)"):
        resolve_backend("fla", "mps", True, gated)
    with pytest.raises(UserError, match=r"^model.attention.backend='flash': choose one of auto, torch, parallel, fla$"):
        resolve_backend("flash", "cpu", causal, gated)


def test_auto_on_a_refused_stack_says_why_and_the_fix_once(stack, caplog):
    stack(H200, "3.6.0")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert check_backend("auto", "cuda:0", True, True) == "parallel"
        assert [resolve_backend("auto", "cuda:0", True, True) for _ in range(3)] == ["parallel"] * 3
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    line = caplog.records[0].getMessage()
    assert line.startswith("causal linear attention: backend=auto runs the parallel torch path (fla 0.6.0 refuses")
    assert "Triton 3.6.0" in line and "NVIDIA H200" in line and line.endswith(
        "install torch>=2.12.1 (it pins Triton>=3.7.1) to run fla)")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):   # another choice or reason: its own line, once
        assert [resolve_backend("auto", "cuda", False, True) for _ in range(2)] == ["parallel"] * 2
        assert [resolve_backend("auto", "cuda", True, False) for _ in range(2)] == ["fla"] * 2
    assert [r.getMessage() for r in caplog.records] == [
        "bidirectional linear attention: backend=auto runs the parallel torch path "
        "(the model runs on cuda; fla has no bidirectional path here)",
        "causal linear attention: backend=auto runs fla chunk_simple_gla (the model runs on cuda)"]
    assert [r.levelno for r in caplog.records] == [logging.INFO] * 2


def test_auto_without_fla_on_cuda_says_how_to_install_it(stack, caplog):
    stack(A100, "3.9.0", importable=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert [resolve_backend("auto", "cuda") for _ in range(2)] == ["parallel"] * 2
    assert [r.getMessage() for r in caplog.records] == [
        f"causal linear attention: backend=auto runs the parallel torch path ({NO_FLA})"]


def test_backends_and_gated_kernels_match_the_feature_maps():
    """BACKENDS is what config.py accepts; GATED_KERNELS are exactly the maps whose keys carry
    log-scales (fla_linear_attention passes a gate g only for those)."""
    from protein_performer.attention.feature_maps import KERNELS, build_feature_map
    from protein_performer.model import ModelConfig
    assert BACKENDS == ("auto", "torch", "parallel", "fla")
    for b in BACKENDS:
        assert ModelConfig(attention={"backend": b}).attention.backend == b
    k = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(0))
    gated = set()
    for kernel in KERNELS:
        fm = build_feature_map(kernel, 16, 32, generator=torch.Generator().manual_seed(0), heads=2)
        if fm is not None and fm(k, is_query=False).log_scale is not None:
            gated.add(kernel)
    assert gated == set(GATED_KERNELS)


def test_training_device_follows_the_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for acc in ("gpu", "cuda", "auto", "GPU", None):
        assert training_device(acc) == torch.device("cuda", 0)
    assert training_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for acc in ("gpu", "cuda", "auto", "cpu"):
        assert training_device(acc) == torch.device("cpu")


# ------------------------------------------------------------------ the training entry point
def _train_cfg(small_fasta, *overrides):
    from hydra import compose, initialize_config_dir

    from conftest import ROOT
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[
            "model.dim=32", "model.depth=1", "model.heads=2", "model.attention.nb_features=16", "data.max_len=32",
            f"data.path={small_fasta}", "trainer.max_steps=1", "trainer.enable_progress_bar=false", "logger=none",
            *overrides])


def _train_error(cfg, run_dir, capsys) -> str:
    from protein_performer.errors import cli
    from protein_performer.training.run import train
    with pytest.raises(SystemExit) as e:
        cli(lambda c: train(c, run_dir))(cfg)
    assert e.value.code == 2
    assert not Path(run_dir).exists() or not any(Path(run_dir).iterdir())   # nothing written
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_training_refuses_fla_on_a_refused_hopper_stack_before_any_work(stack, tmp_path, capsys, small_fasta):
    stack(H200, "3.6.0")
    cfg = _train_cfg(small_fasta, "objective=clm", "model.attention.backend=fla")
    line = _train_error(cfg, tmp_path / "run", capsys)
    assert re.match("^error: " + REFUSED_LINE[1:], line), line


def test_training_refuses_fla_for_a_masked_lm_on_a_cpu(tmp_path, capsys, small_fasta):
    cfg = _train_cfg(small_fasta, "objective=mlm", "model.attention.backend=fla")
    line = _train_error(cfg, tmp_path / "run", capsys)
    assert line == ("error: model.attention.backend=fla: fla has no bidirectional path here, "
                    "use backend=auto or parallel")


def test_training_check_passes_what_can_run(stack, small_fasta):
    """An ungated kernel runs through fla on the refused stack (exact attention, which runs no backend,
    takes only backend=auto: tests/test_safety_edges.py)."""
    from protein_performer.training.run import check_settings
    stack(H200, "3.6.0")
    check_settings(_train_cfg(small_fasta, "objective=clm", "model.attention.backend=fla",
                              "model.attention.kernel=elu"))
    check_settings(_train_cfg(small_fasta, "objective=clm", "model.attention.backend=auto"))   # auto: parallel
    stack(A100, "3.6.0")
    check_settings(_train_cfg(small_fasta, "objective=clm", "model.attention.backend=fla"))


# ------------------------------------------------------------------ fla's own guard and caches
@needs_fla
def test_the_refusal_is_fla_s_guard():
    """fla's chunk_bwd_dqkwg raises before any kernel exactly for g given, Hopper and Triton in
    [3.4.0, 3.7.1) — the window REFUSED_TRITON names (read from the guard's flags)."""
    src = Path(fla_chunk_o.__file__).read_text()
    m = re.search(r"if g is not None and IS_NVIDIA_HOPPER and TRITON_ABOVE_(\d+)_(\d+)_(\d+) and not "
                  r"TRITON_ABOVE_(\d+)_(\d+)_(\d+):", src)
    assert m, "fla's Hopper guard changed: revisit fla_stack_problem"
    assert (".".join(m.groups()[:3]), ".".join(m.groups()[3:])) == fla_backend.REFUSED_TRITON
    x, h = torch.zeros(1, 64, 1, 16), torch.zeros(1, 1, 1, 16, 16)
    args = dict(q=x, k=x, v=x, do=x, h=h, dh=h, scale=1.0)
    with pytest.MonkeyPatch.context() as mp:
        for hopper, above_lo, above_hi in ((True, True, False), (True, True, True), (False, True, False)):
            mp.setattr(fla_chunk_o, "IS_NVIDIA_HOPPER", hopper)
            mp.setattr(fla_chunk_o, "TRITON_ABOVE_" + "_".join(m.groups()[:3]), above_lo)   # 3.4.0
            mp.setattr(fla_chunk_o, "TRITON_ABOVE_" + "_".join(m.groups()[3:]), above_hi)   # 3.7.1
            for g in (torch.zeros(1, 64, 1), None):
                with pytest.raises(Exception) as e:    # on the CPU every call fails; which way is the point
                    fla_chunk_o.chunk_bwd_dqkwg(g=g, **args)
                refused = "#640" in str(e.value)
                assert refused == (g is not None and hopper and above_lo and not above_hi)


@needs_fla
def test_fla_op_sets_cache_defaults_and_keeps_the_user_s(monkeypatch):
    for key in fla_backend.CACHE_ENV:   # setenv first: monkeypatch then restores the variable's absence
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")   # the user's choice
    assert fla_backend.fla_op() is not None
    assert os.environ["FLA_CACHE_RESULTS"] == "1" and os.environ["TRITON_CACHE_AUTOTUNING"] == "0"


@needs_fla
@pytest.mark.skipif(os.environ.get("FLA_CACHE_RESULTS", "1") != "1", reason="FLA_CACHE_RESULTS is set off here")
def test_fla_kernels_we_call_cache_their_autotuning_on_disk():
    """The autotuners of chunk_simple_gla's kernels write their choice to Triton's cache, so only a
    machine's first process pays for the tuning."""
    from triton.runtime.autotuner import Autotuner
    import fla.ops.common.chunk_h as chunk_h
    import fla.ops.utils.cumsum as cumsum
    tuners = []
    for module in (chunk_h, fla_chunk_o, cumsum):
        for obj in vars(module).values():
            while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn
            if isinstance(obj, Autotuner):
                tuners.append(obj)
    assert len(tuners) >= 6
    assert all(t.cache_results for t in tuners)

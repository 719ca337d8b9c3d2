"""The fla backend's mapping (fla_backend.py) on the CPU: fla's Triton kernels need a GPU, so the
mapping is run with fla's own naive references in their place (the backend takes the op as an
argument) and held to them, to the torch chunked path and to the float64 quadratic reference
(naive.py): forward and gradients, causal, varlen, chunk boundaries, running-max jumps.

Skipped with a reason when flash-linear-attention (the ``gpu`` extra) is not installed; the
backend-selection tests need no fla."""
from __future__ import annotations


import pytest
import torch

from protein_performer.attention import EluFeatures, FavorPlus, FavorPlusPlus, HedgehogFeatures, ReluFeatures
from protein_performer.attention import fla_backend
from protein_performer.attention.fla_backend import fla_linear_attention, resolve_backend
from protein_performer.attention.linear import chunk_linear_attention, init_linear_state
from protein_performer.attention.naive import naive_linear_attention
from protein_performer.errors import UserError

from conftest import import_fla

fla_naive, FLA = import_fla("fla.ops.simple_gla.naive")
naive_chunk_simple_gla = getattr(fla_naive, "naive_chunk_simple_gla", None)
naive_recurrent_simple_gla = getattr(fla_naive, "naive_recurrent_simple_gla", None)

needs_fla = pytest.mark.skipif(FLA is not None, reason=FLA or "")


def as_op(naive, calls: list | None = None, **fixed):
    """fla's naive reference behind chunk_simple_gla's signature: g=None is g=0, and cu_seqlens
    runs each packed sequence on its own (the naive references have no varlen)."""
    def op(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
        g = q.new_zeros(q.shape[:3], dtype=torch.float32) if g is None else g
        if calls is not None:
            calls.append(dict(g=g, cu_seqlens=cu_seqlens, dtype=q.dtype, scale=scale))
        kw = dict(scale=scale, output_final_state=True, **fixed)
        if cu_seqlens is None:
            o, ht = naive(q, k, v, g, initial_state=initial_state, **kw)
            return o, (ht if output_final_state else None)
        outs, states = [], []
        for n, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            h0 = None if initial_state is None else initial_state[n:n + 1]
            if b == a:   # an empty sequence: its state passes through
                outs.append(v.new_zeros(1, 0, *v.shape[2:]))
                states.append(h0 if h0 is not None else q.new_zeros(1, q.shape[2], q.shape[3], v.shape[3]).float())
                continue
            o, ht = naive(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], initial_state=h0, **kw)
            outs.append(o)
            states.append(ht)
        return torch.cat(outs, 1), (torch.cat(states, 0) if output_final_state else None)
    return op


OPS = {"recurrent": lambda calls=None: as_op(naive_recurrent_simple_gla, calls),
       "chunk": lambda calls=None: as_op(naive_chunk_simple_gla, calls, chunk_size=64)} if FLA is None else {}


def qkv(B=2, H=2, L=300, d=16, std=1.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, d, generator=g, dtype=dtype) * s for s in (std, std, 1.0)]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def through_map(fm, q, k, v, **kw):
    """Features of raw q, k and fla_linear_attention on them (kw: op, key_padding_mask, ...)."""
    kf, s = fm(k, is_query=False)
    return fla_linear_attention(fm(q, is_query=True), kf, v, k_log_scale=s, **kw)[0]


def reference(fm, q, k, v, key_padding_mask=None):
    """The float64 quadratic reference on the map's raw (unstabilized) features."""
    return naive_linear_attention(fm(q.double(), True, stabilize=False), fm(k.double(), False, stabilize=False),
                                  v.double(), causal=True, key_padding_mask=key_padding_mask)


MAPS = {
    "favor+": lambda: FavorPlus(16, 32, generator=torch.Generator().manual_seed(1)),
    "favor++": lambda: favorpp(),
    "elu": lambda: EluFeatures(16),
    "relu": lambda: ReluFeatures(16, 32, generator=torch.Generator().manual_seed(1)),
    "hedgehog": lambda: HedgehogFeatures(16, 32, heads=2, generator=torch.Generator().manual_seed(1)),
}


def favorpp():
    fm = FavorPlusPlus(16, 32, generator=torch.Generator().manual_seed(1), heads=2)
    fm.rho.fill_(0.7)                     # A < 0: the OPRF, not FAVOR+
    return fm.double()


@needs_fla
@pytest.mark.parametrize("kind", ["recurrent", "chunk"])
@pytest.mark.parametrize("name", list(MAPS))
def test_mapping_equals_float64_reference_and_torch_path(kind, name):
    """Forward and gradients of every kernel through each fla reference: the float64 quadratic
    reference to float32 accuracy, and the torch chunked path (L = 300: five chunk boundaries)."""
    fm = MAPS[name]().double()
    q, k, v = (t.requires_grad_() for t in qkv(std=1.5 if name.startswith("favor") else 1.0))
    w = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = through_map(fm, q, k, v, op=OPS[kind]())
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = reference(fm, q, k, v)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    kf, s = fm(k.float(), is_query=False)
    torch_out = chunk_linear_attention(fm(q.float(), is_query=True), kf, v.float(), k_log_scale=s)[0]
    assert rel(out, ref) < 2e-5
    assert rel(out, torch_out.double()) < 2e-5
    for a, b in zip(grads, ref_grads):
        assert rel(a, b) < 1e-4


@needs_fla
@pytest.mark.parametrize("kind", ["recurrent", "chunk"])
def test_running_max_jumps_of_20_nats(kind):
    """Key log-scales that jump by +20 nats (at, before and after chunk boundaries 64 and 128): the
    gates g_t = M_{t-1} - M_t are -20 there, and outputs and gradients still match float64."""
    B, H, L, r, d = 1, 2, 200, 32, 8
    g = torch.Generator().manual_seed(5)
    kf = torch.rand(B, H, L, r, generator=g, dtype=torch.float64) + 1e-3
    qf = torch.rand(B, H, L, r, generator=g, dtype=torch.float64) + 1e-3
    v = torch.randn(B, H, L, d, generator=g, dtype=torch.float64)
    s = torch.randn(B, H, L, generator=g, dtype=torch.float64)
    for t in (3, 63, 64, 65, 128, 150):
        s[..., t:] += 20.0
    s[..., 100] += 40.0                  # one outlier that later keys do not reach
    qf.requires_grad_(), kf.requires_grad_(), v.requires_grad_()
    calls = []
    out = fla_linear_attention(qf, kf, v, k_log_scale=s[..., None], op=OPS[kind](calls))[0]
    assert calls[0]["g"].min() <= -20.0 + 1e-3 and calls[0]["g"].max() == 0.0
    ref = naive_linear_attention(qf, kf * torch.exp(s - s.amax(-1, keepdim=True))[..., None], v, causal=True)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < 2e-5
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (qf, kf, v)),
                    torch.autograd.grad((ref * w).sum(), (qf, kf, v))):
        assert rel(a, b) < 1e-4


@needs_fla
def test_varlen_packs_real_tokens_and_equals_padded_torch_path():
    """A padded batch (right, left and no padding, one row of one token) reaches the op as packed
    sequences with cu_seqlens; real positions equal the torch path's padded outputs and each row run
    alone, padded positions are 0, and gradients at the real tokens match."""
    fm = MAPS["favor+"]().double()
    B, L = 4, 150
    q, k, v = (t.requires_grad_() for t in qkv(B=B, L=L, std=1.5))
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, 100:] = True                  # right padding
    pad[1, :37] = True                   # left padding
    pad[3, 1:] = True                    # one token
    calls = []
    out = through_map(fm, q, k, v, op=OPS["chunk"](calls), key_padding_mask=pad)
    assert calls[0]["cu_seqlens"].tolist() == [0, 100, 213, 363, 364]
    assert calls[0]["g"].shape[:2] == (1, 364)
    ref = reference(fm, q, k, v, key_padding_mask=pad)
    real = ~pad[:, None, :, None].expand_as(out)
    assert rel(out[real], ref[real]) < 2e-5
    assert (out[~real] == 0).all()
    kf, s = fm(k.float(), is_query=False)
    torch_out = chunk_linear_attention(fm(q.float(), is_query=True), kf, v.float(), k_log_scale=s,
                                       key_padding_mask=pad)[0]
    assert rel(out[real], torch_out.double()[real]) < 2e-5
    alone = through_map(fm, q[1:2, :, 37:], k[1:2, :, 37:], v[1:2, :, 37:], op=OPS["chunk"]())
    assert rel(out[1:2, :, 37:], alone) < 1e-6
    w = torch.randn_like(out).masked_fill(~real, 0.0)
    # the reference row by row on its real tokens (a padded query that sees no key would be 0 / 0)
    ref_loss = sum((reference(fm, *(t[b:b + 1, :, ~pad[b]] for t in (q, k, v))) * w[b:b + 1, :, ~pad[b]]).sum()
                   for b in range(B))
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad(ref_loss, (q, k, v))):
        assert torch.isfinite(a).all() and rel(a, b) < 1e-4


@needs_fla
@pytest.mark.parametrize("padded", [False, True])
def test_states_continue_a_sequence(padded):
    """Two pieces, the second from the first's final state, equal the whole sequence; the final state
    equals the torch path's (S, Z, m), and an empty initial state (m = -3.4e38) gives no NaN."""
    fm = MAPS["favor+"]()
    q, k, v = qkv(L=200, std=1.5, dtype=torch.float32)
    kf, s = fm(k, is_query=False)
    qf = fm(q, is_query=True)
    pad = None
    if padded:
        pad = torch.zeros(2, 200, dtype=torch.bool)
        pad[1, 150:] = True              # row 1's second piece is all padding: its state passes through
    op = OPS["chunk"]()
    whole, state = chunk_linear_attention(qf, kf, v, k_log_scale=s, key_padding_mask=pad, output_final_state=True)
    empty = init_linear_state(2, 2, 32, 16)
    p = 130
    cut = lambda x, a, b: None if x is None else x[..., a:b]   # noqa: E731
    o1, st1 = fla_linear_attention(qf[:, :, :p], kf[:, :, :p], v[:, :, :p], k_log_scale=s[:, :, :p],
                                   key_padding_mask=cut(pad, 0, p), initial_state=empty, output_final_state=True, op=op)
    o2, st2 = fla_linear_attention(qf[:, :, p:], kf[:, :, p:], v[:, :, p:], k_log_scale=s[:, :, p:],
                                   key_padding_mask=cut(pad, p, 200), initial_state=st1, output_final_state=True,
                                   op=op)
    both = torch.cat([o1, o2], dim=2)
    real = slice(None) if pad is None else ~pad[:, None, :, None].expand_as(both)
    assert torch.isfinite(both).all()
    assert rel(both[real], whole[real]) < 2e-6
    for a, b in zip(st2, state):
        assert rel(a, b) < 2e-6


@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_values_run_the_op_in_16_bit(dtype):
    """Under autocast the values are bf16/fp16: the op gets 16-bit inputs with widths padded to even
    multiples of 16 (r = 24 -> 32, d + 1 = 17 -> 32), the division runs in float32, and the output
    (in the values' dtype) is the float64 reference to 16-bit accuracy."""
    fm = FavorPlus(16, 24, generator=torch.Generator().manual_seed(1))
    q, k, v = qkv(B=1, L=700, std=1.5, dtype=torch.float32)
    calls = []
    kf, s = fm(k, is_query=False)
    out = fla_linear_attention(fm(q, is_query=True), kf, v.to(dtype), k_log_scale=s, op=OPS["chunk"](calls))[0]
    assert calls[0]["dtype"] == dtype and out.dtype == dtype
    assert calls[0]["scale"] == (1.0 if dtype == torch.bfloat16 else 2.0 ** -1)   # 700 * 24 > 2^14
    assert torch.isfinite(out).all()
    assert rel(out.double(), reference(fm, q, k, v.to(dtype).float())) < (2e-2 if dtype == torch.bfloat16 else 5e-3)


@needs_fla
def test_layer_dispatches_causal_linear_attention_to_fla(monkeypatch):
    """Attention(backend='fla') sends its causal linear attention (forward and prompt steps) to the
    fla op; with the naive op in place it equals backend='torch'."""
    from protein_performer.attention import Attention
    calls = []
    monkeypatch.setattr(fla_backend, "resolve_backend", lambda backend, device, *a, **k: "fla" if backend == "fla" else "torch")
    monkeypatch.setattr(fla_backend, "fla_op", lambda: OPS["chunk"](calls))
    x = torch.randn(2, 90, 32, generator=torch.Generator().manual_seed(0))
    for kernel in ("softmax", "elu"):
        mods = [Attention(32, 2, kernel=kernel, nb_features=16, causal=True, backend=b).eval() for b in ("torch", "fla")]
        mods[1].load_state_dict(mods[0].state_dict())
        n = len(calls)
        a, b = (m(x) for m in mods)
        assert len(calls) == n + 1 and rel(b, a) < 1e-5
        st = [m.init_state(2) for m in mods]
        (pa, _), (pb, _) = (m.step(x[:, :40], s) for m, s in zip(mods, st))
        assert len(calls) == n + 2 and rel(pb, pa) < 1e-5


# ------------------------------------------------------------------ backend selection (no fla needed)
def test_auto_is_torch_on_cpu_and_torch_is_torch_anywhere():
    for causal in (True, False):
        assert resolve_backend("auto", "cpu", causal) == "torch"
        assert resolve_backend("torch", "cuda", causal) == "torch"
        assert resolve_backend("parallel", "cpu", causal) == "parallel"


def test_fla_without_cuda_or_package_is_one_line_error(monkeypatch):
    with pytest.raises(UserError, match=r"^model.attention.backend=fla needs a CUDA device \(the model runs on cpu\)"):
        resolve_backend("fla", "cpu")
    monkeypatch.setattr(fla_backend, "fla_import_problem", lambda: "flash-linear-attention does not import (x)")
    with pytest.raises(UserError, match=r"^model.attention.backend=fla: flash-linear-attention does not import"):
        resolve_backend("fla", "cuda")
    assert resolve_backend("auto", "cuda") == "parallel"     # auto falls back and says why
    with pytest.raises(UserError, match=r"^model.attention.backend='flash': choose one of auto, torch, parallel, fla$"):
        resolve_backend("flash", "cpu")


def test_auto_takes_fla_on_cuda_when_it_imports_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(fla_backend, "fla_import_problem", lambda: None)
    monkeypatch.setattr(fla_backend, "fla_stack_problem", lambda device: None)
    monkeypatch.setattr(fla_backend, "_announced", set())
    with caplog.at_level("INFO", logger="protein_performer.attention.fla_backend"):
        assert [resolve_backend("auto", "cuda") for _ in range(3)] == ["fla"] * 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["causal linear attention: backend=auto runs fla chunk_simple_gla (the model runs on cuda)"]


def test_layer_with_fla_on_cpu_is_one_line_error():
    from protein_performer.attention import Attention
    m = Attention(32, 2, kernel="softmax", nb_features=16, causal=True, backend="fla")
    with pytest.raises(UserError, match="needs a CUDA device"):
        m(torch.randn(1, 8, 32))
    bidir = Attention(32, 2, kernel="softmax", nb_features=16, causal=False, backend="fla")
    with pytest.raises(UserError, match="^model.attention.backend=fla: fla has no bidirectional path here"):
        bidir(torch.randn(1, 8, 32))      # fla has no bidirectional kernel: refused, not silently torch


def test_config_and_training_refuse_fla_on_cpu(tmp_path, capsys, small_fasta):
    """A bad backend name fails when the config is read; backend=fla on a CPU run is the CLI's
    one-line error with exit status 2 (training's code path inside the commands' error wrapper)."""
    from hydra import compose, initialize_config_dir

    from conftest import ROOT
    from protein_performer.errors import cli
    from protein_performer.model import ModelConfig
    from protein_performer.training.run import train
    with pytest.raises(UserError, match=r"^model.attention.backend='cuda': choose one of auto, torch, parallel, fla$"):
        ModelConfig(attention={"backend": "cuda"})
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[
            "objective=clm", "model.dim=32", "model.depth=1", "model.heads=2", "model.attention.nb_features=16",
            "model.attention.backend=fla", "data.max_len=32", f"data.path={small_fasta}", "trainer.max_steps=1",
            "trainer.enable_progress_bar=false", "logger=none"])
    with pytest.raises(SystemExit) as e:
        cli(lambda c: train(c, tmp_path))(cfg)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: model.attention.backend=fla needs a CUDA device (the model runs on cpu)")


def test_a_checkpoint_trained_with_backend_fla_loads_and_runs_on_a_cpu(tmp_path):
    """backend=fla is how a GPU run ran: evaluating its checkpoint on a CPU takes the torch path
    (the same outputs as the model built with backend=torch), not the 'needs CUDA' error."""
    from conftest import save_checkpoint
    from protein_performer.training.task import ProteinLM, load_checkpoint
    settings = dict(dim=32, depth=1, heads=2, attention={"kernel": "elu", "backend": "fla"})
    torch.manual_seed(0)
    task = ProteinLM(model=settings, objective="clm")
    ckpt = save_checkpoint(task, tmp_path / "fla.ckpt")
    loaded = load_checkpoint(ckpt)
    reference = ProteinLM(model={**settings, "attention": {"kernel": "elu", "backend": "torch"}}, objective="clm")
    reference.load_state_dict(task.state_dict())
    ids = torch.randint(5, 25, (2, 40))
    with torch.no_grad():
        expected = reference.eval().model(ids)
        got = loaded.model(ids)
    assert expected.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

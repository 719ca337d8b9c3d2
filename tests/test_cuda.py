"""CUDA checks (marker ``cuda``; skipped with a reason without a GPU): run by benchmarks/gpu_check.sh.

What no CPU run can show: fla's Triton kernels equal the torch path and the float64 reference for
every kernel (forward and gradients, padded batches through varlen); a bf16 training step at
L = 16,384 stays finite; ``trainer=gpu`` from the command line trains, logs ``perf/peak_cuda_mb`` and
says which backend ran; ``compile=true`` trains; evaluate / embed / generate on CUDA give the CPU's
numbers.  Tolerances: fla in float32 runs its dots in TF32 (10-bit mantissa), hence 1e-2 where the
torch and parallel paths (full float32 matmuls) are held to 1e-4; bf16 to 3e-2.

Nothing here depends on fla working: its tests skip, naming the reason, where fla does not import or
refuses the stack (fla_backend.fla_stack_problem: its gated backward on Hopper with Triton < 3.7.1).
Each test has a time limit (pytest-timeout: ``--timeout`` in benchmarks/gpu_check.sh, longer ones
marked below; without the plugin the marks are inert), and a command-line run that fails or overruns
fails its test with the command's stderr in the message."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import ROOT, SAMPLE, sample_fasta

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (run benchmarks/gpu_check.sh on a GPU machine)")]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from protein_performer.attention import fla_backend
    from protein_performer.attention.fla_backend import fla_import_problem
    FLA = fla_import_problem() if torch.cuda.is_available() else "needs a CUDA GPU"
    # fla imports but refuses its gated backward (FAVOR+, FAVOR++) on this stack: None where it would run
    FLA_GATED = FLA or (fla_backend.fla_stack_problem("cuda") if torch.cuda.is_available() else None)
needs_fla = pytest.mark.skipif(FLA is not None, reason=f"fla path: {FLA}")
needs_gated_fla = pytest.mark.skipif(FLA_GATED is not None, reason=f"fla path: {FLA_GATED}")
DEV = "cuda"
BACKENDS = ["torch", "parallel", "fla"]


def limit(seconds: int):
    """pytest-timeout's per-test limit (fixture setup included) where the plugin is installed; inert otherwise."""
    try:
        import pytest_timeout  # noqa: F401
    except ImportError:
        return lambda f: f
    return pytest.mark.timeout(seconds)


def skip_fla(backend: str, kernel: str = "softmax") -> None:
    """Skip an fla case (naming why) where fla does not import, or refuses this kernel's gated backward here."""
    if backend != "fla":
        return
    problem = FLA_GATED if kernel in fla_backend.GATED_KERNELS else FLA
    if problem is not None:
        pytest.skip(f"fla path: {problem}")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _map(name: str, d: int, r: int):
    from protein_performer.attention.feature_maps import build_feature_map
    fm = build_feature_map(name, d, r, generator=torch.Generator().manual_seed(1), heads=4)
    if name == "favor++":
        fm.rho.fill_(0.7)
    return fm.to(DEV)


KERNELS = ["softmax", "favor++", "relu", "elu", "hedgehog"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_causal_paths_equal_float64(kernel, padded, backend):
    """Each causal path (torch's chunk loop, the parallel chunks, fla) = the float64 quadratic
    reference, forward and gradients (L = 1,000, r = 64, head dim 64; padded rows reach fla as packed
    sequences)."""
    skip_fla(backend, kernel)
    from protein_performer.attention.layer import kernel_attention
    from protein_performer.attention.naive import naive_linear_attention
    fm = _map(kernel, 64, 64)
    g = torch.Generator(device=DEV).manual_seed(0)
    B, H, L = 2, 4, 1000
    q, k, v = (torch.randn(B, H, L, 64, device=DEV, generator=g) for _ in range(3))
    pad = None
    if padded:
        pad = torch.zeros(B, L, dtype=torch.bool, device=DEV)
        pad[0, 700:] = True
        pad[1, :123] = True
    w = torch.randn(B, H, L, 64, device=DEV, generator=g)
    if pad is not None:
        w = w.masked_fill(pad[:, None, :, None], 0.0)
    results = {}
    for name in (backend, "ref"):
        x = [t.detach().clone().double().requires_grad_() if name == "ref" else t.detach().clone().requires_grad_()
             for t in (q, k, v)]
        if name == "ref":
            f64 = fm.double()
            out = naive_linear_attention(f64(x[0], True, stabilize=False), f64(x[1], False, stabilize=False), x[2],
                                         causal=True, key_padding_mask=pad)
            fm.float()
        else:
            out = kernel_attention(fm, *x, causal=True, key_padding_mask=pad, backend=name)
        out = out if pad is None else out.masked_fill(pad[:, None, :, None], 0.0)
        results[name] = (out, torch.autograd.grad((out * w).sum(), x))
    ref_out, ref_grads = results["ref"]
    tol = 1e-2 if backend == "fla" else 1e-4
    out, grads = results[backend]
    assert torch.isfinite(out).all()
    assert rel(out, ref_out) < tol, (backend, rel(out, ref_out))
    for name, a, b in zip("qkv", grads, ref_grads):
        assert rel(a, b) < 2 * tol, (backend, f"d{name}", rel(a, b))


@needs_gated_fla
def test_bf16_values_through_fla_match_float64():
    from protein_performer.attention.layer import kernel_attention
    from protein_performer.attention.naive import naive_linear_attention
    fm = _map("softmax", 64, 256)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4096, 64, device=DEV, generator=g) for _ in range(3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = kernel_attention(fm, q, k, v.bfloat16(), causal=True, backend="fla")
    assert out.dtype == torch.bfloat16
    ref = naive_linear_attention(fm.double()(q.double(), True, stabilize=False),
                                 fm.double()(k.double(), False, stabilize=False), v.bfloat16().double(), causal=True)
    assert rel(out, ref) < 3e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_state_stays_on_the_gpu_and_matches_forward(backend):
    """A prompt (one chunked call from the state: fla under backend=fla) then single recurrent steps on
    CUDA equal the parallel forward; every state tensor stays on the GPU."""
    skip_fla(backend)
    from protein_performer.attention import Attention
    torch.manual_seed(0)
    m = Attention(128, 2, kernel="softmax", nb_features=64, causal=True, backend=backend).to(DEV).eval()
    x = torch.randn(2, 45, 128, device=DEV)
    with torch.no_grad():
        full = m(x)
        out, state = m.step(x[:, :40], m.init_state(2))
        outs = [out]
        for t in range(40, 45):
            o, state = m.step(x[:, t], state)
            outs.append(o[:, None])
    assert all(v.is_cuda for k, v in state.items() if k != "pos")
    assert rel(torch.cat(outs, 1), full) < (1e-2 if backend == "fla" else 1e-4)


def test_masked_sdpa_on_cuda_equals_the_padded_reference():
    """Exact attention on a padded batch (SDPA's masked path on CUDA) equals the float64 reference at
    the real positions, causal and bidirectional."""
    from protein_performer.attention.naive import softmax_attention
    from protein_performer.attention.softmax import softmax_attention_sdpa
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(3, 4, 300, 64, device=DEV, generator=g) for _ in range(3))
    pad = torch.zeros(3, 300, dtype=torch.bool, device=DEV)
    pad[0, 200:] = True
    pad[2, 1:] = True
    real = ~pad[:, None, :, None].expand_as(q)
    for causal in (True, False):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            out = softmax_attention_sdpa(*(t.to(dtype) for t in (q, k, v)), causal, pad)
            ref = softmax_attention(q.double(), k.double(), v.double(), causal, pad)
            assert rel(out[real], ref[real]) < tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_training_step_at_16384_has_no_nan(backend):
    """Two bf16-autocast AdamW steps of a causal FAVOR+ LM on 16,384 tokens: the first loss equals the
    float32 torch path's on the same weights (to 2e-2), losses and gradients stay finite."""
    skip_fla(backend)
    from protein_performer.model import PerformerLM
    torch.manual_seed(0)
    kw = dict(dim=256, depth=2, heads=4, causal=True, dropout=0.0)
    model = PerformerLM(**kw, attention={"kernel": "softmax", "nb_features": 256, "backend": backend}).to(DEV)
    fp32 = PerformerLM(**kw, attention={"kernel": "softmax", "nb_features": 256, "backend": "torch"}).to(DEV)
    fp32.load_state_dict(model.state_dict())
    tokens = torch.randint(4, 24, (1, 16384), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))

    def loss_of(net):
        logits = net(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    with torch.no_grad():
        reference = loss_of(fp32).item()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model)
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
    assert abs(losses[0] - reference) < 2e-2, (losses, reference)
    assert all(x == x and abs(x) < 1e3 for x in losses)


# ------------------------------------------------------------------ the command line on the GPU
TRAIN = ["objective=clm", "model.dim=128", "model.depth=2", "model.heads=2", "model.attention.nb_features=64",
         "model.dropout=0.0", "data.max_len=256", "data.batch_size=16", "data.valid_fraction=0.1",
         "optim.warmup_steps=5", "optim.lr=3e-3", "trainer=gpu", "trainer.val_check_interval=25",
         "trainer.log_every_n_steps=5", "trainer.enable_progress_bar=false", "logger=csv"]


@pytest.fixture(scope="module")
def fasta(tmp_path_factory):
    return sample_fasta(tmp_path_factory.mktemp("data") / "small.fasta.gz", 400)


def _text(stream) -> str:
    """A captured stream as text (subprocess.TimeoutExpired holds bytes even with text=True)."""
    if stream is None:
        return ""
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream


def _train(run_dir, fasta, *extra, timeout: float = 50):
    """``scripts/train.py`` in a child process; a failure or an overrun (killed after ``timeout`` s, before
    the test's own limit) fails the test with the command and the tail of its stderr and stdout."""
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), *TRAIN, f"data.path={fasta}",
           f"logger.save_dir={run_dir}", f"hydra.run.dir={run_dir}", *extra]
    shown = " ".join(cmd[1:])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`{shown}` killed after {timeout:.0f} s\n--- its stderr (tail) ---\n{_text(e.stderr)[-6000:]}"
                    f"\n--- its stdout (tail) ---\n{_text(e.stdout)[-2000:]}", pytrace=False)
    # printed as well: pytest shows a failing test's captured output in the log
    print(f"$ {shown}\n--- exit {out.returncode}; stderr (tail) ---\n{out.stderr[-6000:]}", file=sys.stderr)
    assert out.returncode == 0, (f"`{shown}` exited {out.returncode}\n--- its stderr (tail) ---\n"
                                 f"{out.stderr[-6000:]}\n--- its stdout (tail) ---\n{out.stdout[-2000:]}")
    metrics = list(run_dir.rglob("metrics.csv"))
    assert metrics, f"`{shown}` wrote no metrics.csv\n--- its stderr (tail) ---\n{out.stderr[-6000:]}"
    rows = list(csv.DictReader(open(metrics[0])))
    return out, rows


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory, fasta):
    """50 steps of trainer=gpu (bf16 autocast) from the command line: (run folder, stdout+log, metrics rows)."""
    run_dir = tmp_path_factory.mktemp("gpu_run")
    out, rows = _train(run_dir, fasta, "trainer.max_steps=50")
    log = out.stdout + out.stderr + "".join(p.read_text() for p in run_dir.rglob("*.log"))
    return run_dir, log, rows


@limit(75)  # the gpu_run fixture's training run (at most 50 s) is set up inside this test's limit
def test_trainer_gpu_cli_run_learns_and_logs_cuda_memory(gpu_run):
    run_dir, log, rows = gpu_run
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    peaks = [float(r["perf/peak_cuda_mb"]) for r in rows if r.get("perf/peak_cuda_mb")]
    assert len(losses) >= 8 and all(map(lambda x: x == x, losses))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
    assert peaks and all(0 < p < 4096 for p in peaks), peaks
    chosen = fla_backend.resolve_backend("auto", torch.device(DEV), causal=True, gated=True)  # FAVOR+ is gated
    expected = fla_backend._PATHS[chosen]
    assert f"backend=auto runs {expected}" in log, log[-4000:]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


def _proteins(n=24):
    from protein_performer.formats.fasta import read_fasta
    out = []
    for i, r in enumerate(read_fasta(SAMPLE)):
        if i == n:
            break
        out.append(r.sequence[:700])
    return out


def test_evaluate_on_cuda_equals_cpu(gpu_run):
    from protein_performer.evaluate import evaluate_model
    ckpt = str(gpu_run[0] / "checkpoints" / "last.ckpt")
    seqs = _proteins()
    cpu = evaluate_model(ckpt, seqs, device="cpu", progress=False)
    gpu = evaluate_model(ckpt, seqs, device="cuda", progress=False)
    assert abs(gpu["perplexity"] - cpu["perplexity"]) / cpu["perplexity"] < 2e-3
    assert abs(gpu["accuracy"] - cpu["accuracy"]) < 5e-3


def test_embed_on_cuda_equals_cpu(gpu_run):
    from protein_performer.embed.run import embed_sequences
    ckpt = str(gpu_run[0] / "checkpoints" / "last.ckpt")
    seqs = _proteins()
    cpu = embed_sequences(ckpt, seqs, device="cpu")["mean"]
    gpu = embed_sequences(ckpt, seqs, device="cuda")["mean"]
    assert rel(torch.from_numpy(gpu), torch.from_numpy(cpu)) < 5e-3


def test_generate_on_cuda_scores_as_cpu(gpu_run):
    """The step logits of a CUDA sample (recurrent state on the GPU) equal the CPU's parallel forward
    over the same tokens."""
    from protein_performer.generate import generate
    from protein_performer.hub.load import load_model
    ckpt = str(gpu_run[0] / "checkpoints" / "last.ckpt")
    net = load_model(ckpt, "cuda").net
    samples = generate(net, num_samples=2, max_length=120, seed=0, device="cuda", return_logits=True, top_k=5)
    cpu_net = load_model(ckpt, "cpu").net.eval()
    for s in samples:
        with torch.no_grad():
            ref = cpu_net(torch.tensor([s.tokens[:-1]]))[0].float()
        assert s.logits.shape == ref.shape
        assert rel(s.logits, ref) < 5e-3


@limit(70)  # last: Inductor's compile is the slowest step of the check
def test_compile_true_trains_on_gpu(tmp_path, fasta):
    _, rows = _train(tmp_path, fasta, "trainer.max_steps=10", "trainer.val_check_interval=10", "compile=true",
                     timeout=60)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert losses and all(0 < x < 10 for x in losses)

"""The chunk-parallel causal path (attention/chunk_parallel.py) against the float64 quadratic reference,
the sequential chunked path's states, and its own promise: a number of ops that does not grow with L."""
import pytest
import torch

from benchmarks.speed.launches import count_aten_ops
from protein_performer.attention import chunk_parallel
from protein_performer.attention.chunk_parallel import chunk_parallel_linear_attention, parallel_chunk_length
from protein_performer.attention.naive import naive_linear_attention


def _qkvs(B, H, L, r=5, d=3, seed=0, spread=20.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(B, H, L, r, generator=g, dtype=dtype) + 0.05 for _ in range(2))
    v = torch.randn(B, H, L, d, generator=g, dtype=dtype)
    s = torch.randn(B, H, L, 1, generator=g, dtype=dtype) * spread        # key log-scales over ~4 spread nats
    return q, k, v, s


def _reference(q, k, v, s, mask=None):
    """out_i = sum_{j<=i} exp(s_j) (q_i . k_j) v_j / (same with v = 1), float64, quadratic."""
    return naive_linear_attention(q, k if s is None else k * s.exp(), v, causal=True, key_padding_mask=mask)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("L,chunk", [(1, 4), (16, 4), (19, 4), (19, 32), (37, 7), (45, 1)])
def test_matches_the_quadratic_reference_with_and_without_padding(scaled, L, chunk):
    q, k, v, s = _qkvs(2, 3, L, seed=L)
    s = s if scaled else None
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[1, L // 2 + 1:] = True
    mask[1, 0] = L > 2                                                        # a padded first key too
    for m in (None, mask):
        out, _ = chunk_parallel_linear_attention(q, k, v, k_log_scale=s, key_padding_mask=m, chunk_size=chunk)
        ref = _reference(q, k, v, s, m)
        keep = torch.ones_like(ref, dtype=torch.bool) if m is None else ~m[:, None, :, None].expand_as(ref)
        torch.testing.assert_close(out[keep], ref[keep], rtol=1e-10, atol=1e-12)


def test_gradients_equal_the_references_and_pass_gradcheck():
    L, C = 13, 4
    q0, k0, v0, s0 = _qkvs(2, 2, L, seed=3)
    w = torch.randn(2, 2, L, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = []
    for fn in (lambda q, k, v, s: chunk_parallel_linear_attention(q, k, v, k_log_scale=s, chunk_size=C)[0],
               lambda q, k, v, s: _reference(q, k, v, s)):
        q, k, v, s = (t.clone().requires_grad_() for t in (q0, k0, v0, s0))
        (fn(q, k, v, s) * w).sum().backward()
        grads.append([t.grad for t in (q, k, v, s)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    q, k, v, s = (t[:1, :1, :7].clone().requires_grad_() for t in (q0, k0, v0, s0 / 10))
    assert torch.autograd.gradcheck(lambda *x: chunk_parallel_linear_attention(*x[:3], k_log_scale=x[3], chunk_size=3)[0],
                                    (q, k, v, s))
    assert torch.autograd.gradcheck(lambda *x: chunk_parallel_linear_attention(*x, chunk_size=3)[0], (q, k, v))


def test_float32_over_a_wide_range_of_key_scales_is_finite_and_causal():
    """Log-scales spanning 600 nats (a single reference scale would underflow float32 by far): the
    float32 output matches float64, and a huge later key changes no earlier output."""
    L = 300
    q, k, v, s = _qkvs(1, 2, L, r=8, d=4, seed=7, spread=1.0)
    s = s + torch.linspace(-300, 300, L, dtype=torch.float64).view(1, 1, L, 1).flip(2)   # falling scales
    s[:, :, 150:] += 400                                                                  # a jump mid-way
    ref = _reference(q, k, v, s)
    out, _ = chunk_parallel_linear_attention(q.float(), k.float(), v.float(), k_log_scale=s.float(), chunk_size=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=2e-4, atol=2e-5)
    s2 = s.clone()
    s2[:, :, 200] = 1e4                                                                   # a later dominant key
    out2, _ = chunk_parallel_linear_attention(q.float(), k.float(), v.float(), k_log_scale=s2.float(), chunk_size=16)
    assert torch.equal(out2[:, :, :200], out[:, :, :200])
    assert torch.isfinite(out2).all()


def test_a_future_non_finite_value_leaves_earlier_outputs_and_gradients_exact():
    L = 40
    q0, k0, v0, s0 = _qkvs(1, 2, L, seed=8)
    v0[:, :, 25] = float("inf")
    grads, outs = [], []
    for n in (L, 25):
        q, k, v, s = (t[:, :, :n].clone().requires_grad_() for t in (q0, k0, v0, s0))
        out, _ = chunk_parallel_linear_attention(q, k, v, k_log_scale=s, chunk_size=8)
        outs.append(out[:, :, :25])
        (out[:, :, :25] * v0[:, :, :25].cos()).sum().backward()
        grads.append([t.grad[:, :, :25] for t in (q, k, v, s)])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-14)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    full, _ = chunk_parallel_linear_attention(q0, k0, v0, k_log_scale=s0, chunk_size=8)
    assert torch.isnan(full[:, :, 25:]).all()                                              # its own and later


def test_long_sequences_double_the_chunk_and_still_match(monkeypatch):
    monkeypatch.setattr(chunk_parallel, "MAX_CHUNKS", 4)
    assert parallel_chunk_length(100, 8) == 32 and parallel_chunk_length(32, 8) == 8
    q, k, v, s = _qkvs(1, 1, 100, seed=9)
    out, _ = chunk_parallel_linear_attention(q, k, v, k_log_scale=s, chunk_size=8)
    torch.testing.assert_close(out, _reference(q, k, v, s), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scaled", [False, True])
def test_the_number_of_ops_does_not_grow_with_the_length(scaled):
    """Forward + backward dispatches the same aten ops at L = 128 and L = 4,096 (the sequential path:
    a few per chunk)."""
    counts = []
    for L in (128, 4096):
        q, k, v, s = (t.float().requires_grad_() for t in _qkvs(1, 2, L, r=8, d=4, seed=10))

        def call():
            out, _ = chunk_parallel_linear_attention(q, k, v, k_log_scale=s if scaled else None, chunk_size=32)
            out.sum().backward()
        call()                                                   # the chunk's mask is made once per length
        counts.append(count_aten_ops(call))
    assert counts[0] == counts[1], counts


# --------------------------------------------------------------------------- the layer's "parallel" backend
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["softmax", "favor++", "relu", "elu", "hedgehog"])
def test_the_parallel_backend_computes_what_the_cpu_path_computes(kernel, causal):
    """backend=parallel (the GPU's torch path) and backend=torch (the CPU's): the same outputs and
    gradients in float64, with padding and a local head; decoding from the parallel prompt state too."""
    from protein_performer.attention import Attention
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 37, 32, generator=g, dtype=torch.float64)
    pad = torch.zeros(2, 37, dtype=torch.bool)
    pad[1, 30:] = True
    runs = []
    for backend in ("torch", "parallel"):
        torch.manual_seed(0)
        m = Attention(32, 4, kernel=kernel, nb_features=16, chunk_size=8, causal=causal, backend=backend,
                      local_heads=1, local_window=5).double().eval()
        x = x0.clone().requires_grad_()
        out = m(x, pad)
        (out[~pad] ** 2).sum().backward()
        runs.append((out[~pad], x.grad, [p.grad for p in m.parameters()]))
        if causal:  # a prompt through the parallel path, then one token by the recurrence
            st = m.init_state(1)
            o1, st = m.step(x0[:1, :36], st)
            o2, _ = m.step(x0[0, 36:37], st)
            torch.testing.assert_close(torch.cat([o1[0], o2]), m(x0[:1])[0], rtol=1e-9, atol=1e-10)
    (o1, gx1, gp1), (o2, gx2, gp2) = runs
    torch.testing.assert_close(o2, o1, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(gx2, gx1, rtol=1e-8, atol=1e-10)
    for a, b in zip(gp1, gp2):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-10)

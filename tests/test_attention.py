"""Attention core against independent references (naive quadratic attention, exact softmax,
loop-based recurrences, hand-computed values)."""
import math

import pytest
import torch

from protein_performer.attention import (KERNELS, Attention, CausalLinearAttention, FavorPlus,
                                         bidirectional_linear_attention, build_feature_map, chunk_linear_attention,
                                         init_linear_state, kernel_attention, linear_attention,
                                         recurrent_linear_attention, softmax_attention_sdpa)
from protein_performer.attention.chunk_parallel import chunk_parallel_linear_attention
from protein_performer.attention.naive import (naive_linear_attention, naive_recurrent_linear_attention,
                                               softmax_attention)

LINEAR_KERNELS = [k for k in KERNELS if k != "exact"]


def _positive(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g, dtype=dtype) + 0.05


def _normal(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


# --------------------------------------------------------------------------- functional
def test_hand_computed_values():
    # L = 2, r = 1, d = 1: q' = [1, 2], k' = [1, 3], v = [10, 20]
    q = torch.tensor([1.0, 2.0]).view(1, 1, 2, 1)
    k = torch.tensor([1.0, 3.0]).view(1, 1, 2, 1)
    v = torch.tensor([10.0, 20.0]).view(1, 1, 2, 1)
    # bidirectional: every query sees (1*10 + 3*20) / (1 + 3) = 17.5
    assert torch.allclose(linear_attention(q, k, v).flatten(), torch.tensor([17.5, 17.5]))
    # causal: query 0 sees only key 0 -> 10; query 1 sees both -> 17.5
    assert torch.allclose(linear_attention(q, k, v, causal=True).flatten(), torch.tensor([10.0, 17.5]))
    # padding key 1 removes it from numerator and normalizer: everyone gets 10
    mask = torch.tensor([[False, True]])
    assert torch.allclose(linear_attention(q, k, v, key_padding_mask=mask).flatten(), torch.tensor([10.0, 10.0]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L,chunk", [(1, 4), (16, 4), (19, 4), (19, 32), (37, 7)])
def test_linear_attention_matches_naive(causal, L, chunk):
    q, k, v = _positive(2, 3, L, 8, seed=1), _positive(2, 3, L, 8, seed=2), _normal(2, 3, L, 5, seed=3)
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[1, L // 2 + 1:] = True
    for m in (None, mask):
        out = linear_attention(q, k, v, causal=causal, key_padding_mask=m, chunk_size=chunk)
        ref = naive_linear_attention(q, k, v, causal=causal, key_padding_mask=m)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_causal_matches_loop_recurrence():
    q, k, v = _positive(1, 2, 23, 6, seed=4), _positive(1, 2, 23, 6, seed=5), _normal(1, 2, 23, 3, seed=6)
    torch.testing.assert_close(linear_attention(q, k, v, causal=True, chunk_size=5),
                               naive_recurrent_linear_attention(q, k, v), rtol=1e-10, atol=1e-12)


def test_many_chunks_and_padded_tail():
    q, k, v = _positive(2, 2, 45, 6, seed=7), _positive(2, 2, 45, 6, seed=8), _normal(2, 2, 45, 4, seed=9)
    for chunk in (1, 2, 4, 44, 45, 46):
        torch.testing.assert_close(linear_attention(q, k, v, causal=True, chunk_size=chunk),
                                   naive_linear_attention(q, k, v, causal=True), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("L,chunk", [(1, 4), (12, 4), (13, 4), (13, 5), (6, 16), (23, 3)])
def test_causal_product_gradcheck(L, chunk):
    q = _positive(2, L, 3, seed=10).requires_grad_()
    k = _positive(2, L, 3, seed=11).requires_grad_()
    v = _normal(2, L, 2, seed=12).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: CausalLinearAttention.apply(a, b, c, None, 1e-30, chunk)[0],
                                    (q, k, v), fast_mode=L > 13)
    log_scale = (_normal(2, L, seed=31) * 3).requires_grad_()  # key j's features are k_j exp(log_scale_j)
    assert torch.autograd.gradcheck(lambda a, b, c, s: CausalLinearAttention.apply(a, b, c, s, 1e-30, chunk)[0],
                                    (q, k, v, log_scale), fast_mode=L > 13)


@pytest.mark.parametrize("L,chunk", [(1, 4), (10, 4), (12, 3)])
def test_causal_gradients_match_naive(L, chunk):
    """Every input gradient of the full normalized causal attention, with padding, equals the
    gradient of the naive quadratic reference (float64), and passes gradcheck."""
    q0, k0, v0 = _positive(2, 2, L, 4, seed=13), _positive(2, 2, L, 4, seed=14), _normal(2, 2, L, 3, seed=15)
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[0, -1] = L > 1
    w = _normal(2, 2, L, 3, seed=16)
    grads = []
    for fn in (lambda a, b, c: linear_attention(a, b, c, causal=True, key_padding_mask=mask, chunk_size=chunk),
               lambda a, b, c: naive_linear_attention(a, b, c, causal=True, key_padding_mask=mask)):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        (fn(q, k, v) * w).sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    assert torch.autograd.gradcheck(
        lambda a, b, c: linear_attention(a, b, c, causal=True, key_padding_mask=mask, chunk_size=chunk), (q, k, v), fast_mode=True)


def test_recurrent_step_matches_parallel():
    q, k, v = _positive(2, 3, 17, 6, seed=17), _positive(2, 3, 17, 6, seed=18), _normal(2, 3, 17, 4, seed=19)
    ref = linear_attention(q, k, v, causal=True, chunk_size=4)
    state = init_linear_state(2, 3, 6, 4, dtype=torch.float64)
    for t in range(17):
        out, state = recurrent_linear_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                initial_state=state, output_final_state=True)
        torch.testing.assert_close(out, ref[:, :, t:t + 1], rtol=1e-10, atol=1e-12)


def test_fp32_state_under_bf16_inputs():
    q, k = _positive(1, 2, 64, 8, seed=20), _positive(1, 2, 64, 8, seed=21)
    v = _normal(1, 2, 64, 4, seed=22)
    out = linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, chunk_size=16)
    assert out.dtype == torch.bfloat16
    ref = naive_linear_attention(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_sdpa_matches_handwritten_softmax():
    q, k, v = _normal(2, 2, 11, 8, seed=23), _normal(2, 2, 11, 8, seed=24), _normal(2, 2, 11, 8, seed=25)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, 7:] = True
    for causal in (False, True):
        out = softmax_attention_sdpa(q, k, v, causal=causal, key_padding_mask=mask)
        ref = softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(out[1, :, :7], ref[1, :, :7])  # real queries


# --------------------------------------------------------------------------- feature maps
@pytest.mark.parametrize("kernel", ["softmax", "favor++", "trig"])
def test_stabilized_features_give_same_attention(kernel):
    """The stabilizers (query row max, key bound) cancel exactly: same attention as raw features."""
    fm = build_feature_map(kernel, 16, 64, generator=torch.Generator().manual_seed(1)).double()
    if kernel == "favor++":
        fm.rho.fill_(0.3)
    q, k, v = _normal(1, 2, 20, 16, seed=26) * 0.7, _normal(1, 2, 20, 16, seed=27) * 0.7, _normal(1, 2, 20, 5, seed=28)
    raw = naive_linear_attention(fm(q, True, stabilize=False), fm(k, False, stabilize=False), v, causal=True)
    kf, k_log_scale = fm(k, False)
    stab = linear_attention(fm(q, True), kf, v, causal=True, eps=fm.normalizer_eps, k_log_scale=k_log_scale)
    torch.testing.assert_close(stab, raw, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kernel", ["softmax", "favor++"])
def test_positive_features_are_unbiased_softmax_kernel(kernel):
    """Mean over many independent draws of phi(x).phi(y) -> exp(x.y / sqrt(d)) (hand formula)."""
    d = 8
    x, y = _normal(1, 1, 3, d, seed=29) * 0.5, _normal(1, 1, 3, d, seed=30) * 0.5
    exact = torch.exp(x[0, 0] @ y[0, 0].T / math.sqrt(d))
    g = torch.Generator().manual_seed(2)
    fm = build_feature_map(kernel, d, 2048, orthogonal=False, generator=g).double()
    if kernel == "favor++":
        fm.set_rho(x, y)
        assert fm.rho.item() > 0  # A < 0: genuinely different from FAVOR+
    est = 0
    for _ in range(24):
        fm.redraw(g)
        est = est + fm(x, True, stabilize=False)[0, 0] @ fm(y, False, stabilize=False)[0, 0].T / 24
    torch.testing.assert_close(est, exact, rtol=0.04, atol=0)


def test_key_features_bounded_and_finite_at_extreme_inputs():
    fm = FavorPlus(64, 256)
    k = torch.randn(1, 1, 1000, 64) * torch.logspace(-2, 1.3, 1000).view(1, 1, -1, 1)  # norms up to ~160
    f, log_scale = fm(k, is_query=False)
    assert torch.isfinite(f).all() and torch.allclose(f.amax(-1), torch.ones(1000)) and torch.isfinite(log_scale).all()
    fq = fm(k, is_query=True)  # the query stabilizer: a softmax over the features, rows summing to 1
    assert torch.isfinite(fq).all() and torch.allclose(fq.sum(-1), torch.ones(1000))
    u = (k.double() * 64 ** -0.25) @ fm.projection.double().T  # exp(w.x) up to the row factor
    torch.testing.assert_close(fq.double(), torch.softmax(u, -1), rtol=1e-4, atol=1e-12)


def test_orthogonal_projection_rows():
    fm = FavorPlus(16, 40, orthogonal=True, generator=torch.Generator().manual_seed(3))
    w = fm.projection.double()
    block = w[:16] / w[:16].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(16, dtype=torch.float64), atol=1e-5, rtol=0)
    assert w.shape == (40, 16)


# --------------------------------------------------------------------------- the module
@pytest.mark.parametrize("kernel", KERNELS)
def test_module_step_matches_causal_forward(kernel):
    torch.manual_seed(0)
    m = Attention(32, 4, kernel=kernel, nb_features=16, chunk_size=4, causal=True).eval()
    x = torch.randn(2, 11, 32)
    ref = m(x)
    state = m.init_state(2, None)
    for t in range(11):
        out, state = m.step(x[:, t], state)
        torch.testing.assert_close(out, ref[:, t], rtol=1e-5, atol=1e-5)
    assert state["pos"] == 11


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_module_padding_invariance(kernel, causal):
    """Real positions' outputs do not depend on the content or number of padded positions."""
    torch.manual_seed(0)
    m = Attention(32, 4, kernel=kernel, nb_features=16, chunk_size=4, causal=causal).eval()
    x = torch.randn(2, 9, 32)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 6:] = True
    out = m(x, mask)
    x2 = x.clone()
    x2[1, 6:] = torch.randn(3, 32) * 5
    out2 = m(x2, mask)
    torch.testing.assert_close(out[1, :6], out2[1, :6], rtol=1e-5, atol=1e-5)
    alone = m(x[1:, :6])  # the unpadded sequence on its own
    torch.testing.assert_close(out[1, :6], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_module_causality(kernel):
    torch.manual_seed(0)
    m = Attention(32, 4, kernel=kernel, nb_features=16, chunk_size=4, causal=True).double().eval()
    x = torch.randn(1, 14, 32, dtype=torch.float64)
    out = m(x)
    for j in (0, 5, 9, 13):
        x2 = x.clone()
        x2[:, j:] = torch.randn(1, 14 - j, 32, dtype=torch.float64) * 3
        out2 = m(x2)
        assert torch.equal(out[:, :j], out2[:, :j]), f"output before {j} changed"


# --------------------------------------------------------------------------- states: one signature
def _qkvs(B, H, L, r=5, d=3, seed=40, scale=True):
    q, k, v = _positive(B, H, L, r, seed=seed), _positive(B, H, L, r, seed=seed + 1), _normal(B, H, L, d, seed=seed + 2)
    s = _normal(B, H, L, 1, seed=seed + 3) * 20 if scale else None  # key log-scales over ~80 nats
    return q, k, v, s


@pytest.mark.parametrize("path", [chunk_linear_attention, chunk_parallel_linear_attention])
@pytest.mark.parametrize("scale", [False, True])
def test_chunked_from_initial_state_equals_running_the_concatenation(scale, path):
    """Outputs and every gradient (q, k, v, log-scales) of two pieces, the second started from the
    first's final state, equal one call on the whole sequence; the final states agree too, and
    (the parallel path) equal the sequential path's."""
    L, C = 29, 4
    q0, k0, v0, s0 = _qkvs(2, 2, L, scale=scale)
    w = _normal(2, 2, L, 3, seed=50)
    for cut in (1, 8, 11, 28):  # inside a chunk, on a chunk boundary, one position left
        runs = []
        for pieces in ([(0, L)], [(0, cut), (cut, L)]):
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            s = None if s0 is None else s0.clone().requires_grad_()
            outs, state = [], None
            for a, b in pieces:
                o, state = path(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], chunk_size=C,
                                k_log_scale=None if s is None else s[:, :, a:b],
                                initial_state=state, output_final_state=True)
                outs.append(o)
            out = torch.cat(outs, dim=2)
            (out * w).sum().backward()
            runs.append((out, state, [t.grad for t in (q, k, v, s) if t is not None]))
        (o1, st1, g1), (o2, st2, g2) = runs
        torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(o1, naive_linear_attention(q0, k0 if s0 is None else k0 * s0.exp(), v0, causal=True),
                                   rtol=1e-10, atol=1e-12)
        _, seq = chunk_linear_attention(q0, k0, v0, k_log_scale=s0, chunk_size=C, output_final_state=True)
        for a, b, c in zip(st1, st2, seq):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(a.detach(), c, rtol=1e-10, atol=1e-12)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gradients_through_the_states_pass_gradcheck():
    """Gradients into initial_state (S, Z) and from the final state (S, Z), with key log-scales (m0 above
    every log-scale, so the final state's units m stay m0: m is a gauge and carries no gradient)."""
    L, C = 7, 3
    q, k, v, s = _qkvs(1, 1, L, r=3, d=2)
    s = (s / 20).clamp(-2, 2)
    q, k, v, s = (t.requires_grad_() for t in (q, k, v, s))
    S0, Z0 = _positive(1, 1, 3, 2, seed=60).requires_grad_(), _positive(1, 1, 3, seed=61).requires_grad_()
    m0 = torch.full((1, 1, 1), 3.0, dtype=torch.float64)

    def f(q, k, v, s, S0, Z0):
        o, (S, Z, m) = chunk_linear_attention(q, k, v, k_log_scale=s, chunk_size=C, initial_state=(S0, Z0, m0),
                                              output_final_state=True)
        return o, S, Z
    assert torch.autograd.gradcheck(f, (q, k, v, s, S0, Z0))


def test_recurrent_and_bidirectional_paths_continue_from_a_state():
    q, k, v, s = _qkvs(2, 3, 13)
    ref = linear_attention(q, k, v, causal=True, chunk_size=4, k_log_scale=s)
    o1, st = chunk_linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], k_log_scale=s[:, :, :6],
                                    output_final_state=True)
    o2, st_rec = recurrent_linear_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], k_log_scale=s[:, :, 6:],
                                            initial_state=st, output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2], 2), ref, rtol=1e-10, atol=1e-12)
    _, st_all = chunk_linear_attention(q, k, v, k_log_scale=s, output_final_state=True)
    for a, b in zip(st_rec, st_all):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # bidirectional: the initial state's keys are seen by every query, the final state holds all keys
    _, st = bidirectional_linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], k_log_scale=s[:, :, :6],
                                           output_final_state=True)
    out, st_b = bidirectional_linear_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], k_log_scale=s[:, :, 6:],
                                               initial_state=st, output_final_state=True)
    full = naive_linear_attention(q, k * s.exp(), v)
    torch.testing.assert_close(out, full[:, :, 6:], rtol=1e-10, atol=1e-12)
    for a, b in zip(st_b[:2], st_all[:2]):  # same keys, same units (m is the same maximum)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_future_infinity_leaves_earlier_gradients_exact():
    """issue 19's reproduction: elu features (head_dim 16), L = 300, v[:, :, 200] = 3e38, causal,
    chunk 64; the gradients of a loss on the first 200 outputs equal those of running only the
    first 200 positions (they were NaN from position 0: 0 * inf in the backward)."""
    fm = build_feature_map("elu", 16)
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, 2, 300, 16, generator=g) for _ in range(3))
    v0[:, :, 200] = 3e38
    grads = []
    for L in (300, 200):
        q, k, v = (t[:, :, :L].clone().requires_grad_() for t in (q0, k0, v0))
        out = kernel_attention(fm, q, k, v, causal=True, chunk_size=64)
        out[:, :, :200].sum().backward()
        grads.append([t.grad[:, :, :200] for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # float64, an infinite value, log-scaled keys (FAVOR+): the same
    fm = build_feature_map("softmax", 16, 32, generator=torch.Generator().manual_seed(1)).double()
    q0, k0, v0 = q0.double() * 0.5, k0.double() * 0.5, v0.double()
    v0[:, :, 200] = float("inf")
    grads = []
    for L in (300, 200):
        q, k, v = (t[:, :, :L].clone().requires_grad_() for t in (q0, k0, v0))
        out = kernel_attention(fm, q, k, v, causal=True, chunk_size=64)
        (out[:, :, :200] * v0[:, :, :200].sin()).sum().backward()
        grads.append([t.grad[:, :, :200] for t in (q, k, v)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", LINEAR_KERNELS + ["exact"])
def test_module_steps_several_tokens_at_once(kernel):
    """Attention.step on T tokens (the chunked path from the state) equals T one-token steps and the
    parallel forward, and leaves the same state."""
    torch.manual_seed(0)
    m = Attention(16, 2, kernel=kernel, nb_features=8, chunk_size=4, causal=True).double().eval()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    ref = m(x)
    one = m.init_state(2)
    for t in range(11):
        _, one = m.step(x[:, t], one)
    st = m.init_state(2)
    o1, st = m.step(x[:, :1], st)
    o2, st = m.step(x[:, 1:7], st)
    o3, st = m.step(x[:, 7:], st)
    torch.testing.assert_close(torch.cat([o1, o2, o3], 1), ref, rtol=1e-10, atol=1e-10)
    assert st.keys() == one.keys() and st["pos"] == 11
    for key in st:
        if key != "pos":
            torch.testing.assert_close(st[key], one[key], rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- fused FAVOR (fused_favor.py)
@pytest.mark.parametrize("backend", ["torch", "parallel"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["softmax", "favor++"])
def test_fused_favor_matches_naive(kernel, causal, backend, monkeypatch):
    """The fused paths (fused_favor.py: features formed block by block; bidirectional: recomputed in
    the backward; causal: their gradients folded into the chunked backward; backend=parallel: the
    whole sequence in one block, WholeFavorAttention, or chunk_parallel.py) against the quadratic
    formula on the raw, unstabilized features: outputs and gradients, with padding, keys whose norms
    differ by orders of magnitude (the running maximum grows from block to block), 16-row blocks
    (so 5 blocks per row and a short last one) and, causal, 16-position chunks."""
    from protein_performer.attention import fused_favor
    monkeypatch.setattr(fused_favor, "BLOCK_BYTES", 1)
    monkeypatch.setattr(fused_favor, "CHUNK_BYTES", 1)  # causal: the requested 64 halves to 16
    H, L, d = 3, 70, 8
    fm = build_feature_map(kernel, d, 24, generator=torch.Generator().manual_seed(5), heads=H).double()
    if kernel == "favor++":
        fm.rho.copy_(torch.tensor([0.0, 0.4, 1.5], dtype=torch.float64))  # per head: A differs by head
    spread = torch.logspace(-1, 0.6, L, dtype=torch.float64).view(1, 1, L, 1)
    q = (_normal(2, H, L, d, seed=40) * 0.6).requires_grad_()
    k = (_normal(2, H, L, d, seed=41) * spread).requires_grad_()
    v = _normal(2, H, L, 5, seed=42).requires_grad_()
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[1, 50:] = True
    out = kernel_attention(fm, q, k, v, causal=causal, key_padding_mask=mask, chunk_size=64, backend=backend)
    ref = naive_linear_attention(fm(q, True, stabilize=False), fm(k, False, stabilize=False), v, causal=causal,
                                 key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-12)
    go = _normal(2, H, L, 5, seed=43)
    grads = torch.autograd.grad(out, (q, k, v), go)
    refs = torch.autograd.grad(ref, (q, k, v), go)
    for got, want in zip(grads, refs):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    assert grads[1][1, :, 50:].abs().max() == 0 and grads[2][1, :, 50:].abs().max() == 0  # padded keys
    assert grads[0].abs().max() > 1e-3 and grads[1].abs().max() > 1e-3  # not trivially zero


def test_causal_chunk_shrinks_to_fit_its_tiles():
    """rows x C x r float32 values within CHUNK_BYTES (2 MiB = 524,288 values), halving, not below 16."""
    from protein_performer.attention.fused_favor import chunk_length
    assert chunk_length(8, 256, 64) == 64            # 131,072 values: fits
    assert chunk_length(64, 256, 64) == 32           # 1,048,576 at 64; 524,288 at 32
    assert chunk_length(64, 256, 64, itemsize=8) == 16
    assert chunk_length(10_000, 256, 128) == 16      # the floor
    assert chunk_length(32, 256, 64) == 64 and chunk_length(33, 256, 64) == 32


@pytest.mark.parametrize("backend", ["torch", "parallel"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_favor_gradcheck(causal, backend, monkeypatch):
    from protein_performer.attention import fused_favor
    monkeypatch.setattr(fused_favor, "BLOCK_BYTES", 1)
    fm = FavorPlus(4, 8, generator=torch.Generator().manual_seed(6)).double()
    q, k, v = (_normal(1, 2, 21, w, seed=44 + i).requires_grad_() for i, w in enumerate((4, 4, 3)))
    assert torch.autograd.gradcheck(lambda q, k, v: kernel_attention(fm, q, k, v, causal, chunk_size=8, backend=backend),
                                    (q, k, v))


@pytest.mark.parametrize("backend", ["torch", "parallel"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_favor_float32_matches_float64(causal, backend):
    """float32 inputs (the training dtype), on either path, against the float64 CPU path at realistic norms."""
    fm = FavorPlus(32, 256, generator=torch.Generator().manual_seed(7))
    q, k, v = _normal(2, 4, 600, 32, seed=47), _normal(2, 4, 600, 32, seed=48), _normal(2, 4, 600, 32, seed=49)
    ref = kernel_attention(fm.double(), q, k, v, causal)
    out = kernel_attention(fm.float(), q.float(), k.float(), v.float(), causal, backend=backend)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("backend", ["torch", "parallel"])
def test_fused_favor_padding_edges(backend):
    """Two padding edges of the fused bidirectional paths, each guarded by its own mask. Row 0: keys whose
    exponents all lie below -750 (exp underflows in float64) beside padded keys; the stabilizer's maximum must come from
    real keys only, or every real feature underflows. Output and gradients equal the formula with that
    maximum subtracted by hand. Row 1 is padding only: its values and keys get no gradient and its output
    stays finite."""
    d, L = 8, 12
    fm = build_feature_map("softmax", d, 16, generator=torch.Generator().manual_seed(1)).double()
    q = _normal(2, 2, L, d, seed=1).requires_grad_()
    k = _normal(2, 2, L, d, seed=2)
    # every key of norm R with c R^2 = 1,000: exponents near -1,000, within about 120 of each other
    k = (k / k.norm(dim=-1, keepdim=True) * (1000 / fm.exponent(torch.float64)[2]) ** 0.5).requires_grad_()
    v = _normal(2, 2, L, 4, seed=3).requires_grad_()
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[0, 8:] = True
    mask[1, :] = True
    out = kernel_attention(fm, q, k, v, key_padding_mask=mask, backend=backend)
    go = _normal(2, 2, L, 4, seed=4)
    grads = torch.autograd.grad(out, (q, k, v), go)
    # the reference: u = k w^T - c |k|^2, shifted by the maximum over row 0's real keys, then the plain formula
    w, _, c = fm.exponent(torch.float64)
    u = k[:1] @ w.T - c * (k[:1] * k[:1]).sum(-1, keepdim=True)
    assert u[..., :8, :].max() < -750                                # exp(u) alone underflows to 0 in float64
    kf = torch.exp(u - u[..., :8, :].amax((-2, -1), keepdim=True).detach())
    qf = torch.exp(q[:1] @ w.T - (q[:1] @ w.T).amax(-1, keepdim=True).detach())
    kf = kf * (~mask[:1])[:, None, :, None]                            # padded keys count nowhere
    A = qf @ kf.transpose(-1, -2)                                     # the quadratic formula: weights q'_i . k'_j
    ref = (A @ v[:1]) / A.sum(-1, keepdim=True)
    refs = torch.autograd.grad(ref, (q, k, v), go[:1])
    torch.testing.assert_close(out[:1], ref, rtol=1e-9, atol=1e-12)
    for got, want in zip(grads, refs):
        torch.testing.assert_close(got[:1], want[:1], rtol=1e-8, atol=1e-10)
    assert torch.isfinite(out[1]).all() and grads[1][1].abs().max() == 0 and grads[2][1].abs().max() == 0
    assert grads[2][0, :, :8].abs().max() > 1e-3                      # real keys' values do get gradient

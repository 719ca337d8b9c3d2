"""Numerics of the exponential feature maps and the causal path: float32 against float64 of the
same computation, many chunks against the naive quadratic reference, and non-finite values at
future or padded positions (perturbation)."""
import copy

import pytest
import torch

from protein_performer.attention import (Attention, build_feature_map, kernel_attention, linear_attention,
                                         recurrent_linear_attention)
from protein_performer.attention.naive import naive_linear_attention


def _data(d, logit_std, L=192, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, L, d, generator=g, dtype=torch.float64) * logit_std
    k = torch.randn(1, 2, L, d, generator=g, dtype=torch.float64) * logit_std
    v = torch.randn(1, 2, L, 8, generator=g, dtype=torch.float64)
    return q, k, v


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _recurrent(fm, q, k, v):
    """Outputs of the recurrent path, position by position (the RNN decoding path)."""
    kf, ls = fm(k, is_query=False)
    return recurrent_linear_attention(fm(q, is_query=True), kf, v, k_log_scale=ls)[0]


@pytest.mark.parametrize("kernel", ["softmax", "favor++"])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_float32_agrees_with_float64(kernel, d):
    """Same projection, same inputs: float32 within 1e-3 of float64 for logit std 0.25-4, causal and
    bidirectional, chunked and recurrent.  (A data-independent key bound underflowed every key
    feature at head_dim 128.)"""
    for std in (0.25, 1.0, 4.0):
        q, k, v = _data(d, std)
        fm = build_feature_map(kernel, d, 128, generator=torch.Generator().manual_seed(1), heads=2)
        if kernel == "favor++":
            fm.set_rho(q, k)
        fm64 = copy.deepcopy(fm).double()
        for causal in (False, True):
            ref = kernel_attention(fm64, q, k, v, causal=causal, chunk_size=16)
            out = kernel_attention(fm, q.float(), k.float(), v.float(), causal=causal, chunk_size=16)
            assert _rel(out, ref) < 1e-3, (std, causal, _rel(out, ref))
        ref = kernel_attention(fm64, q[:, :, :48], k[:, :, :48], v[:, :, :48], causal=True)
        rec = _recurrent(fm, q[:, :, :48].float(), k[:, :, :48].float(), v[:, :, :48].float())
        assert _rel(rec, ref) < 1e-3, (std, "recurrent", _rel(rec, ref))


def _positive(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.05


@pytest.mark.parametrize("with_scale", [False, True])
def test_many_chunks_outputs_and_gradients_match_naive(with_scale):
    """75 chunks of 4 (> 64: three scan blocks, so the block offsets of the prefix sums matter),
    with and without key log-scales spread over 60 nats, against the quadratic reference."""
    L, C = 300, 4
    q0, k0 = _positive(2, 2, L, 5, seed=1), _positive(2, 2, L, 5, seed=2)
    v0 = torch.randn(2, 2, L, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s = (torch.rand(2, 2, L, 1, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 60 - 30
         if with_scale else None)
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[1, 250:] = True
    w = torch.randn(2, 2, L, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    w[1, :, 250:] = 0
    grads = []
    for fast in (True, False):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        if fast:
            out = linear_attention(q, k, v, causal=True, key_padding_mask=mask, chunk_size=C, k_log_scale=s)
        else:
            out = naive_linear_attention(q, k if s is None else k * s.exp(), v, causal=True, key_padding_mask=mask)
        (out * w).sum().backward()
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("kernel", ["softmax", "favor++", "relu", "elu"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_future_or_padded_value_stays_put(kernel, bad):
    torch.manual_seed(0)
    x = torch.randn(2, 21, 32)
    for causal in (True, False):
        m = Attention(32, 4, kernel=kernel, nb_features=16, chunk_size=8, causal=causal).eval()
        mask = torch.zeros(2, 21, dtype=torch.bool)
        mask[1, 15:] = True
        ref = m(x, mask)
        x2 = x.clone()
        x2[1, 17] = bad                                  # a padded position
        if causal:
            x2[0, 11] = bad                              # a future position, same chunk as 8..10
        out = m(x2, mask)
        assert torch.equal(out[1, :15], ref[1, :15]), "padded value reached real outputs"
        if causal:
            assert torch.equal(out[0, :11], ref[0, :11]), "future value reached past outputs"
            # and it is not hidden where it belongs: every later row, in its chunk and after, is non-finite
            assert (~torch.isfinite(out[0, 11:])).any(-1).all()


def test_trig_kernel_warns():
    with pytest.warns(UserWarning, match="unsafe for training"):
        Attention(32, 4, kernel="trig", nb_features=16)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_value_alone_poisons_only_later_rows(bad):
    """Only v is non-finite (finite features): rows before it are exactly unchanged, and every
    row from it on, in its own chunk too, is non-finite rather than silently finite."""
    q, k = _positive(1, 2, 21, 6, seed=6), _positive(1, 2, 21, 6, seed=7)
    v = torch.randn(1, 2, 21, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    ref = linear_attention(q, k, v, causal=True, chunk_size=8)
    v2 = v.clone()
    v2[:, :, 11, 1] = bad
    out = linear_attention(q, k, v2, causal=True, chunk_size=8)
    assert torch.equal(out[:, :, :11], ref[:, :, :11])
    assert (~torch.isfinite(out[:, :, 11:])).any(-1).all()


@pytest.mark.parametrize("kernel", ["softmax", "favor++"])
def test_fused_features_gradients_match_the_raw_formula(kernel):
    """The one-pass exponential features (matmul with the bias and norm columns, row max, exp; own
    backward) give the gradients of the unstabilized formula exp(w.x - |x|^2/2) through the naive
    quadratic attention, float64, causal and bidirectional, per-head FAVOR++ parameters included."""
    fm = build_feature_map(kernel, 16, 24, generator=torch.Generator().manual_seed(3), heads=3).double()
    if kernel == "favor++":
        fm.rho.copy_(torch.tensor([0.1, 0.6, 2.0], dtype=torch.float64))
    g = torch.Generator().manual_seed(9)
    q0, k0 = (torch.randn(2, 3, 37, 16, generator=g, dtype=torch.float64) * 0.8 for _ in range(2))
    v0, w = (torch.randn(2, 3, 37, 5, generator=g, dtype=torch.float64) for _ in range(2))
    for causal in (True, False):
        grads = []
        for fast in (True, False):
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            if fast:
                out = kernel_attention(fm, q, k, v, causal=causal, chunk_size=8)
            else:
                out = naive_linear_attention(fm(q, True, stabilize=False), fm(k, False, stabilize=False), v,
                                             causal=causal)
            grads.append([out.detach(), *torch.autograd.grad((out * w).sum(), (q, k, v))])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_head_groups_equal_all_heads_at_once(monkeypatch):
    """Attention head group by head group (linear.GROUP_BYTES) gives the outputs and gradients of all
    heads at once, with padding and causal masking."""
    import protein_performer.attention.linear as linear

    fm = build_feature_map("softmax", 8, 16, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(10)
    q0, k0, v0 = (torch.randn(2, 5, 33, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, 33, dtype=torch.bool)
    mask[1, 29:] = True
    for causal in (True, False):
        runs = []
        for group_bytes in (2 ** 40, 2 * 33 * 16 * 4 * 2):  # all heads; groups of 2 (5 heads: 2, 2, 1)
            monkeypatch.setattr(linear, "GROUP_BYTES", group_bytes)
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            out = kernel_attention(fm, q, k, v, causal=causal, key_padding_mask=mask, chunk_size=8)
            runs.append([out[0], out[1, :, :29], *torch.autograd.grad(out[0].sum() + out[1, :, :29].sum(), (q, k, v))])
        assert linear.head_groups(2, 5, 33, 16) == 2
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_running_max_jump_of_20_nats_matches_naive():
    """Key log-scales that jump by +20 nats inside a chunk (and +60 in a later one): outputs and
    gradients (incl. the log-scales') equal the quadratic float64 reference."""
    L, C = 50, 8
    q0, k0 = _positive(2, 2, L, 5, seed=11), _positive(2, 2, L, 5, seed=12)
    v0 = torch.randn(2, 2, L, 3, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    s0 = torch.randn(2, 2, L, 1, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    s0[:, :, 19:] += 20.0                                # inside the chunk 16..23
    s0[:, 1, 42:] += 60.0
    w = torch.randn(2, 2, L, 3, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    grads = []
    for fast in (True, False):
        q, k, v, s = (t.clone().requires_grad_() for t in (q0, k0, v0, s0))
        if fast:
            out = linear_attention(q, k, v, causal=True, chunk_size=C, k_log_scale=s)
        else:
            out = naive_linear_attention(q, k * s.exp(), v, causal=True)
        grads.append([out.detach(), *torch.autograd.grad((out * w).sum(), (q, k, v, s))])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)

"""Exact attention in a sliding window (attention/local.py) and the local heads of the attention layer,
against the quadratic float64 reference (naive.local_softmax_attention), which is itself checked
against hand-computable cases: window 1 (each position sees itself: out = v) and a window as long
as the sequence (plain softmax attention)."""
import pytest
import torch

from protein_performer.attention import Attention
from protein_performer.attention.linear import linear_attention
from protein_performer.attention.local import local_attention, local_decode
from protein_performer.attention.naive import local_softmax_attention, softmax_attention
from protein_performer.errors import UserError
from protein_performer.model import ModelConfig


def qkv(L, B=2, H=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, d, generator=g, dtype=torch.float64) for _ in range(3)]


def padding(B, L):
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[-1, L - L // 3:] = True
    return pad


@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_itself_at_window_one_and_softmax_at_full_window(causal):
    q, k, v = qkv(23)
    assert torch.equal(local_softmax_attention(q, k, v, 1, causal), v)
    torch.testing.assert_close(local_softmax_attention(q, k, v, 23, causal), softmax_attention(q, k, v, causal),
                               rtol=1e-12, atol=1e-12)
    # a band by hand: query 10 with window 3 sees keys 8..12 (bidirectional) or 8..10 (causal)
    keys = slice(8, 11) if causal else slice(8, 13)
    p = torch.softmax(q[:, :, 10:11] @ k[:, :, keys].transpose(-1, -2) / 8 ** 0.5, dim=-1)
    torch.testing.assert_close(local_softmax_attention(q, k, v, 3, causal)[:, :, 10:11], p @ v[:, :, keys],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L,window", [(1, 4), (5, 4), (37, 8), (64, 16), (100, 128), (300, 7)])
def test_blockwise_equals_the_quadratic_band(L, window, causal):
    q, k, v = qkv(L)
    for pad in (None, padding(2, L)):
        got = local_attention(q, k, v, window, causal, pad)
        ref = local_softmax_attention(q, k, v, window, causal, pad)
        real = slice(None) if pad is None else ~pad[:, None, :, None].expand_as(got)
        torch.testing.assert_close(got[real], ref[real], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_the_references(causal):
    q, k, v = (t.requires_grad_() for t in qkv(45, H=2))
    pad = padding(2, 45)
    g = torch.randn(2, 2, 45, 8, dtype=torch.float64).masked_fill(pad[:, None, :, None], 0)
    got = torch.autograd.grad((local_attention(q, k, v, 6, causal, pad) * g).sum(), (q, k, v))
    ref = torch.autograd.grad((local_softmax_attention(q, k, v, 6, causal, pad) * g).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert all(a.abs().sum() > 0 for a in got)


def test_a_far_change_leaves_a_query_alone_and_a_near_one_does_not():
    q, k, v = qkv(60)
    base = local_attention(q, k, v, 8, causal=True)
    v2 = v.clone()
    v2[:, :, 40] += 1.0                     # seen by queries 40..47 only
    out = local_attention(q, k, v2, 8, causal=True)
    changed = (out - base).abs().amax(dim=(0, 1, 3)) > 0
    assert changed.nonzero().flatten().tolist() == list(range(40, 48))


def test_decoding_in_pieces_matches_the_parallel_band_with_a_bounded_cache():
    q, k, v = qkv(50)
    ref = local_softmax_attention(q, k, v, 8, causal=True)
    cache, outs = (k[:, :, :0], v[:, :, :0]), []
    for a, b in [(0, 1), (1, 6), (6, 19), (19, 20), (20, 36), (36, 50)]:  # pieces up to and over the window
        out, cache = local_decode(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], 8, cache)
        outs.append(out)
        assert cache[0].shape[2] == min(b, 7)
    torch.testing.assert_close(torch.cat(outs, 2), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:attention kernel 'trig'")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["softmax", "favor++", "relu", "trig", "elu", "hedgehog", "exact"])
def test_layer_local_heads_then_kernel_heads(kernel, causal):
    """Heads 0..n-1 are the band on their q, k, v; the others are the kernel (its map built for those
    heads only) on theirs; causal decoding token by token and by prompts gives the parallel forward."""
    torch.manual_seed(0)
    layer = Attention(32, 4, kernel=kernel, nb_features=16, causal=causal, local_heads=1, local_window=6,
                      redraw_interval=0).double().eval()
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    pad = None if causal else padding(2, 40)
    q, k, v = layer._qkv(x)
    local = local_softmax_attention(q[:, :1], k[:, :1], v[:, :1], 6, causal, pad)
    if kernel == "exact":
        rest = softmax_attention(q[:, 1:], k[:, 1:], v[:, 1:], causal, pad)
    else:
        fm = layer.feature_map
        qf, (kf, s) = fm(q[:, 1:], is_query=True), fm(k[:, 1:], is_query=False)
        floor = fm.normalizer_floor(k[:, 1:], causal, pad)
        rest = linear_attention(qf, kf, v[:, 1:], causal=causal, key_padding_mask=pad, k_log_scale=s,
                                eps=fm.normalizer_eps if floor is None else floor)
    ref = layer._merge(torch.cat([local, rest], dim=1))
    out = layer(x, pad)
    real = slice(None) if pad is None else ~pad
    torch.testing.assert_close(out[real], ref[real], rtol=1e-9, atol=1e-10)
    if kernel in ("favor++", "hedgehog"):  # per-head parameters for the 3 kernel heads only
        per_head = layer.feature_map.rho if kernel == "favor++" else layer.feature_map.weight
        assert per_head.shape[0] == 3
    if not causal:
        return
    state, outs = layer.init_state(2), []
    for a, b in [(0, 1), (1, 4), (4, 15), (15, 16), (16, 40)]:
        o, state = layer.step(x[:, a:b], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), out, rtol=1e-9, atol=1e-10)
    assert state["local"][0].shape == (2, 1, 5, 8)


def test_config_refuses_local_heads_outside_the_heads():
    with pytest.raises(UserError, match=r"model.attention.local_heads must be an integer in \[0, model.heads=4\), got 4"):
        ModelConfig(attention={"local_heads": 4})
    with pytest.raises(UserError, match="model.attention.local_window must be a positive integer, got 0"):
        ModelConfig(attention={"local_heads": 1, "local_window": 0})


@pytest.mark.parametrize("causal", [False, True])
def test_the_mask_one_forward_shares_fits_every_head_of_a_padded_batch(causal):
    """masks.AttentionMasks builds the additive band once per forward for all layers: with padding it is
    per protein and per local head (2 of each here); through it, the blockwise path equals the band."""
    from protein_performer.attention.masks import AttentionMasks
    q, k, v = qkv(45, H=2)
    pad = padding(2, 45)
    bias = AttentionMasks(pad, 45).local_bias(6, causal, 2, q.dtype, q.device)
    got = local_attention(q, k, v, 6, causal, pad, bias=bias)
    ref = local_softmax_attention(q, k, v, 6, causal, pad)
    real = ~pad[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], ref[real], rtol=1e-12, atol=1e-12)

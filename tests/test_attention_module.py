"""The Attention module: wiring against a hand-composed reference, redraw schedule, checkpoints,
rank-independent draws, mixed precision and long-sequence numerics."""
import copy
import io

import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.attention import KERNELS, Attention, build_feature_map, projection_seed
from protein_performer.attention.naive import naive_linear_attention, softmax_attention
from protein_performer.attention.rotary import RotaryEmbedding

LINEAR = [k for k in KERNELS if k != "exact"]


def _reference(m: Attention, x: torch.Tensor, mask=None) -> torch.Tensor:
    """The module's computation rebuilt from independent pieces: einsum projections, rotary,
    the feature map, and the *quadratic* naive attention (or hand-written softmax)."""
    B, L, _ = x.shape
    H, dh = m.heads, m.head_dim
    qkv = torch.einsum("bld,ed->ble", x, m.to_qkv.weight).view(B, L, 3, H, dh)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    if m.rotary is not None:
        rot = RotaryEmbedding(dh).to(x.dtype)
        q, k = rot(q), rot(k)
    if m.kernel == "exact":
        out = softmax_attention(q, k, v, causal=m.causal, key_padding_mask=mask)
    else:
        fm = m.feature_map
        out = naive_linear_attention(fm(q, True, stabilize=False), fm(k, False, stabilize=False), v,
                                     causal=m.causal, key_padding_mask=mask)
    return out.transpose(1, 2).reshape(B, L, H * dh) @ m.to_out.weight.T + m.to_out.bias


@pytest.mark.parametrize("kernel", ["softmax", "favor++", "relu", "elu", "exact"])
@pytest.mark.parametrize("causal", [False, True])
def test_module_matches_hand_composed_reference_and_gradients(kernel, causal):
    torch.manual_seed(0)
    m = Attention(24, 3, kernel=kernel, nb_features=12, chunk_size=5, causal=causal).double().eval()
    if kernel == "favor++":
        m.feature_map.rho.fill_(0.2)
    x = torch.randn(2, 13, 24, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[1, 9:] = True
    out, ref = m(x, mask), _reference(m, x, mask)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1, :9], ref[1, :9])
    w = torch.randn_like(out)
    w[1, 9:] = 0  # padded outputs carry no meaning
    g1 = torch.autograd.grad((out * w).sum(), [x, m.to_qkv.weight])
    g2 = torch.autograd.grad((ref * w).sum(), [x, m.to_qkv.weight])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("base", [10000.0, 300.0])
def test_model_rotary_base_rotates_pairs_by_the_hand_computed_angles(base):
    """model.rotary_base sets theta_i = base^(-2i/d): feature pair (i, i + d/2) of the vector at position p
    is rotated by p * theta_i (written out with math.cos / math.sin)."""
    import math

    from protein_performer.model.config import ModelConfig
    from protein_performer.model.encoder import PerformerLM
    net = PerformerLM(ModelConfig(dim=16, heads=2, depth=1, rotary_base=base))
    rot = net.encoder.blocks[0].attn.rotary
    d = 8
    x = torch.randn(1, 1, 40, d)
    got = rot(x)[0, 0]
    for p in (0, 1, 7, 39):
        for i in range(d // 2):
            a = p * base ** (-2 * i / d)
            x1, x2 = float(x[0, 0, p, i]), float(x[0, 0, p, i + d // 2])
            assert abs(float(got[p, i]) - (x1 * math.cos(a) - x2 * math.sin(a))) < 1e-5
            assert abs(float(got[p, i + d // 2]) - (x2 * math.cos(a) + x1 * math.sin(a))) < 1e-5
    for bad in (1, 0.5, True, "big"):
        with pytest.raises(UserError, match="model.rotary_base must be a number above 1"):
            ModelConfig(rotary_base=bad)


def test_redraw_schedule_training_only():
    m = Attention(16, 2, kernel="softmax", nb_features=8, redraw_interval=3, seed=7)
    x = torch.randn(1, 5, 16)
    p0 = m.feature_map.projection.clone()
    m.eval()
    for _ in range(10):
        m(x)
    assert torch.equal(m.feature_map.projection, p0) and m.redraws == 0
    m.train()
    seen = []
    for _ in range(7):
        m(x)
        seen.append(m.feature_map.projection.clone())
    # calls 0,1,2 use draw 0; 3,4,5 draw 1; 6 draw 2
    assert torch.equal(seen[0], p0) and torch.equal(seen[2], p0)
    assert not torch.equal(seen[3], p0) and torch.equal(seen[3], seen[5])
    assert not torch.equal(seen[6], seen[5]) and m.redraws == 2
    # draw n is a pure function of (seed, n): what another DDP rank computes without communication
    other = build_feature_map("softmax", 8, 8, generator=torch.Generator().manual_seed(projection_seed(7, 2)))
    torch.testing.assert_close(other.projection, seen[6], rtol=0, atol=0)


def test_redraw_disabled():
    for interval in (0, None):
        m = Attention(16, 2, kernel="softmax", nb_features=8, redraw_interval=interval).train()
        p0 = m.feature_map.projection.clone()
        for _ in range(5):
            m(torch.randn(1, 4, 16))
        assert torch.equal(m.feature_map.projection, p0)


def test_two_ranks_identical_and_seeds_differ():
    a = Attention(16, 2, nb_features=8, seed=3, redraw_interval=2).train()
    b = Attention(16, 2, nb_features=8, seed=3, redraw_interval=2).train()
    c = Attention(16, 2, nb_features=8, seed=4, redraw_interval=2).train()
    for _ in range(5):
        a(torch.randn(1, 4, 16))
        b(torch.randn(1, 6, 16))  # different data on the other rank
    assert torch.equal(a.feature_map.projection, b.feature_map.projection)
    assert not torch.equal(a.feature_map.projection, c.feature_map.projection)


@pytest.mark.parametrize("kernel", LINEAR)
def test_checkpoint_roundtrip_identical_outputs(kernel):
    torch.manual_seed(0)
    m = Attention(16, 2, kernel=kernel, nb_features=8, redraw_interval=2, seed=1).train()
    for _ in range(5):  # several redraws (and FAVOR++ rho updates) happen
        m(torch.randn(2, 6, 16))
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    m2 = Attention(16, 2, kernel=kernel, nb_features=8, redraw_interval=2, seed=1)
    m2.load_state_dict(torch.load(buf, weights_only=True))
    assert (m2.forward_calls, m2.redraws) == (m.forward_calls, m.redraws)
    x = torch.randn(2, 6, 16)
    m.eval(), m2.eval()
    torch.testing.assert_close(m(x), m2(x), rtol=0, atol=0)
    # the schedule resumes where it stopped
    m.train(), m2.train()
    m(x), m2(x)
    assert torch.equal(m.feature_map.projection, m2.feature_map.projection) if m.feature_map.random else True


def test_favor_plus_plus_rho_tracks_training_data_and_is_frozen_in_eval():
    m = Attention(16, 2, kernel="favor++", nb_features=8)
    x = torch.randn(2, 10, 16) * 3
    m.eval()
    m(x)
    assert torch.all(m.feature_map.rho == 0)  # eval never updates (rho = 0 is FAVOR+)
    m.train()
    m(x)
    r1 = m.feature_map.rho.clone()
    assert torch.all(r1 > 0)
    # the first update sets rho to the data's statistic, computed independently here
    q, k, _ = m._qkv(x)
    s = 16 ** 0 * (8 ** -0.25)
    qs, ks = q.double() * s, k.double() * s
    expect = ((qs.unsqueeze(3) + ks.unsqueeze(2)) ** 2).sum(-1).mean(dim=(0, 2, 3)) / 8  # mean |x_i+y_j|^2/d
    torch.testing.assert_close(r1.double(), expect, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_autocast_cpu(kernel, causal):
    torch.manual_seed(0)
    m = Attention(32, 4, kernel=kernel, nb_features=16, chunk_size=8, causal=causal).eval()
    x = torch.randn(2, 40, 32)
    ref = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)
    # training step under autocast: finite gradients
    m.train()
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x).float().pow(2).mean().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(m.to_qkv.weight.grad).all()


def _realistic_input(L, dim=64, seed=0):
    """LayerNorm'd activations with a few large outlier features, as in trained transformers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, L, dim, generator=g)
    x[..., :4] *= 6
    return torch.nn.functional.layer_norm(x, (dim,)) * 2


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("kernel", LINEAR)
def test_long_sequence_matches_float64_and_the_same_tokens_run_short(kernel):
    """At 8,192 positions: the float32 output equals the same module in float64 (a numerics
    reference), its first 512 positions equal the first 512 tokens run alone (causal), and the
    gradients are finite and equal float64's."""
    torch.manual_seed(0)
    m = Attention(64, 2, kernel=kernel, nb_features=64, chunk_size=128, causal=True).eval()  # no rho update
    x = _realistic_input(8192).requires_grad_()
    out = m(x)
    out.square().mean().backward()
    ref = copy.deepcopy(m).double()
    x64 = x.detach().double().requires_grad_()
    out64 = ref(x64)
    out64.square().mean().backward()
    tol = 1e-2 if kernel == "trig" else 1e-4  # trig: normalizers near zero amplify round-off (refused for training)
    assert _rel(out, out64) < tol
    assert torch.isfinite(x.grad).all()
    if kernel != "trig":  # trig's gradients through near-zero normalizers reach 1e5: float32 cannot follow them
        assert _rel(x.grad, x64.grad) < 10 * tol
    with torch.no_grad():
        short = ref(x64[:, :512])
    assert _rel(out64[:, :512], short) < 1e-10
    assert out.abs().mean() > 1e-3  # not a collapsed (all-zero) output


@pytest.mark.slow
@pytest.mark.parametrize("kernel", LINEAR)
@pytest.mark.parametrize("causal", [False, True])
def test_65536_finite_fp32_and_bf16(kernel, causal):
    """65,536 positions: bf16 autocast agrees with fp32 (fp32 states), gradients finite; causal: the
    first 1,024 positions equal the same tokens run short."""
    torch.manual_seed(0)
    m = Attention(64, 2, kernel=kernel, nb_features=64, chunk_size=256, causal=causal)
    x = _realistic_input(65536).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert torch.isfinite(out.float()).all()
    out.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()
    with torch.no_grad():
        full = m(x)
        assert _rel(out.float(), full) < 5e-2 and full.abs().mean() > 1e-3
        if causal:
            assert _rel(full[:, :1024], m(x[:, :1024])) < 1e-5
"""The fidelity work of issue 19 against float64 references written here: the Hedgehog map's
formula and gradients, its distillation, the row references of naive.py against full quadratic
attention, the fidelity benchmark's floor recomputed by hand, seed-dependent projections and
the refusal to train trig."""
import hashlib
import math
import sys

import pytest
import torch

from protein_performer.attention import Attention, build_feature_map, distill, kernel_attention, projection_seed
from protein_performer.attention.naive import (kernel_rows, kernel_scores, mean_rows, naive_linear_attention,
                                               softmax_attention, softmax_rows)
from protein_performer.errors import UserError

from conftest import ROOT
from forkserver import forks


def _iid(d, L, std, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, L, d, generator=g, dtype=torch.float64) for _ in range(3))
    return q * math.sqrt(std), k * math.sqrt(std), v


def _hedgehog(d=8, r=12, heads=2, seed=3):
    fm = build_feature_map("hedgehog", d, r, generator=torch.Generator().manual_seed(seed), heads=heads).double()
    with torch.no_grad():
        fm.bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))  # a non-zero bias is used
    return fm


# --------------------------------------------------------------------------- Hedgehog
@pytest.mark.parametrize("causal", [False, True])
def test_hedgehog_attention_is_its_formula(causal):
    """phi(x) = [softmax(x W_h + b_h), softmax(-x W_h - b_h)] per head, attention D^-1 (phi(q) phi(k)^T) V
    written out with exp and sums, against the fast path."""
    fm = _hedgehog()
    q, k, v = _iid(8, 10, 1.0)
    W, b = fm.weight.detach(), fm.bias.detach()

    def phi(x):
        u = torch.einsum("bhld,hdm->bhlm", x, W) + b
        e, f = torch.exp(u), torch.exp(-u)
        return torch.cat([e / e.sum(-1, keepdim=True), f / f.sum(-1, keepdim=True)], -1)
    kern = phi(q) @ phi(k).transpose(-1, -2)
    if causal:
        kern = kern * torch.tril(torch.ones(10, 10, dtype=torch.float64))
    torch.testing.assert_close(kernel_attention(fm, q, k, v, causal=causal, chunk_size=4),
                               (kern @ v) / kern.sum(-1, keepdim=True), rtol=1e-12, atol=1e-12)
    assert fm.num_features == 12 and not fm.random


class _Attend(torch.nn.Module):
    def __init__(self, fm, causal):
        super().__init__()
        self.fm, self.causal = fm, causal

    def forward(self, q, k, v):
        return kernel_attention(self.fm, q, k, v, causal=self.causal, chunk_size=2)


@pytest.mark.parametrize("causal", [False, True])
def test_hedgehog_gradcheck(causal):
    """Gradients w.r.t. q, k, v and the map's own W, b, in float64 against finite differences."""
    attend = _Attend(_hedgehog(d=4, r=6), causal)
    q, k, v = (t.requires_grad_() for t in _iid(4, 5, 1.0))
    W, b = (p.detach().clone().requires_grad_() for p in (attend.fm.weight, attend.fm.bias))
    f = lambda q, k, v, W, b: torch.func.functional_call(attend, {"fm.weight": W, "fm.bias": b}, (q, k, v))  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v, W, b))


def test_distilled_hedgehog_beats_the_mean_of_values():
    """Distilled on fresh draws, scored on others: closer to exact softmax (naive.softmax_attention)
    than the plain mean of the values, where FAVOR+ at the same r is not (logit std 1)."""
    d, r = 16, 32
    fm = build_feature_map("hedgehog", d, r, generator=torch.Generator().manual_seed(0), heads=2)
    losses = distill(fm, lambda step: tuple(t.float() for t in _iid(d, 64, 1.0, seed=100 + step)[:2]), steps=60)
    assert losses[-1] < losses[0]
    q, k, v = _iid(d, 128, 1.0, seed=1)
    ref = softmax_attention(q, k, v)
    err = lambda out: float((out.detach() - ref).norm() / ref.norm())  # noqa: E731
    mean = err(v.mean(-2, keepdim=True).expand_as(ref))
    favor = build_feature_map("softmax", d, r, generator=torch.Generator().manual_seed(0)).double()
    assert err(kernel_attention(fm.double(), q, k, v)) < 0.9 * mean < err(kernel_attention(favor, q, k, v))


def test_hedgehog_module_trains_its_map():
    """In the model the map is part of the parameters: one optimiser step moves it."""
    torch.manual_seed(0)
    m = Attention(16, 2, kernel="hedgehog", nb_features=8)
    before = m.feature_map.weight.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 7, 16)).square().mean().backward()
    opt.step()
    assert not torch.equal(before, m.feature_map.weight) and m.feature_map.weight.shape == (2, 8, 4)


# --------------------------------------------------------------------------- row references
@pytest.mark.parametrize("causal", [False, True])
def test_row_references_equal_full_quadratic_attention(causal):
    q, k, v = _iid(8, 33, 1.0)
    rows = torch.tensor([0, 5, 17, 32])
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    if causal:
        logits = logits.masked_fill(~torch.tril(torch.ones(33, 33, dtype=torch.bool)), float("-inf"))
    p = softmax_rows(q, k, rows, causal)
    torch.testing.assert_close(p, torch.softmax(logits, -1)[:, :, rows])
    torch.testing.assert_close(p @ v, softmax_attention(q, k, v, causal=causal)[:, :, rows])
    fm = build_feature_map("softmax", 8, 16, generator=torch.Generator().manual_seed(1)).double()
    a, den = kernel_rows(kernel_scores(fm(q[:, :, rows], True), *fm(k, False)), rows, causal)
    full = naive_linear_attention(fm(q, True, stabilize=False), fm(k, False, stabilize=False), v, causal=causal)
    torch.testing.assert_close(a @ v, full[:, :, rows], rtol=1e-10, atol=1e-12)
    assert torch.all(den > 0) and torch.allclose(a.sum(-1), torch.ones_like(den))
    hand = torch.stack([v[:, :, : i + 1].mean(-2) if causal else v.mean(-2) for i in rows.tolist()], 2)
    torch.testing.assert_close(mean_rows(v, rows, causal), hand)


def test_benchmark_quick_floor_is_the_mean_of_values(tmp_path):
    """benchmarks/quality/fidelity.py --quick writes its doc; its 'mean of values' cell is recomputed here from
    the same data (the benchmark's seed-0 draw) with the full quadratic reference."""
    out = tmp_path / "fidelity.md"
    forks().run([sys.executable, str(ROOT / "benchmarks" / "quality" / "fidelity.py"), "--quick", "--out", str(out)],
                check=True, capture_output=True)
    from benchmarks import common
    from benchmarks.quality import fidelity
    table = common.read_md_table(out, "head_dim 16, logit std 1")
    mean = next(r for r in table if r["kernel"] == "mean of values")
    q, k, v = (t[:, :, :64] for t in fidelity.iid(16, 1.0, 256, 2, seed=0))
    ref = softmax_attention(q, k, v)
    rows = fidelity.sample_rows(64, 32)
    ref = ref[:, :, rows]
    err = float(((v.mean(-2, keepdim=True) - ref).norm(dim=-1) / ref.norm(dim=-1)).mean())  # per row, averaged
    assert mean["bidir. L=64"].split()[0] == f"{err:.2f}"
    assert {r["kernel"] for r in table} >= {"FAVOR+", "FAVOR++", "trig", "ReLU", "elu+1", "Hedgehog"}
    assert "no trained checkpoint" in out.read_text()


def test_checkpoint_qkv_are_what_the_layers_attend_with(tmp_path):
    """(b)'s q, k, v of a (tiny, exact-attention) checkpoint: softmax attention of them, through the layer's
    output projection, is the layer's output on the same tokens; the benchmark then scores them."""
    from benchmarks import common
    from benchmarks.quality import fidelity
    from protein_performer.training.task import ProteinLM

    from conftest import save_checkpoint
    torch.manual_seed(0)
    task = ProteinLM(model=dict(dim=32, depth=2, heads=2, attention=dict(kernel="exact", local_heads=0)))
    ckpt = save_checkpoint(task, tmp_path / "tiny.ckpt")
    layers, model, tokens = fidelity.checkpoint_qkv(ckpt, proteins=2, max_len=48)
    outs = []
    hooks = [b.attn.register_forward_hook(lambda m, a, o: outs.append(o)) for b in model.blocks]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    assert len(layers) == 2 and layers[0][0].shape == (2, 2, 48, 16)
    for (q, k, v), out, block in zip(layers, outs, model.blocks):
        with torch.no_grad():
            mine = block.attn._merge(softmax_attention(q, k, v).float())
        torch.testing.assert_close(mine, out, rtol=1e-5, atol=1e-5)
    doc = tmp_path / "fidelity.md"
    forks().run([sys.executable, str(ROOT / "benchmarks" / "quality" / "fidelity.py"), "--quick", "--ckpt", ckpt,
                 "--ckpt-proteins", "4", "--ckpt-len", "64", "--out", str(doc)], check=True, capture_output=True)
    table = common.read_md_table(doc, next(line[4:] for line in doc.read_text().splitlines()
                                           if line.startswith("### ") and "(exact)" in line))
    assert [r["kernel"] for r in table][:2] == ["mean of values", "FAVOR+"] and "bidir. layer 1" in table[0]


# --------------------------------------------------------------------------- seeds, trig
def test_projections_depend_on_the_run_seed():
    old = int.from_bytes(hashlib.sha256(b"protein-performer:2:0").digest()[:8], "little") & ((1 << 63) - 1)
    assert projection_seed(2, 0) == projection_seed(2, 0, run_seed=0) == old  # seed 0: earlier draws kept
    a, b, c = (Attention(16, 2, nb_features=8, seed=2, run_seed=s).feature_map.projection for s in (0, 0, 7))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_training_sets_run_seed_and_refuses_trig():
    from protein_performer.compare import compose_train_config
    from protein_performer.training.run import build_task, check_settings
    task = build_task(compose_train_config(["seed=7", "model.depth=1"]), None)
    assert task.model.blocks[0].attn.run_seed == 7
    with pytest.raises(UserError, match=r"^model\.attention\.kernel=trig: refused for training"):
        check_settings(compose_train_config(["model.attention.kernel=trig"]))

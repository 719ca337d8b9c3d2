"""optim.optimizer=muon (Muon on the hidden matrices, AdamW on the rest, one optimizer object) and
optim.schedule=wsd (warm-up, stable, linear decay), against the torch optimizers stepped apart and
schedule values computed by hand."""
import copy
import math
from types import SimpleNamespace

import pytest
import torch

from protein_performer.training.optimizers import MuonWithAdamW, build_optimizer
from protein_performer.training.task import ProteinLM

MODEL = dict(dim=32, depth=1, heads=2, dropout=0.0, attention=dict(kernel="softmax", nb_features=8))


def task_with(total_steps, warmup_steps=10, **optim):
    task = ProteinLM(model=MODEL, lr=1e-3, warmup_steps=warmup_steps, min_lr_ratio=0.1, **optim)
    task._trainer = SimpleNamespace(estimated_stepping_batches=total_steps, callbacks=[])
    return task


def lrs(task, steps):
    conf = task.configure_optimizers()
    sched = conf["lr_scheduler"]["scheduler"]
    return [sched.lr_lambdas[0](s) for s in steps], conf["optimizer"]


def test_wsd_schedule_is_flat_then_linear_to_the_floor():
    # 110 steps, 10 of warm-up: progress t = (step - 10) / 100; decay over the last 20 % (t >= 0.8, step >= 90)
    values, _ = lrs(task_with(110, schedule="wsd", decay_fraction=0.2), [0, 9, 10, 50, 90, 100, 110])
    expected = [0.1, 1.0, 1.0, 1.0, 1.0, 1 - 0.9 * 0.5, 0.1]
    assert values == pytest.approx(expected)
    cosine, _ = lrs(task_with(110), [60])
    assert cosine == pytest.approx([0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))])


def test_muon_steps_the_matrices_and_adamw_the_rest_as_the_two_apart():
    torch.manual_seed(0)
    task = task_with(100, warmup_steps=0, optimizer="muon", weight_decay=0.01)  # lr factor 1 at step 0
    _, opt = lrs(task, [0])
    assert isinstance(opt, MuonWithAdamW)
    net = task.model
    matrices = [p for n, p in net.named_parameters() if p.ndim >= 2 and "norm" not in n and "embed" not in n]
    vectors = [p for n, p in net.named_parameters() if not (p.ndim >= 2 and "norm" not in n and "embed" not in n)]
    assert {id(p) for p in opt.muon.param_groups[0]["params"]} == {id(p) for p in matrices} and len(matrices) >= 4
    ref = copy.deepcopy(net)
    ref_m = [dict(ref.named_parameters())[n] for n, p in net.named_parameters() if any(p is q for q in matrices)]
    ref_v = [dict(ref.named_parameters())[n] for n, p in net.named_parameters() if any(p is q for q in vectors)]
    muon = torch.optim.Muon(ref_m, lr=1e-3, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": ref_v, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.98))
    tokens = torch.randint(5, 25, (2, 12))
    for _ in range(3):
        for model, step in ((net, lambda: opt.step()), (ref, lambda: (muon.step(), adamw.step()))):
            model(tokens).square().mean().backward()
            step()
            model.zero_grad()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(net.encoder.blocks[0].attn.to_qkv.weight, ProteinLM(model=MODEL).model.encoder.blocks[0].attn.to_qkv.weight)
    # the schedule scales both optimizers' groups; the state round-trips
    opt.param_groups[0]["lr"] = 0.5
    assert opt.muon.param_groups[0]["lr"] == 0.5
    again = build_optimizer("muon", matrices, vectors, 1e-3, (0.9, 0.98), 0.01)
    again.load_state_dict(opt.state_dict())
    assert again.muon.param_groups[0]["lr"] == 0.5 and len(again.adamw.state) == len(opt.adamw.state) > 0


def test_muon_without_whole_matrices_falls_back_to_adamw(caplog):
    """FSDP's flat shards leave no 2-D matrix: optim.optimizer=muon then trains everything with AdamW (a
    warning says so) instead of failing on an empty parameter list; steps equal plain AdamW's."""
    flat = [torch.nn.Parameter(torch.randn(12)), torch.nn.Parameter(torch.randn(5))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in flat]
    start = [p.detach().clone() for p in flat]
    with caplog.at_level("WARNING"):
        opt = build_optimizer("muon", [], flat, 1e-2, (0.9, 0.98), 0.01)
    assert isinstance(opt, torch.optim.AdamW) and "AdamW trains them all" in caplog.text
    plain = torch.optim.AdamW([{"params": ref, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.98))
    for _ in range(2):
        for params, o in ((flat, opt), (ref, plain)):
            sum(p.square().sum() for p in params).backward()
            o.step()
            o.zero_grad()
    for a, b, s in zip(flat, ref, start):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not torch.equal(a, s)  # it stepped

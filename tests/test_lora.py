"""LoRA fine-tuning (peft): adapters with B = 0 leave the network's outputs exactly as they were;
only the adapters and the head get gradients; merging gives W + (alpha / r) B A, computed here by
hand, and the merged network the adapted one's outputs; a ``finetune lora=true`` run leaves
every weight that has no adapter bit-identical and changes each adapted one by a matrix of rank
at most r; lora with freeze is one line, exit 2."""
import copy
import csv
import json
import random

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")

from protein_performer import finetune as FT  # noqa: E402
from protein_performer.hub.load import load_finetuned  # noqa: E402
from protein_performer.training.task import ProteinLM  # noqa: E402

from conftest import TINY_MODEL, run_command, save_checkpoint  # noqa: E402

TARGETS = ("to_qkv", "to_out", "fc1", "fc2")


@pytest.fixture(scope="module")
def task():
    torch.manual_seed(0)
    return ProteinLM(model=TINY_MODEL, objective="mlm").eval()


def tokens(task, n=3, seed=0):
    rng = random.Random(seed)
    seqs = ["".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(15, 30))) for _ in range(n)]
    from protein_performer.data.collate import pad_batch
    return pad_batch([task.tokenizer.encode(s) for s in seqs], task.tokenizer.pad_id)


def net_with_lora(task, rank=4, alpha=8.0, kind="classification"):
    torch.manual_seed(1)
    net = FT.FineTuneNet(copy.deepcopy(task.model.encoder), kind, 3 if kind != "regression" else 1, "mean", 0.0)
    base = copy.deepcopy(net).eval()
    net.add_lora(rank, alpha)
    return net, base


def adapted(net):
    """name -> peft LoRA layer, for every adapted projection."""
    from peft.tuners.lora import LoraLayer
    return {n: m for n, m in net.encoder.named_modules() if isinstance(m, LoraLayer)}


@pytest.mark.parametrize("kind", ["classification", "residue"])
def test_b_zero_gives_the_base_outputs_exactly(task, kind):
    net, base = net_with_lora(task, kind=kind)
    layers = adapted(net)
    assert sorted({n.rsplit(".", 1)[-1] for n in layers}) == sorted(TARGETS)
    assert len(layers) == len(TARGETS) * task.model.encoder.depth
    x, pad = tokens(task)
    with torch.no_grad():
        assert torch.equal(net.eval()(x, pad), base(x, pad))


def test_only_the_adapters_and_the_head_get_gradients(task):
    net, _ = net_with_lora(task)
    net.train()
    x, pad = tokens(task)
    for layer in adapted(net).values():  # B = 0 gives A no gradient: make B non-zero first
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    net(x, pad).logsumexp(-1).sum().backward()
    for name, p in net.named_parameters():
        trains = "lora_" in name or name.startswith("head.")
        assert p.requires_grad == trains, name
        if trains:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_merged_weights_are_base_plus_scaled_BA_and_give_the_same_outputs(task):
    rank, alpha = 4, 8.0
    net, base = net_with_lora(task, rank, alpha)
    torch.manual_seed(2)
    expected = {}
    for name, layer in adapted(net).items():
        A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        with torch.no_grad():
            B.normal_(std=0.2)
        W = base.encoder.get_submodule(name).weight
        expected[name] = (W + (alpha / rank) * B @ A).detach().clone()
    x, pad = tokens(task)
    net.eval()
    with torch.no_grad():
        before = net(x, pad)
    net.merge_lora()
    assert not adapted(net)
    for name, w in expected.items():
        layer = net.encoder.get_submodule(name)
        assert type(layer) is torch.nn.Linear
        torch.testing.assert_close(layer.weight, w, rtol=0, atol=1e-6)
        b0 = base.encoder.get_submodule(name).bias
        assert (layer.bias is None and b0 is None) or torch.equal(layer.bias, b0)
    assert set(FT._state(net)) == set(FT._state(base))  # plain encoder + head keys again
    with torch.no_grad():
        torch.testing.assert_close(net(x, pad), before, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(net(x, pad), base(x, pad), atol=1e-3)


def write_labels(path, n=120, seed=0):
    rng = random.Random(seed)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "sequence", "label", "split"])
        for k in range(n):
            label = "K" if k % 2 else "D"
            seq = "".join(label if rng.random() < 0.3 else rng.choice("ACDEFGHIKLMNPQRSTVWY")
                          for _ in range(rng.randint(20, 35)))
            w.writerow([f"p{k}", seq, label, "test" if k % 5 == 0 else "valid" if k % 5 == 1 else "train"])
    return path


def test_finetune_with_lora_changes_only_adapted_weights_by_rank_r(task, tmp_path, capsys):
    ckpt = save_checkpoint(task, tmp_path / "mlm.ckpt")
    labels = write_labels(tmp_path / "labels.csv")
    out = tmp_path / "out"
    rank = 2
    code, _, err = run_command("finetune", capsys, f"ckpt={ckpt}", f"labels={labels}", "task=classification",
                               f"output_dir={out}", "lora=true", f"lora_rank={rank}", "lora_alpha=4",
                               "lr=1e-2", "head_lr=1e-2", "trainer.max_steps=15", "max_tokens=800", "patience=20",
                               "probe_baseline=false")  # the adapted weights are what is tested
    assert code == 0, err
    meta = json.loads((out / "finetune.json").read_text())
    assert meta["lora"] == {"rank": rank, "alpha": 4.0, "dropout": 0.0}
    assert meta["schedule"] == "linear" and meta["warmup"] == FT.WARMUP == 0.06  # the defaults, recorded
    saved = load_file(str(out / "model.safetensors"))
    start = FT._state(task.model.encoder)
    changed = 0
    for name, w0 in start.items():
        w = saved[f"encoder.{name}"]
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in TARGETS:
            delta = (w.double() - w0.double())
            changed += int(delta.abs().max() > 0)
            assert torch.linalg.matrix_rank(delta, rtol=1e-4) <= rank, name
        else:
            assert torch.equal(w, w0), name
    assert changed == len(TARGETS) * task.model.encoder.depth
    net, _ = load_finetuned(out)  # its tensors are exactly a plain network's (adapters merged): it loads
    assert not any("lora_" in k for k in FT._state(net))
    assert json.loads((out / "metrics.json").read_text())["n"] == 24


def test_lora_under_the_default_ensemble_saves_merged_weights_beside_the_untouched_probe(task, tmp_path, capsys):
    """finetune's default ensemble with LoRA: the probe's member is the checkpoint's encoder bit for bit,
    both members are saved merged (no adapter tensors), and the folder loads."""
    ckpt = save_checkpoint(task, tmp_path / "mlm.ckpt")
    out = tmp_path / "out"
    code, _, err = run_command("finetune", capsys, f"ckpt={ckpt}", f"labels={write_labels(tmp_path / 'labels.csv')}",
                               "task=classification", f"output_dir={out}", "lora=true", "lora_rank=2", "lr=1e-2",
                               "head_lr=1e-2", "trainer.max_steps=15", "max_tokens=800", "patience=20",
                               "min_confidence=0", "epoch_confidence=1")  # the ensemble kept whatever the gates say
    assert code == 0, err
    assert json.loads((out / "finetune.json").read_text())["ensemble"] == 0.5
    saved = load_file(str(out / "model.safetensors"))
    assert not any("lora_" in k for k in saved)
    start = FT._state(task.model.encoder)
    assert all(torch.equal(saved[f"probe.encoder.{name}"], w0) for name, w0 in start.items())
    assert any(not torch.equal(saved[f"encoder.{name}"], w0) for name, w0 in start.items())
    net, _ = load_finetuned(out)
    assert net.probe is not None and not any("lora_" in k for k in FT._state(net))


def test_lora_with_freeze_is_one_line_exit_2(task, tmp_path, capsys):
    ckpt = save_checkpoint(task, tmp_path / "mlm.ckpt")
    labels = write_labels(tmp_path / "labels.csv")
    code, _, err = run_command("finetune", capsys, f"ckpt={ckpt}", f"labels={labels}", "task=classification",
                               f"output_dir={tmp_path / 'out'}", "lora=true", "freeze=all")
    assert code == 2 and "lora" in err and "freeze" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()

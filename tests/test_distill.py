"""Recovery after the attention swap: init_from and distillation from a softmax teacher
(training/distill.py, the task's loss), against hand computations."""

import numpy as np
import pytest
from omegaconf import OmegaConf
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from protein_performer.data.collate import Collator
from protein_performer.errors import UserError
from protein_performer.model import PerformerLM
from protein_performer.objectives import IGNORE
from protein_performer.tokenizer import Tokenizer
from protein_performer.training.distill import (Distiller, attention_mismatch, kl_to_teacher, load_start,
                                                student_config)
from protein_performer.training.run import train
from protein_performer.training.task import ProteinLM, load_checkpoint

from conftest import ROOT, TINY_MODEL, save_checkpoint

SEQS = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ", "MVLSPADKTNVKAAWGKVGAHAGEYGAEALERMFLSFPTTK", "MSIQHFRVALIPFFAAF"]


def batch(tokenizer=Tokenizer(), seed=0):
    rows = [torch.from_numpy(tokenizer.encode(s)).long() for s in SEQS]
    return Collator(tokenizer, "mlm", fixed_seed=seed)(rows)


def tiny(kernel="exact", seed=0, **kw):
    torch.manual_seed(seed)
    return ProteinLM(model={**TINY_MODEL, "attention": {"kernel": kernel, "nb_features": 16}, **kw})


def log_softmax_np(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_kl_term_equals_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 7, generator=g) * 3, torch.randn(2, 5, 7, generator=g) * 3
    scored = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)
    ls, lt = log_softmax_np(s.double().numpy()), log_softmax_np(t.double().numpy())
    m = scored.numpy()
    want = (np.exp(lt[m]) * (lt[m] - ls[m])).sum(-1).mean()
    assert float(kl_to_teacher(s, t, scored)) == pytest.approx(want, rel=1e-5)
    assert float(kl_to_teacher(t, t, scored)) == pytest.approx(0, abs=1e-6)


def test_attention_mismatch_equals_a_hand_computation_and_skips_padding():
    g = torch.Generator().manual_seed(1)
    s = [torch.randn(2, 4, 3, generator=g) for _ in range(2)]
    t = [torch.randn(2, 4, 3, generator=g) for _ in range(2)]
    pad = torch.tensor([[0, 0, 0, 1], [0, 0, 1, 1]], dtype=torch.bool)
    keep = ~pad.numpy()
    want = np.mean([((a.numpy()[keep] - b.numpy()[keep]) ** 2).sum() / (b.numpy()[keep] ** 2).sum()
                    for a, b in zip(s, t)])
    assert float(attention_mismatch(s, t, pad)) == pytest.approx(want, rel=1e-5)
    s[0][1, 3] += 100.0  # padding: ignored
    assert float(attention_mismatch(s, t, pad)) == pytest.approx(want, rel=1e-5)


def test_weight_zero_is_the_plain_masked_lm_loss():
    b = batch()
    student = tiny("elu")
    teacher = tiny("exact", seed=1).model
    plain = student.training_step(b, 0)
    want = F.cross_entropy(student(b["inputs"], b["padding_mask"]).flatten(0, 1), b["labels"].flatten(),
                           ignore_index=IGNORE)
    assert float(plain) == pytest.approx(float(want), rel=1e-6)
    student.set_distiller(Distiller(teacher, weight=0.0, attention_weight=0.0, where="t"))
    assert float(student.training_step(b, 0)) == pytest.approx(float(want), rel=1e-6)
    student.set_distiller(Distiller(teacher, weight=1.0, attention_weight=1.0, where="t"))
    assert float(student.training_step(b, 0)) > float(want) + 1e-3  # the terms are added


def test_a_student_identical_to_its_teacher_has_zero_distillation_loss():
    b = batch()
    teacher = tiny("exact")
    same = tiny("exact", seed=5)
    load_start(same.model, teacher.model, "teacher")
    d = Distiller(teacher.model, weight=1.0, attention_weight=1.0, where="t")
    _, terms = d.loss(same.model.eval(), b["inputs"], b["padding_mask"], b["labels"])
    assert float(terms["kl"]) == pytest.approx(0, abs=1e-6) and float(terms["attention"]) == pytest.approx(0, abs=1e-10)
    swapped = tiny("elu", seed=5)  # same weights, another attention: the terms are not zero
    load_start(swapped.model, teacher.model, "teacher")
    _, terms = d.loss(swapped.model.eval(), b["inputs"], b["padding_mask"], b["labels"])
    assert float(terms["kl"]) > 1e-6 and float(terms["attention"]) > 1e-3


@pytest.mark.parametrize("kernel", ["softmax", "elu", "hedgehog"])
def test_load_start_copies_every_weight_but_the_kernels(kernel):
    source = tiny("exact")
    student = tiny(kernel, seed=3)
    load_start(student.model, source.model, "src")
    got, want = student.model.state_dict(), source.model.state_dict()
    shared = [k for k in want if "_extra_state" not in k]
    assert shared and all(torch.equal(got[k], want[k]) for k in shared)
    assert any("feature_map" in k for k in got) == (kernel != "elu")
    wider = ProteinLM(model={**TINY_MODEL, "dim": 48})
    with pytest.raises(UserError, match="src: .*shape"):
        load_start(student.model, wider.model, "src")


def test_student_config_keeps_the_architecture_and_takes_the_attention():
    source = PerformerLM(dim=32, depth=3, heads=4, qkv_bias=True, attention={"kernel": "exact"})
    config = student_config(source, {"kernel": "elu"}, causal=False, where="src")
    assert config["depth"] == 3 and config["qkv_bias"] and config["attention"] == {"kernel": "elu"}
    with pytest.raises(UserError, match="src: a bidirectional model"):
        student_config(source, {"kernel": "elu"}, causal=True, where="src")


def test_esm_vocabulary_model_trains_on_the_data_pipelines_ids():
    """The data pipeline writes protein-performer ids; a model converted from ESM reads ESM's: the
    task maps them, so its loss is the one computed on ESM-encoded proteins."""
    task = ProteinLM(model={**TINY_MODEL, "vocabulary": "esm", "attention": {"kernel": "exact"}})
    assert task.tokenizer.vocabulary == "esm"
    ours = batch(Tokenizer())
    esm = Tokenizer(vocabulary="esm")
    # the same masks, written in ESM's ids by hand: token by token through the token strings
    ids = {i: esm.tokens.index(t) for i, t in enumerate(Tokenizer().tokens)}
    inputs = ours["inputs"].clone().apply_(lambda i: ids[i])
    labels = ours["labels"].clone().apply_(lambda i: i if i == IGNORE else ids[i])
    want = F.cross_entropy(task.model(inputs, ours["padding_mask"]).flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE)
    assert float(task.training_step(ours, 0)) == pytest.approx(float(want), rel=1e-6)
    # the unmasked positions are ESM's own encoding of each protein
    for r, seq in enumerate(SEQS):
        enc = torch.from_numpy(esm.encode(seq)).long()
        keep = labels[r, : len(enc)] == IGNORE
        assert keep.sum() > len(seq) // 2 and torch.equal(inputs[r, : len(enc)][keep], enc[keep])


def run(tmp, small_fasta, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["data.max_len=64", "data.batch_size=8", "data.max_tokens=null",
                                          "data.crop_schedule=null", "data.valid_fraction=0.1",
                                          "optim.warmup_steps=1", "logger=none", "trainer.enable_progress_bar=false",
                                          f"data.path={small_fasta}", *overrides])
    from protein_performer.hub.load import load_model
    return train(cfg, tmp, open_model=lambda p: load_model(p).net)


def test_train_init_from_a_checkpoint_and_distil(tmp_path, small_fasta):
    teacher = tiny("exact", seed=7)
    ckpt = save_checkpoint(teacher, tmp_path / "teacher.ckpt")
    start = ["model.attention.kernel=elu", f"init_from={ckpt}"]
    # zero steps: the teacher's weights under elu attention, the teacher's architecture
    run(tmp_path / "zero", small_fasta, *start, "trainer.max_steps=0")
    zero = load_checkpoint(str(tmp_path / "zero" / "checkpoints" / "last.ckpt"))
    assert zero.hparams.model["attention"]["kernel"] == "elu" and zero.hparams.model["dim"] == 32
    # the run folder's config.yaml records that architecture, not the composed defaults (dim 128, depth 4)
    recorded = OmegaConf.load(tmp_path / "zero" / "config.yaml").model
    assert (recorded.dim, recorded.depth, recorded.heads, recorded.attention.kernel) == (32, 2, 2, "elu")
    want = teacher.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in zero.model.state_dict().items() if "_extra_state" not in k)
    # three steps, with and without the teacher: the distillation terms change the update
    run(tmp_path / "mlm", small_fasta, *start, "trainer.max_steps=3")
    run(tmp_path / "kd", small_fasta, *start, "trainer.max_steps=3", f"distill.teacher={ckpt}",
        "distill.attention_weight=1.0")
    mlm = load_checkpoint(str(tmp_path / "mlm" / "checkpoints" / "last.ckpt")).model.state_dict()
    kd = load_checkpoint(str(tmp_path / "kd" / "checkpoints" / "last.ckpt")).model.state_dict()
    assert not torch.equal(mlm["embed.weight"], want["embed.weight"])
    assert not torch.equal(mlm["embed.weight"], kd["embed.weight"])


def test_a_teacher_of_another_shape_is_one_line(tmp_path, small_fasta):
    ckpt = save_checkpoint(tiny("exact"), tmp_path / "t.ckpt")
    other = save_checkpoint(ProteinLM(model={**TINY_MODEL, "dim": 48}), tmp_path / "o.ckpt")
    with pytest.raises(UserError, match="distill.teacher=.*o.ckpt: its dim is 48"):
        run(tmp_path / "r", small_fasta, f"init_from={ckpt}", f"distill.teacher={other}", "trainer.max_steps=1")

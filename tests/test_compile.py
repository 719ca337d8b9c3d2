"""One graph per shape (issue 63): the training step traces whole (no graph break), runs no host sync,
compiles once per bucket, and the compiled model (C++ kernels generated on the CPU) gives the eager
model's logits and gradients.  Tracing is cheap; inductor's compiling is not, so one small model per
direction is compiled with inductor (module-scoped) and the other checks trace with dynamo's own
backends ("eager": the graph run by eager torch; "aot_eager": forward and backward through AOTAutograd)."""
import copy

import numpy as np
import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

from protein_performer.attention.layer import Attention, count_forwards
from protein_performer.data.buckets import bucket_shape, default_buckets
from protein_performer.data.collate import Collator
from protein_performer.data.datamodule import ProteinDataModule
from protein_performer.model import PerformerLM
from protein_performer.resources import bundled
from protein_performer.tokenizer import Tokenizer
from protein_performer.training.compiled import compile_model
from protein_performer.training.task import ProteinLM

#: the models item 1 names: the default (FAVOR+ with a local head), FAVOR+ alone, elu+1 and exact
MODELS = {"default": dict(kernel="softmax", local_heads=1), "favor+": dict(kernel="softmax"),
          "elu": dict(kernel="elu"), "exact": dict(kernel="exact")}
#: (model, causal, backend): every CPU-selectable backend (exact attention has none)
CASES = [(name, causal, backend) for name in MODELS for causal in (False, True)
         for backend in (("torch", "parallel") if name != "exact" else ("auto",))]
SYNCS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero")


def small_model(name, causal, backend="auto", dropout=0.0, dim=32, dtype=torch.float32):
    torch.manual_seed(0)
    attention = dict(MODELS[name], nb_features=16, local_window=8, backend=backend, redraw_interval=2)
    return PerformerLM(vocab_size=Tokenizer().vocab_size, dim=dim, depth=2, heads=2, dropout=dropout, causal=causal,
                       attention=attention).to(dtype).train()


def padded_batch(B=2, L=40):
    """Tokens and a padding mask whose last row is padded from the middle."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, 25, (B, L), generator=g)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[-1, L // 2:] = True
    return tokens, pad


@pytest.mark.parametrize("name,causal,backend", CASES)
def test_training_step_traces_as_one_graph(name, causal, backend):
    m = small_model(name, causal, backend, dropout=0.1)
    tokens, pad = padded_batch()
    dynamo.reset()
    explained = dynamo.explain(lambda t, p: m(t, p).float().logsumexp(-1).mean())(tokens, pad)
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_count == 1
    # the backward too: fullgraph through AOTAutograd, gradients as eager's (with padding, dropout off)
    eager = small_model(name, causal, backend)
    traced = copy.deepcopy(eager)
    traced.compile(fullgraph=True, dynamic=False, backend="aot_eager")
    grads = []
    for net in (eager, traced):
        loss = net(tokens, pad)[~pad].logsumexp(-1).mean()
        loss.backward()
        grads.append([p.grad for p in net.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name,causal,backend", CASES)
def test_training_step_has_no_host_sync(name, causal, backend):
    """A training step (the task's training_step, loss and backward) calls none of the ops that wait for
    the device: whether a batch is padded is the data path's call, made before the step."""
    task = ProteinLM(model=dict(dim=32, depth=2, heads=2, dropout=0.1,
                                attention=dict(MODELS[name], nb_features=16, local_window=8, backend=backend)),
                     objective="clm" if causal else "mlm").train()
    task.log = lambda *a, **k: None  # Lightning's logging is outside the step's graph
    tokens, pad = padded_batch()
    labels = tokens.masked_fill(pad, -100)
    with torch.profiler.profile() as prof:
        task.training_step({"inputs": tokens, "labels": labels, "padding_mask": pad}, 0).backward()
    counts = {e.key: e.count for e in prof.key_averages() if e.key in SYNCS}
    assert counts == {}
    assert sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) > 50  # the profiler saw the step


def test_redraw_is_counted_between_compiled_steps():
    """A compiled model's forward does not count (a Python counter in the graph is a guard that changes
    every step); count_forwards does, between steps, on the same schedule as an eager model's forwards."""
    eager, compiled = small_model("favor+", False), small_model("favor+", False)
    dynamo.reset()
    compiled.compile(fullgraph=True, dynamic=False, backend="eager")
    tokens, pad = padded_batch()
    counters.clear()
    for _ in range(5):
        eager(tokens, pad)
        count_forwards(compiled)
        compiled(tokens, pad)
    attn = [m for m in compiled.modules() if isinstance(m, Attention)]
    assert [(a.forward_calls, a.redraws) for a in attn] == [(5, 2), (5, 2)]
    for a, b in zip(attn, [m for m in eager.modules() if isinstance(m, Attention)]):
        assert torch.equal(a.feature_map.projection, b.feature_map.projection)
    assert counters["stats"]["unique_graphs"] == 1  # five steps, one shape, one graph: no recompile


def test_one_epoch_of_the_bundled_sample_compiles_once_per_bucket():
    """Every batch of an epoch of the bundled sample (training and validation) comes in a bucket's shape,
    padding is at most 15 % of the tokens, and the compiled model traces once per shape."""
    dm = ProteinDataModule(bundled("sample/swissprot_sample_20k.fasta.gz"), max_len=1024, max_tokens=8192,
                           valid_fraction=0.02, crop_schedule=[[0, 256], [400, 1024]], buckets="auto")
    dm.setup("fit")
    assert dm.buckets == default_buckets(1024) == [64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024]
    train = dm.train_dataloader()
    share, plain = dm._train_sampler.padding()
    assert share <= 0.15 and plain < share
    net = PerformerLM(vocab_size=Tokenizer().vocab_size, dim=8, depth=1, heads=2,
                      attention=dict(kernel="softmax", nb_features=4, local_heads=1, local_window=8))
    net.compile(fullgraph=True, dynamic=False, backend="eager")
    dynamo.reset()
    counters.clear()
    torch._dynamo.config.recompile_limit, limit = 64, torch._dynamo.config.recompile_limit
    shapes, real, padded = set(), 0, 0
    try:
        with torch.no_grad():
            for loader, mode in ((train, True), (dm.val_dataloader(), False)):
                net.train(mode)
                for batch in loader:
                    rows, length = batch["inputs"].shape
                    assert length in dm.buckets and rows == max(8192 // length, 1)
                    shapes.add((mode, rows, length))
                    real += int((~batch["padding_mask"]).sum())
                    padded += rows * length
                    net(batch["inputs"], batch["padding_mask"])
    finally:
        torch._dynamo.config.recompile_limit = limit
    assert counters["stats"]["unique_graphs"] == len(shapes) <= 2 * len(dm.buckets)
    assert 1 - real / padded <= 0.15


def test_buckets_do_not_change_the_validation_loss():
    """The same proteins scored with and without buckets (float64): the same per-protein losses."""
    tok = Tokenizer()
    rng = np.random.default_rng(0)
    proteins = [torch.as_tensor(tok.encode("".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), n))))
                for n in (30, 70, 101)]
    net = small_model("default", False, dtype=torch.float64).eval()
    losses = []
    for buckets in (None, default_buckets(128)):
        batch = Collator(tok, "mlm", fixed_seed=0, buckets=buckets, max_tokens=512)(proteins)
        if buckets:
            assert tuple(batch["inputs"].shape) == bucket_shape(buckets, 103, 3, 512) == (4, 128)
        logits = net(batch["inputs"], batch["padding_mask"])
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=-100,
                                                 reduction="none").sum(1)
        losses.append(loss[:3])
        assert loss[3:].abs().sum() == 0  # a filler row is never scored
    assert losses[0].min() > 0
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-10)


@pytest.fixture(scope="module", params=[False, True], ids=["bidirectional", "causal"])
def compiled_pair(request):
    """(eager, compiled) default models: bidirectional in the default mode, causal in reduce-overhead
    (CUDA graphs on a GPU; on the CPU inductor's plain code, so the mode's trace path runs here)."""
    causal = request.param
    eager = small_model("default", causal)
    dynamo.reset()  # dynamo's cache of PerformerLM.forward is shared by every model instance of the session
    compiled = compile_model(copy.deepcopy(eager), torch.device("cpu"), "reduce-overhead" if causal else "default")
    return eager, compiled


def test_compiled_model_matches_eager(compiled_pair):
    eager, compiled = compiled_pair
    tokens, pad = padded_batch(2, 37)
    outs = []
    for m in (eager, compiled):
        m.zero_grad()
        logits = m(tokens, pad)
        logits[~pad].square().mean().backward()
        outs.append((logits.detach()[~pad], m.embed.weight.grad.clone(), m.blocks[0].attn.to_qkv.weight.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_compile_setting_is_auto_true_or_false(tmp_path, capsys, monkeypatch):
    """compile=auto compiles on CUDA only; anything else than auto / true / false is one line, exit 2."""
    from inprocess import run_main
    from protein_performer.training.compiled import use_compile

    def one_line(code, out, err):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in out + err, (code, err[-2000:])
        return lines[0]
    assert use_compile("auto", "cuda") and not use_compile("auto", "cpu")
    assert use_compile(True, "cpu") and not use_compile(False, "cuda")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "train", "hydra.run.dir=run", "compile=yes")
    assert code == 2 and one_line(code, out, err) == "error: compile=yes: compile is auto, true or false, not 'yes'"
    code, out, err = run_main(capsys, "train", "hydra.run.dir=run", "compile_mode=fastest")
    assert code == 2 and "compile_mode='fastest'" in one_line(code, out, err)
    assert list(tmp_path.iterdir()) == []

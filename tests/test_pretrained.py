"""Exported models (protein_performer.hub): the directory loads back without Lightning or
pickle to the checkpoint's own logits, for every kernel and both objectives; transformers opens
it (self-contained remote code) to the same logits; broken files are one-line errors naming
them; the model card reports only what was measured or recorded."""
import itertools
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from protein_performer.errors import UserError
from protein_performer.formats import read_records
from protein_performer.attention.feature_maps import REGISTRY
from protein_performer.hub.export import export
from protein_performer.hub.load import is_pretrained_dir, load_pretrained
from protein_performer.training.task import ProteinLM, load_checkpoint
from protein_performer.tokenizer import Tokenizer

from conftest import ROOT
from forkserver import forks

TOK = Tokenizer()
FREQS = [0.0] * 5 + [0.08, 0.01, 0.05, 0.07, 0.04, 0.07, 0.02, 0.06, 0.06, 0.1, 0.02, 0.04, 0.05, 0.04, 0.05,
                     0.07, 0.05, 0.07, 0.01, 0.04] + [0.0] * 5
KERNELS = tuple(REGISTRY)  # every kernel of the registry exports and loads
pytestmark = pytest.mark.filterwarnings("ignore:attention kernel 'trig'")


def real_proteins(n=4, max_residues=60):
    """The first held-out UniProtKB proteins, cut to a tiny model's size, of different lengths."""
    recs = itertools.islice(read_records(ROOT / "data/heldout/uniprotkb_mix_heldout_2k.fasta.gz"), n)
    return [r.sequence[:max_residues - 9 * i] for i, r in enumerate(recs)]


def batch(sequences):
    """Right-padded token ids (B, L) and the padding mask (True = padding)."""
    ids = [torch.as_tensor(TOK.encode(s), dtype=torch.long) for s in sequences]
    L = max(len(t) for t in ids)
    tokens = torch.full((len(ids), L), TOK.pad_id)
    for i, t in enumerate(ids):
        tokens[i, :len(t)] = t
    return tokens, tokens == TOK.pad_id


def make_checkpoint(run_dir, kernel="softmax", objective="mlm", position="rotary", step=37, model_settings=None,
                    **attention):
    """A tiny checkpoint whose weights are far from the initialization (so attention matters), whose
    projections are not the ones a fresh model draws (redrawn) and, for FAVOR++, with rho != 0."""
    model = dict(dim=32, depth=2, heads=2, ff_mult=2, dropout=0.1, position=position, max_positions=64,
                 attention={"kernel": kernel, "nb_features": 16, "chunk_size": 8,
                            "local_heads": 0, **attention},  # every head the kernel's unless a test asks
                 **(model_settings or {}))
    task = ProteinLM(model=model, objective=objective, aa_frequencies=FREQS)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in task.model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))  # (at 0.3 float32 round-off alone passes 1e-5)
        for block in task.model.blocks:
            block.attn.redraw_projection()
            if kernel == "favor++":
                block.attn.feature_map.rho.copy_(torch.tensor([0.7, 1.9]))
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, max_steps=0, accelerator="cpu")
    trainer.strategy.connect(task)
    path = Path(run_dir) / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    trainer.save_checkpoint(str(path))
    ckpt = torch.load(path, weights_only=False)
    ckpt["global_step"] = step  # as if trained for `step` steps
    torch.save(ckpt, path)
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(kernel, objective) -> (checkpoint path, exported directory), built once."""
    cache = {}

    def get(kernel, objective):
        if (kernel, objective) not in cache:
            tmp = tmp_path_factory.mktemp(f"{kernel.replace('+', 'p')}_{objective}")
            ckpt = make_checkpoint(tmp / "run", kernel, objective)
            cache[kernel, objective] = ckpt, export(ckpt, tmp / "export")
        return cache[kernel, objective]
    return get


def reference_logits(ckpt, tokens, pad):
    with torch.no_grad():
        return load_checkpoint(str(ckpt)).model(tokens, pad)


@pytest.mark.parametrize("objective", ["mlm", "clm"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_load_pretrained_gives_the_checkpoints_logits(exported, kernel, objective):
    ckpt, out = exported(kernel, objective)
    tokens, pad = batch(real_proteins())
    model, tok = load_pretrained(out)
    assert not model.training and model.causal == (objective == "clm") and tok == TOK
    with torch.no_grad():
        assert torch.equal(model(tokens, pad), reference_logits(ckpt, tokens, pad))
        one = tokens[:1, :int((~pad[0]).sum())]
        assert torch.equal(model(one), reference_logits(ckpt, one, None))


def test_learned_positions_and_relu_without_projection(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", "relu", "clm", position="learned", relu_projection=False)
    model, _ = load_pretrained(export(ckpt, tmp_path / "export"))
    tokens, pad = batch(real_proteins())
    with torch.no_grad():
        assert torch.equal(model(tokens, pad), reference_logits(ckpt, tokens, pad))


def test_config_json_holds_the_model_settings(exported):
    ckpt, out = exported("softmax", "mlm")
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "architectures", "auto_map", "objective", "vocab_size", "dim",
                                   "depth", "heads", "ff_mult", "dropout", "causal", "position",
                                   "max_positions", "tokenizer_version", "global_step")} == {
        "model_type": "protein_performer", "architectures": ["ProteinPerformerForMaskedLM"],
        "auto_map": {"AutoConfig": "configuration_protein_performer.ProteinPerformerConfig",
                     "AutoModel": "modeling_protein_performer.ProteinPerformerModel",
                     "AutoModelForMaskedLM": "modeling_protein_performer.ProteinPerformerForMaskedLM",
                     "AutoModelForCausalLM": "modeling_protein_performer.ProteinPerformerForCausalLM"},
        "objective": "mlm", "vocab_size": 30, "dim": 32, "depth": 2, "heads": 2, "ff_mult": 2, "dropout": 0.1,
        "causal": False, "position": "rotary", "max_positions": 64, "tokenizer_version": 1, "global_step": 37}
    # the settings given, and the defaults they relied on written out, with the config's version
    assert config["attention"] == {"kernel": "softmax", "nb_features": 16, "chunk_size": 8, "redraw_interval": 1000,
                                   "orthogonal": True, "relu_projection": True, "run_seed": 0, "local_heads": 0,
                                   "local_window": 128}
    assert config["config_version"] == 3 and config["rotary_base"] == 1e6
    assert config["aa_frequencies"] == FREQS
    assert (out / "vocab.txt").read_text().split() == list(TOK.tokens)
    assert is_pretrained_dir(out) and not is_pretrained_dir(ckpt) and not is_pretrained_dir(out.parent)
    clm = json.loads((exported("exact", "clm")[1] / "config.json").read_text())
    assert clm["architectures"] == ["ProteinPerformerForCausalLM"] and clm["auto_map"] == config["auto_map"]


def test_weights_are_plain_safetensors_with_the_buffers(exported):
    ckpt, out = exported("favor++", "mlm")
    raw = (out / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]  # the format: header length, JSON header, raw tensor bytes
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__")
    assert 8 + n + max(t["data_offsets"][1] for t in header.values()) == len(raw)
    ref = load_checkpoint(str(ckpt)).model.state_dict()
    expected = {k for k in ref if not k.endswith("_extra_state")}
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(header) == expected
    for k in expected:
        assert torch.equal(tensors[k], ref[k]), k
    # the redrawn projections and FAVOR++'s rho, not what a fresh model would have
    fresh = ProteinLM(model=load_checkpoint(str(ckpt)).hparams["model"]).model.state_dict()
    assert not torch.equal(tensors["blocks.0.attn.feature_map.projection"], fresh["blocks.0.attn.feature_map.projection"])
    assert tensors["blocks.1.attn.feature_map.rho"].tolist() == pytest.approx([0.7, 1.9])
    assert "head.weight" not in tensors  # tied: the head is the embedding
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # every other file is text; all readable alike (safetensors alone would write owner-only)
    for p in out.iterdir():
        if p.name != "model.safetensors":
            p.read_text(encoding="utf-8")
    assert len({p.stat().st_mode for p in out.iterdir()}) == 1


def test_loading_imports_no_lightning_and_unpickles_nothing(exported):
    ckpt, out = exported("softmax", "clm")
    tokens, pad = batch(real_proteins())
    torch.save(reference_logits(ckpt, tokens, pad), out.parent / "ref.pt")
    code = f"""
import pickle, sys, torch
def refuse(*a, **k): raise AssertionError("unpickling")
ref = torch.load({str(out.parent / 'ref.pt')!r})
torch.load = pickle.load = pickle.loads = refuse
pickle.Unpickler = refuse
from protein_performer.hub.load import load_pretrained
model, tok = load_pretrained({str(out)!r})
assert not [m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning', 'transformers')]
tokens = torch.tensor({tokens.tolist()})
assert torch.equal(model(tokens, tokens == 0), ref)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def broken_copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:3000]),
     r"model\.safetensors: not a readable safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x80\x04not safetensors"), r"model\.safetensors: not a readable"),
    (lambda d: (d / "model.safetensors").unlink(), r"model\.safetensors: no such file"),
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text()[:200]), r"config\.json: not valid JSON"),
    (lambda d: (d / "config.json").unlink(), r"config\.json: no such file"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), r"config\.json: expected a JSON object"),
    (lambda d: edit_config(d, heads=None), r"config\.json: missing key\(s\) heads"),
    (lambda d: edit_config(d, attention={"kernel": "cosine"}), r"config\.json: bad model settings .*cosine"),
    (lambda d: edit_config(d, attention={"nb_features": 16}), r"config\.json: missing key\(s\) attention\.kernel"),
    (lambda d: edit_config(d, heads=3), r"config\.json: bad model settings .*not divisible"),
    (lambda d: edit_config(d, tokenizer_version=2), r"config\.json: tokenizer version 2"),
    (lambda d: edit_config(d, dim=48), r"model\.safetensors: .* has shape .*config\.json's model needs"),
    (lambda d: edit_tensors(d, drop="blocks.1.attn.feature_map.projection"),
     r"model\.safetensors: missing tensor\(s\) blocks\.1\.attn\.feature_map\.projection"),
    (lambda d: edit_tensors(d, extra="head.weight"), r"model\.safetensors: unexpected tensor\(s\) head\.weight"),
    (lambda d: edit_tensors(d, resize="head_bias"), r"model\.safetensors: head_bias has shape \(31,\)"),
    (lambda d: (d / "vocab.txt").write_text("A\nB\n"), r"vocab\.txt: the vocabulary differs"),
])
def test_broken_directories_are_one_line_errors_naming_the_file(exported, tmp_path, damage, message):
    d = broken_copy(exported("softmax", "mlm")[1], tmp_path / "copy")
    damage(d)
    with pytest.raises(UserError, match=message) as e:
        load_pretrained(d)
    assert "\n" not in str(e.value) and str(d) in str(e.value)


def edit_config(d, **changes):
    config = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            del config[k]
        else:
            config[k] = v
    (d / "config.json").write_text(json.dumps(config))


def edit_tensors(d, drop=None, extra=None, resize=None):
    tensors = load_file(d / "model.safetensors")
    if drop:
        del tensors[drop]
    if extra:
        tensors[extra] = tensors["embed.weight"].clone()
    if resize:
        tensors[resize] = torch.zeros(tensors[resize].numel() + 1)
    save_file(tensors, d / "model.safetensors")


def visible(d):
    """Names in ``d`` but the lock files export keeps beside its outputs (one export per output)."""
    return sorted(p.name for p in d.iterdir() if not p.name.endswith(".export.lock"))


def test_export_refuses_existing_output_and_replaces_it_when_asked(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", "elu", "mlm")
    out = tmp_path / "shared"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"output .*shared: exists and is not empty \(overwrite=true"):
        export(ckpt, out)
    with pytest.raises(UserError, match=r"output .*shared: not a directory written by export"):
        export(ckpt, out, overwrite=True)  # overwrite replaces only an earlier export
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    export(ckpt, empty)  # an empty directory is fine
    weights = (empty / "model.safetensors").read_bytes()
    (empty / "model.safetensors").write_bytes(b"stale")
    export(ckpt, empty, overwrite=True)  # an earlier export is replaced whole
    assert (empty / "model.safetensors").read_bytes() == weights
    (empty / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"output .*empty: holds notes.txt, not written by export"):
        export(ckpt, empty, overwrite=True)
    assert (empty / "notes.txt").read_text() == "mine"
    assert visible(tmp_path) == ["empty", "run", "shared"]  # no temporary left


def test_a_failed_export_leaves_nothing_behind(tmp_path, monkeypatch):
    import protein_performer.hub.export as pretrained
    ckpt = make_checkpoint(tmp_path / "run", "elu", "mlm")

    def broken(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(pretrained, "model_card", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export(ckpt, tmp_path / "out")
    assert visible(tmp_path) == ["run"]


def test_export_checks_the_written_directory_against_the_checkpoint(tmp_path, monkeypatch):
    import protein_performer.hub.export as pretrained
    ckpt = make_checkpoint(tmp_path / "run", "softmax", "mlm")
    write = pretrained._write_weights

    def redrawn_projections(model, path):  # a writer bug: the projections a fresh model draws
        fresh = ProteinLM(model=load_checkpoint(str(ckpt)).hparams["model"]).model
        fresh.load_state_dict({**model.state_dict(),
                               **{k: v for k, v in fresh.state_dict().items() if "projection" in k}})
        write(fresh, path)
    monkeypatch.setattr(pretrained, "_write_weights", redrawn_projections)
    with pytest.raises(RuntimeError, match="does not reproduce the checkpoint's logits"):
        export(ckpt, tmp_path / "out")
    assert visible(tmp_path) == ["run"]


def test_the_cards_protein_performer_snippet_runs_as_written(exported):
    ckpt, out = exported("softmax", "mlm")
    card = (out / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0].replace("path/to/this/directory", str(out))
    scope = {}
    exec(snippet, scope)  # the top-level load_pretrained, the tokenizer's ids straight into the model
    ids = torch.as_tensor(TOK.encode("MKTAYIAKQR"), dtype=torch.long)[None]
    with torch.no_grad():
        ref = load_checkpoint(str(ckpt)).model
        assert torch.equal(scope["logits"], ref(ids)) and torch.equal(scope["hidden"], ref.encoder(ids))


def test_the_documented_transformers_snippets_run_with_stdin_closed(exported, transformers, tmp_path, monkeypatch):
    """docs/sharing.md's transformers code and the card's, as written, with stdin closed: the tokenizer
    loads without remote code (no "[y/N]" prompt, which would stop a user at a terminal) and the model
    gives the checkpoint's logits."""
    ckpt, out = exported("softmax", "mlm")
    prompts = []

    def closed_stdin(prompt=""):
        prompts.append(prompt)
        raise EOFError
    monkeypatch.setattr("builtins.input", closed_stdin)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(out, tmp_path / "my_model")
    docs = (ROOT / "docs" / "sharing.md").read_text().split("```python\n")
    sharing = next(b for b in docs if "from transformers" in b).split("```")[0]
    card = (out / "README.md").read_text().split("```python\n")[2].split("```")[0]
    ids = torch.as_tensor(TOK.encode("MKTAYIAKQR"), dtype=torch.long)[None]
    with torch.no_grad():
        ref = load_checkpoint(str(ckpt)).model(ids)
    for snippet in (sharing, card.replace("path/to/this/directory", "my_model")):
        scope = {}
        with torch.no_grad():
            exec(snippet, scope)
        torch.testing.assert_close(scope["logits"][:1, :ids.shape[1]], ref, atol=1e-5, rtol=0)
    assert prompts == []


def test_model_card_reports_recorded_and_measured_figures_only(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", "relu", "mlm", step=600)
    (tmp_path / "run" / "config.yaml").write_text(
        "data:\n  path: /somewhere/data/sample/swissprot_sample_20k.fasta.gz\n  max_len: 8192\n"
        "  max_tokens: 8192\noptim:\n  lr: 0.002\n  warmup_steps: 100\ntrainer:\n  precision: 32-true\n")
    card = (export(ckpt, tmp_path / "plain") / "README.md").read_text()
    n_params = sum(p.numel() for p in load_checkpoint(str(ckpt)).model.parameters())
    assert f"{n_params:,} parameters" in card and "`relu`" in card and "16 random features per head" in card
    assert "steps: 600 optimizer steps" in card and "swissprot_sample_20k.fasta.gz" in card
    assert "8,192 padded tokens" in card and "CC BY 4.0" in card
    assert "Not evaluated" in card and "perplexity |" not in card
    assert "optimizer: AdamW, peak learning rate 0.002, warm-up 100 steps" in card  # no optimizer key: AdamW (older runs)
    (tmp_path / "run" / "config.yaml").write_text("optim:\n  lr: 0.002\n  warmup_steps: 100\n  optimizer: muon\n")
    card = (export(ckpt, tmp_path / "muon") / "README.md").read_text()
    assert "optimizer: Muon on the hidden weight matrices, AdamW on the rest, peak learning rate 0.002" in card
    assert "AutoModelForMaskedLM" in card and "trust_remote_code=True" in card

    metrics = {"perplexity": 14.7127, "accuracy": 0.18973, "loss": 2.6887, "num_tokens": 143686,
               "num_sequences": 2000, "baseline_perplexity": 18.1296, "baseline_accuracy": 0.09671,
               "buckets": {"<=256": {"perplexity": 14.357, "accuracy": 0.1988, "num_sequences": 713,
                                     "baseline_perplexity": 18.185},
                           ">4096": {"perplexity": None, "accuracy": None, "num_sequences": 0}},
               "evaluation": {"objective": "mlm", "scored": "masked residues", "attention_kernel": "relu"},
               "step": 600, "data": "data/heldout/uniprotkb_mix_heldout_2k.fasta.gz"}
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    card = (export(ckpt, tmp_path / "evaluated", metrics=tmp_path / "metrics.json") / "README.md").read_text()
    assert "| perplexity | 14.713 | 18.130 |" in card and "| accuracy | 18.97 % | 9.67 % |" in card
    assert "| <=256 | 713 | 14.357 | 18.185 | 19.88 % |" in card and ">4096" not in card
    assert "143,686 scored tokens (masked residues)" in card and "Not evaluated" not in card

    for wrong, message in (({"step": 200}, "figures for step 200, this checkpoint is at step 600"),
                           ({"evaluation": {"objective": "clm"}}, "objective 'clm'"),
                           ({"checkpoints": {}}, "several checkpoints")):
        (tmp_path / "wrong.json").write_text(json.dumps({**metrics, **wrong}))
        with pytest.raises(UserError, match=message):
            export(ckpt, tmp_path / "wrong", metrics=tmp_path / "wrong.json")
    # without a run config: training data and its licence unknown, not guessed
    other = make_checkpoint(tmp_path / "other", "relu", "clm")
    card = (export(other, tmp_path / "unknown") / "README.md").read_text()
    assert "data: not recorded" in card and "licence" in card and "CC BY" not in card


def test_export_command_line(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", "exact", "clm")
    cmd = [sys.executable, str(ROOT / "scripts/export.py"), f"ckpt={ckpt}", f"output={tmp_path / 'out'}",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    r = forks().run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert is_pretrained_dir(tmp_path / "out") and str(tmp_path / "out") in r.stdout
    r = forks().run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: output {tmp_path / 'out'}: exists and is not empty (overwrite=true replaces it)"]


@pytest.mark.parametrize("objective", ["mlm", "clm"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_transformers_opens_the_directory_to_the_same_logits(exported, transformers, kernel, objective):
    ckpt, out = exported(kernel, objective)
    auto = transformers.AutoModelForMaskedLM if objective == "mlm" else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(out, trust_remote_code=True)
    assert not model.training
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    proteins = real_proteins()
    enc = tokenizer(proteins, return_tensors="pt", padding=True)
    tokens, pad = batch(proteins)
    assert torch.equal(enc["input_ids"], tokens) and torch.equal(enc["attention_mask"] == 0, pad)
    with torch.no_grad():
        got = model(**enc, output_hidden_states=True)
        ref, layers = load_checkpoint(str(ckpt)).model(tokens, pad, return_layers=True)
    real = ~pad
    # trig's normalizer is a sum of terms of both signs that can cancel to near zero (why the kernel is
    # unsafe): any change in summation order is amplified there (seen: 1.5e-5 relative), so relative 1e-4
    tol = dict(atol=1e-5, rtol=1e-4 if kernel == "trig" else 0)
    torch.testing.assert_close(got.logits[real], ref[real], **tol)
    assert len(got.hidden_states) == len(layers) == 3  # embedding, block 1, final norm after block 2
    for h, ref_h in zip(got.hidden_states, layers):
        torch.testing.assert_close(h[real], ref_h[real], **tol)
    # the backbone the heads sit on is where base_model_prefix says; AutoModel opens it alone
    assert model.base_model is getattr(model, model.base_model_prefix) is model.protein_performer
    base = transformers.AutoModel.from_pretrained(out, trust_remote_code=True)
    assert type(base).__name__ == "ProteinPerformerModel" and not base.training
    with torch.no_grad():
        hidden = base(**enc).last_hidden_state
        ref_hidden = load_checkpoint(str(ckpt)).model.encoder(tokens, pad)
    assert hidden.shape == (len(proteins), tokens.shape[1], 32)
    torch.testing.assert_close(hidden[real], ref_hidden[real], **tol)
    # the loss is the usual one over the labels
    labels = tokens.masked_fill(pad, -100)
    with torch.no_grad():
        loss, logits = model(**enc, labels=labels, return_dict=False)
    assert torch.equal(logits, got.logits)
    if objective == "clm":
        ref, labels = ref[:, :-1], labels[:, 1:]
    expected = torch.nn.functional.cross_entropy(ref.reshape(-1, 30), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, expected, **tol)


def test_a_rotary_base_reaches_the_export_and_transformers(tmp_path, transformers):
    """model.rotary_base travels into config.json and the transformers code rotates with it: the same
    logits as the checkpoint, which differ from those of the same weights rotated with base 10,000."""
    ckpt = make_checkpoint(tmp_path / "run", "softmax", "mlm", model_settings={"rotary_base": 300.0})
    out = export(ckpt, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["rotary_base"] == 300.0
    proteins = real_proteins()
    tokens, pad = batch(proteins)
    enc = transformers.AutoTokenizer.from_pretrained(out)(proteins, return_tensors="pt", padding=True)
    task = load_checkpoint(str(ckpt))
    with torch.no_grad():
        got = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)(**enc).logits
        ref = task.model(tokens, pad)
        default = ProteinLM(model={**task.model.config.to_dict(), "rotary_base": 10000.0}).model
        default.load_state_dict(task.model.state_dict())
        other = default.eval()(tokens, pad)
    real = ~pad
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
    assert (other[real] - ref[real]).abs().max() > 1e-2


def test_transformers_refuses_the_other_objective_in_one_line(exported, transformers):
    with pytest.raises(ValueError, match="this is a clm model: open it with AutoModelForCausalLM"):
        transformers.AutoModelForMaskedLM.from_pretrained(exported("softmax", "clm")[1], trust_remote_code=True)


def test_transformers_code_knows_every_registered_kernel():
    """The exported code is self-contained (no protein_performer import), so its kernel list is a copy:
    it must equal the registry's linear kernels."""
    import ast
    tree = ast.parse((ROOT / "protein_performer" / "hub" / "hf_code" / "modeling_protein_performer.py").read_text())
    listed = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", None) == "LINEAR_KERNELS")
    assert set(listed) == {k for k, spec in REGISTRY.items() if spec.build is not None}
    assert "exact" in REGISTRY and REGISTRY["exact"].build is None


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_local_heads_reach_the_export_and_transformers(tmp_path, transformers, objective):
    """attention.local_heads (exact attention in a window, the first heads) travels into config.json; the
    transformers code computes the checkpoint's logits, which differ from the same weights without the
    local head (so the window is what it computes, not a no-op)."""
    ckpt = make_checkpoint(tmp_path / "run", "softmax", objective, local_heads=1, local_window=5)
    out = export(ckpt, tmp_path / "export")
    attention = json.loads((out / "config.json").read_text())["attention"]
    assert (attention["local_heads"], attention["local_window"]) == (1, 5)
    assert "1 of 2 heads exact softmax within 5 positions" in (out / "README.md").read_text()
    proteins = real_proteins()
    tokens, pad = batch(proteins)
    enc = transformers.AutoTokenizer.from_pretrained(out)(proteins, return_tensors="pt", padding=True)
    auto = transformers.AutoModelForMaskedLM if objective == "mlm" else transformers.AutoModelForCausalLM
    task = load_checkpoint(str(ckpt))
    with torch.no_grad():
        got = auto.from_pretrained(out, trust_remote_code=True)(**enc).logits
        ref = task.model(tokens, pad)
        config = task.model.config.to_dict()
        plain = ProteinLM(model={**config, "attention": {**config["attention"], "local_heads": 0}},
                          objective=objective).model
        plain.load_state_dict(task.model.state_dict(), strict=False)
        other = plain.eval()(tokens, pad)
    real = ~pad
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
    assert (other[real] - ref[real]).abs().max() > 1e-2
    one = tokens[:1, :int(real[0].sum())]  # no attention mask: the blocks' tail beyond the protein is no key
    assert one.shape[1] % 5
    with torch.no_grad():
        alone = auto.from_pretrained(out, trust_remote_code=True)(input_ids=one).logits
        torch.testing.assert_close(alone, task.model(one), atol=1e-5, rtol=0)
    model, _ = load_pretrained(out)
    with torch.no_grad():
        assert torch.equal(model(tokens, pad), ref)

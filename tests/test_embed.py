"""Embedding: padding and batch composition do not leak, pooling matches a direct
computation, the HDF5 / .pt layouts, resume after an interruption, counted skips."""
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch

import protein_performer
from protein_performer import embed as E
from protein_performer.embed import settings
from protein_performer.embed.h5 import H5Output
from protein_performer.errors import UserError
from protein_performer.formats.tabular import sequence_id
from protein_performer.data.sampler import token_budget_batches
from protein_performer.device import precision_dtype
from protein_performer.hub.load import load_model
from protein_performer.formats.fasta import read_fasta
from protein_performer.training.task import ProteinLM

from conftest import ROOT, run_command, save_checkpoint
from forkserver import forks

FIX = Path(__file__).parent / "fixtures"
FASTA = FIX / "pyswrd_uniprot_sprot15.fasta"


def tiny(kernel="softmax", seed=0, **attn):
    torch.manual_seed(seed)
    m = ProteinLM(model=dict(dim=32, depth=2, heads=2, dropout=0.1,
                             attention=dict(kernel=kernel, nb_features=16, **attn)))
    return m.eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return Path(save_checkpoint(tiny(), tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"))


@pytest.fixture(scope="module")
def records():
    return [(r.id, r.sequence) for r in read_fasta(FASTA)]


def reference(model, seq, layer):
    """Independent reference: one unpadded forward pass, pooled by hand."""
    tok = torch.tensor(model.tokenizer.encode(seq), dtype=torch.long)[None]
    with torch.no_grad():
        _, hidden = model.model(tok, None, return_layers=True)
    h = hidden[layer][0].numpy()
    res = h[1:-1]
    return {"mean": res.mean(0), "max": res.max(0), "cls": h[0], "per_residue": res}


# --- padding / batch composition -------------------------------------------------------
@pytest.mark.parametrize("kernel", ["softmax", "favor++", "relu", "trig", "elu", "exact"])
def test_alone_equals_batched(kernel, records):
    model = tiny(kernel)
    seqs = dict(records[:8])  # 8 proteins of very different lengths -> much padding
    kw = dict(layers=[0, 1, -1], pooling=["mean", "cls", "max"], per_residue=True, long_alone=10**9)
    batched = E.embed_sequences(model, seqs, **kw)
    assert batched["ids"] == list(seqs)
    lengths = sorted(len(s) for s in seqs.values())
    assert lengths[0] * 3 < lengths[-1]
    for i, (rid, seq) in enumerate(seqs.items()):
        alone = E.embed_sequences(model, {rid: seq}, **kw)
        for layer in (0, 1, 2):
            for p in ("mean", "cls", "max"):
                np.testing.assert_allclose(batched[p][layer][i], alone[p][layer][0], atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(batched["per_residue"][rid][layer], alone["per_residue"][rid][layer],
                                       atol=1e-5, rtol=1e-5)


def test_batch_partners_do_not_matter(records):
    """The same protein batched with short, then with long partners (different padding)."""
    model = tiny("softmax")
    target = records[3]
    a = E.embed_sequences(model, [target] + records[:2], per_residue=True)
    b = E.embed_sequences(model, [target] + records[8:12], per_residue=True)
    np.testing.assert_allclose(a["mean"][0], b["mean"][0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(a["per_residue"][target[0]], b["per_residue"][target[0]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["softmax", "exact"])
def test_pooling_matches_direct_computation(kernel, records):
    model = tiny(kernel)
    seqs = dict(records[:5])
    out = E.embed_sequences(model, seqs, layers=[0, -1], pooling=["mean", "cls", "max"], per_residue=True,
                  max_tokens=4096)
    for i, (rid, seq) in enumerate(seqs.items()):
        for layer in (0, 2):
            ref = reference(model, seq, layer)
            for p in ("mean", "cls", "max"):
                np.testing.assert_allclose(out[p][layer][i], ref[p], atol=1e-5, rtol=1e-5)
            assert out["per_residue"][rid][layer].shape == (len(seq), 32)
            np.testing.assert_allclose(out["per_residue"][rid][layer], ref["per_residue"], atol=1e-5, rtol=1e-5)


def test_exact_long_proteins_run_alone_and_agree(records):
    model = tiny("exact")
    seqs = dict(records[:6])
    together = E.embed_sequences(model, seqs, long_alone=10**9)
    alone_path = E.embed_sequences(model, seqs, long_alone=50)  # everything above 50 tokens runs unpadded
    np.testing.assert_allclose(together["mean"], alone_path["mean"], atol=1e-5, rtol=1e-5)
    emb = E.Embedder(model.model, [2], ["mean"], kernel="exact")
    assert emb.long_alone == 1024
    assert E.Embedder(model.model, [2], ["mean"], kernel="softmax").long_alone is None


def test_token_budget_batches_hand_example():
    lengths = [5, 100, 30, 30, 8, 60]
    batches = token_budget_batches(lengths, 120)
    # longest first: [100] alone (100*2 > 120), then 60 (60*2=120 ok with 30), 30 (60*3>120)...
    assert batches == [[1], [5, 2], [3, 4, 0]]
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert token_budget_batches([500, 3], 100) == [[0], [1]]  # over-budget protein on its own


def test_layers_and_options():
    assert settings.resolve_layers(-1, 4) == [4]
    assert settings.resolve_layers([0, -2, 3, -1], 4) == [0, 3, 4]
    with pytest.raises(ValueError, match="layers 0..4"):
        settings.resolve_layers([5], 4)
    with pytest.raises(ValueError, match="pooling"):
        settings.resolve_pooling("sum")
    with pytest.raises(ValueError, match="precision"):
        precision_dtype("8")


def test_package_level_function_and_cheap_import(records):
    model = tiny()
    out = protein_performer.embed_sequences(model, [records[0][1]])
    assert out["mean"].shape == (1, 32) and out["mean"].dtype == np.float32
    np.testing.assert_allclose(out["mean"][0], reference(model, records[0][1], 2)["mean"], atol=1e-5, rtol=1e-5)
    r = subprocess.run([sys.executable, "-c", "import sys, protein_performer; print('torch' in sys.modules)"],
                       capture_output=True, text=True)
    assert r.stdout.strip() == "False"


def test_bf16_close_to_fp32(records):
    model = tiny()
    a = E.embed_sequences(model, records[:3])["mean"]
    b = E.embed_sequences(model, records[:3], precision="bf16")["mean"]
    assert b.dtype == np.float32
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


# --- files -----------------------------------------------------------------------------
def test_h5_and_pt_layout(ckpt, records, tmp_path):
    out, pt = tmp_path / "e.h5", tmp_path / "pt"
    s = E.embed_file(ckpt, FASTA, out, pt, layers=[-1], pooling=["mean", "cls"], per_residue=True, progress=False)
    assert s["embedded"] == len(records) and s["residues"] == sum(len(q) for _, q in records)
    model = load_model(str(ckpt)).net
    wrapped = ProteinLM.load_from_checkpoint(str(ckpt)).eval()
    with h5py.File(out) as f:
        assert [x.decode() for x in f["ids"][:]] == [r for r, _ in records]  # input order
        assert f["mean"].shape == (len(records), 32) and f["mean"].dtype == np.float32
        assert f["cls"].shape == (len(records), 32)
        for i, (rid, seq) in enumerate(records):
            ref = reference(wrapped, seq, 2)
            np.testing.assert_allclose(f["mean"][i], ref["mean"], atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(f["per_residue"][rid][:], ref["per_residue"], atol=1e-5, rtol=1e-5)
            assert f["per_residue"][rid].shape == (len(seq), 32)
    assert not (tmp_path / "e.h5.partial").exists()
    # ESM-compatible files
    assert len(list(pt.glob("*.pt"))) == len(records)
    rid, seq = records[4]
    obj = torch.load(pt / f"{rid}.pt")
    assert obj["label"] == rid and set(obj) == {"label", "mean_representations", "bos_representations",
                                                "representations"}
    assert obj["representations"][2].shape == (len(seq), 32)
    with h5py.File(out) as f:
        np.testing.assert_array_equal(obj["mean_representations"][2].numpy(), f["mean"][4])
    assert model.depth == 2


def test_h5_several_layers(ckpt, records, tmp_path):
    out = tmp_path / "e.h5"
    E.embed_file(ckpt, FASTA, out, layers=[0, -1], per_residue=True, progress=False)
    with h5py.File(out) as f:
        assert sorted(f["mean"].keys()) == ["0", "2"]
        assert f["mean/0"].shape == f["mean/2"].shape == (len(records), 32)
        rid, seq = records[0]
        assert f[f"per_residue/0/{rid}"].shape == (len(seq), 32)
        assert not np.allclose(f["mean/0"][:], f["mean/2"][:])


def _write_fasta(path, recs):
    path.write_text("".join(f">{r} some description\n{s[:60]}\n{s[60:]}\n" for r, s in recs))


def h5_contents(path):
    """Every dataset and attribute of an HDF5 file, for exact comparison."""
    out = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        attrs = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.attrs.items()}
    return out, attrs


def assert_same_file(a, b):
    (da, aa), (db, ab) = h5_contents(a), h5_contents(b)
    assert sorted(da) == sorted(db)
    for k in da:
        np.testing.assert_array_equal(da[k], db[k], err_msg=k)  # bitwise: the same batches ran
    assert aa == ab


def leftovers(tmp_path):
    return sorted(p.name for p in tmp_path.rglob("*") if ".partial" in p.name or p.name.startswith("."))


def test_kill_after_k_batches_then_resume_gives_the_clean_file(ckpt, records, tmp_path, monkeypatch):
    fasta = tmp_path / "in.fasta"
    _write_fasta(fasta, records)
    kw = dict(per_residue=True, pooling=["mean", "max"], progress=False, max_tokens=1200, sort_records=7)
    clean = E.embed_file(ckpt, fasta, tmp_path / "clean.h5", **kw)
    assert clean["embedded"] == len(records) and clean["already_done"] == 0

    calls = {"n": 0}
    orig = E.Embedder.forward

    def dying(self, batch, pad_id):  # the process "dies" in its fourth batch
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return orig(self, batch, pad_id)

    monkeypatch.setattr(E.Embedder, "forward", dying)
    out = tmp_path / "out.h5"
    with pytest.raises(KeyboardInterrupt):
        E.embed_file(ckpt, fasta, out, **kw)
    assert not out.exists()
    saved = sorted((tmp_path / "out.h5.partial").glob("batch-*.npz"))
    assert len(saved) == 3  # every finished batch was kept
    n_saved = sum(len(np.load(p)["index"]) for p in saved)
    monkeypatch.setattr(E.Embedder, "forward", orig)
    s = E.embed_file(ckpt, fasta, out, **kw)
    assert s["already_done"] == n_saved and s["embedded"] == len(records) - n_saved
    assert_same_file(out, tmp_path / "clean.h5")
    with h5py.File(out) as f:
        assert [x.decode() for x in f["ids"][:]] == [r for r, _ in records]  # input order
        assert f.attrs["complete"]
    assert leftovers(tmp_path) == []
    # the same command again: nothing to do, file untouched
    before = out.stat().st_mtime_ns
    s = E.embed_file(ckpt, fasta, out, **kw)
    assert s["embedded"] == 0 and s["already_done"] == len(records) and out.stat().st_mtime_ns == before


def test_resume_refuses_another_checkpoint_input_or_settings(ckpt, records, tmp_path):
    fasta = tmp_path / "in.fasta"
    _write_fasta(fasta, records[:6])
    out = tmp_path / "e.h5"
    E.embed_file(ckpt, fasta, out, progress=False)
    first = h5_contents(out)
    other_ckpt = tmp_path / "other.ckpt"
    trainer = pl.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(tiny(seed=1))
    trainer.save_checkpoint(other_ckpt)
    with pytest.raises(UserError, match=r"e\.h5 was written with a different checkpoint \(weights sha256\) "
                                          r"\w{12}\.\.\. \(now \w{12}\.\.\.\): write to a new output path, "
                                          r"or pass overwrite=true"):
        E.embed_file(other_ckpt, fasta, out, progress=False)
    other_input = tmp_path / "other.fasta"
    _write_fasta(other_input, records[6:9])
    with pytest.raises(UserError, match=r"different input \(file sha256\)"):
        E.embed_file(ckpt, other_input, out, progress=False)
    with pytest.raises(UserError, match=r"different layers \[2\] \(now \[0\]\)"):
        E.embed_file(ckpt, fasta, out, layers=[0], progress=False)
    with pytest.raises(UserError, match=r"different precision float32 \(now bfloat16\)"):
        E.embed_file(ckpt, fasta, out, precision="bf16", progress=False)
    after = h5_contents(out)
    np.testing.assert_array_equal(first[0]["mean"], after[0]["mean"])  # refused: nothing changed
    # the same weights from another path resume (nothing to do); another model with overwrite=true replaces
    copy = tmp_path / "copy.ckpt"
    copy.write_bytes(Path(ckpt).read_bytes())
    assert E.embed_file(copy, fasta, out, progress=False)["embedded"] == 0
    from protein_performer.hub.export import export  # ... or from its exported directory
    exported = export(ckpt, tmp_path / "exported")
    assert E.embed_file(exported, fasta, out, progress=False)["already_done"] == 6
    s = E.embed_file(other_ckpt, other_input, out, overwrite=True, progress=False)
    assert s["embedded"] == 3
    expected = E.embed_sequences(str(other_ckpt), str(other_input))
    with h5py.File(out) as f:
        assert [x.decode() for x in f["ids"][:]] == expected["ids"]
        np.testing.assert_allclose(f["mean"][:], expected["mean"], atol=1e-5, rtol=1e-5)
        assert f.attrs["input"] == str(other_input)


def test_interrupted_run_of_another_identity_is_refused(ckpt, records, tmp_path, monkeypatch):
    fasta = tmp_path / "in.fasta"
    _write_fasta(fasta, records)
    out = tmp_path / "e.h5"
    orig = H5Output.write_batch
    calls = {"n": 0}

    def dying(self, index, results):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        orig(self, index, results)

    monkeypatch.setattr(H5Output, "write_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        E.embed_file(ckpt, fasta, out, max_tokens=2000, progress=False)
    monkeypatch.setattr(H5Output, "write_batch", orig)
    with pytest.raises(UserError, match=r"e\.h5\.partial \(left by an interrupted run\) was written with a "
                                          r"different pooling \['mean'\] \(now \['max'\]\)"):
        E.embed_file(ckpt, fasta, out, pooling="max", progress=False)
    E.embed_file(ckpt, fasta, out, pooling="max", overwrite=True, progress=False)
    with h5py.File(out) as f:
        assert sorted(f) == ["ids", "max"]


def test_causal_model_refuses_cls_pooling(tmp_path, records):
    torch.manual_seed(0)
    clm = ProteinLM(model=dict(dim=32, depth=2, heads=2, attention=dict(kernel="softmax", nb_features=16)),
                    objective="clm").eval()
    with pytest.raises(UserError, match=r"pooling=cls: ProteinLM is a causal \(clm\) model"):
        E.embed_sequences(clm, records[:3], pooling=["mean", "cls"])
    out = E.embed_sequences(clm, records[:3], pooling=["mean", "max"])  # the reason: what cls would give
    assert not np.allclose(out["mean"][0], out["mean"][1])
    _, hidden = clm.model(torch.tensor(np.stack([clm.tokenizer.encode(s)[:5] for _, s in records[:3]]).astype(np.int64)),
                          return_layers=True)
    np.testing.assert_allclose(hidden[-1][0, 0].detach(), hidden[-1][1, 0].detach(), atol=1e-6)


def test_resume_pt_dir(ckpt, records, tmp_path):
    fasta = tmp_path / "in.fasta"
    _write_fasta(fasta, records)
    pt = tmp_path / "pt"
    E.embed_file(ckpt, fasta, pt_dir=pt, progress=False)
    for p in sorted(pt.glob("*.pt"))[:5]:  # as if killed before these were written
        p.unlink()
    s = E.embed_file(ckpt, fasta, pt_dir=pt, progress=False)
    assert s["embedded"] >= 5 and s["embedded"] + s["already_done"] == len(records)
    assert len(list(pt.glob("*.pt"))) == len(records)
    assert not list(pt.glob(".*tmp"))
    with pytest.raises(UserError, match=r"pt_dir .*pt was written with a different layers"):
        E.embed_file(ckpt, fasta, pt_dir=pt, layers=[0], progress=False)


def test_duplicates_invalid_and_empty_are_counted(ckpt, tmp_path, caplog):
    fasta = tmp_path / "bad.fasta"
    fasta.write_text(">a\nMKTAYIAK\n>b\nMKJAYIAK\n>a\nMKTAYIAK\n>c\n>d/1-5\nACDEF\n>a\nMKV\n")
    caplog.set_level("WARNING")
    out = tmp_path / "e.h5"
    s = E.embed_file(ckpt, fasta, out, per_residue=True, progress=False)
    assert (s["embedded"], s["duplicate"], s["invalid"], s["empty"]) == (2, 1, 2, 1)
    text = caplog.text
    assert f"{fasta}:5: record 'a' repeats the id and sequence first seen at {fasta}:1" in text
    assert f"{fasta}:10: record 'a' repeats the id first seen at {fasta}:1 with a different sequence" in text
    assert f"{fasta}:3" in text and "'J'" in text
    with h5py.File(out) as f:
        assert [x.decode() for x in f["ids"][:]] == ["a", "d/1-5"]
        assert f["per_residue/d%2F1-5"].shape == (5, 32)  # '/' escaped in member names
    with pytest.raises(Exception, match=r"bad.fasta:3.*'b'.*'J'.*set unknown=X"):
        E.embed_file(ckpt, fasta, tmp_path / "f.h5", on_invalid="error", progress=False)
    assert not (tmp_path / "f.h5").exists()
    s = E.embed_file(ckpt, fasta, tmp_path / "g.h5", unknown="X", progress=False)
    assert s["invalid"] == 1 and s["embedded"] == 3


def test_nothing_to_embed_is_an_error_and_writes_nothing(ckpt, tmp_path):
    empty = tmp_path / "empty.fasta"
    empty.write_text("")
    with pytest.raises(UserError, match=r"empty\.fasta: is empty"):
        E.embed_file(ckpt, empty, tmp_path / "e.h5", pt_dir=tmp_path / "pt", progress=False)
    bad = tmp_path / "bad.fasta"
    bad.write_text(">a\nMKJ\n>b\n>c\nMK1\n")
    with pytest.raises(UserError, match=r"bad\.fasta: no sequences to embed \(skipped: 1 empty, 2 invalid\)"):
        E.embed_file(ckpt, bad, tmp_path / "e.h5", pt_dir=tmp_path / "pt", progress=False)
    with pytest.raises(UserError, match="nothing to embed"):
        E.embed_sequences(tiny(), [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.fasta", "empty.fasta"]


def test_csv_and_gzipped_dat_inputs(ckpt, tmp_path):
    csv_path = tmp_path / "l.csv"
    csv_path.write_text("label,seq\n1,MKTAYIAKQR\n0,ACDEFGHIK\n")
    out = E.embed_sequences(str(ckpt), str(csv_path))
    assert out["ids"] == [sequence_id("MKTAYIAKQR"), sequence_id("acdefghik")]
    dat = tmp_path / "x.dat.gz"
    with gzip.open(dat, "wb") as fh:
        fh.write((FIX / "emboss_trembl_9records_2012.dat").read_bytes())
    s = E.embed_file(ckpt, dat, tmp_path / "d.h5", progress=False)
    assert s["embedded"] == 9


def test_cli(ckpt, records, tmp_path):
    out = tmp_path / "cli.h5"
    r = forks().run([sys.executable, str(ROOT / "scripts" / "embed.py"), f"ckpt={ckpt}", f"input={FASTA}",
                     f"output={out}", "layers=[0,-1]", "pooling=[mean,max]", "progress=false"],
                    capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "WANDB_MODE": "disabled"})
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["embedded"] == len(records)
    with h5py.File(out) as f:
        assert sorted(f) == ["ids", "max", "mean"] and sorted(f["max"]) == ["0", "2"]
    assert not list(tmp_path.glob("outputs")) and not list(tmp_path.glob("*.log"))


def run_script(name, capsys, *overrides):
    """``protein-performer <name>`` in this process: (exit status, stderr)."""
    code, _, err = run_command(name, capsys, *overrides)
    return code, err

def test_cli_errors_are_one_line_and_leave_nothing(ckpt, tmp_path, capsys):
    import random
    ok = tmp_path / "ok.fasta"
    ok.write_text(">a\nMKTAYIAKQR\n")
    rng = random.Random(0)
    text = "".join(f">p{i}\n" + "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(300)) + "\n"
                   for i in range(200))
    z = gzip.compress(text.encode())
    (tmp_path / "cut.fasta.gz").write_bytes(z[: len(z) // 2])
    (tmp_path / "bin.fasta").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "image").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (tmp_path / "junk.ckpt").write_text("not a checkpoint\n")
    (tmp_path / "notes.txt").write_text("keep me\n")
    (tmp_path / "adir").mkdir()
    out = tmp_path / "o.h5"
    cases = [  # (overrides, the line's pattern)
        ([f"input={tmp_path / 'nope.fasta'}"], r"nope\.fasta: no such file"),
        ([f"input={tmp_path / 'adir'}"], r"adir: is a directory"),
        ([f"input={tmp_path / 'cut.fasta.gz'}"], r"cut\.fasta\.gz:\d+: truncated or corrupt gzip data"),
        ([f"input={tmp_path / 'bin.fasta'}"], r"bin\.fasta: is a binary file, not FASTA or UniProt text"),
        ([f"input={tmp_path / 'image'}"], r"image: is a binary file, not FASTA or UniProt text"),
        ([f"ckpt={tmp_path / 'junk.ckpt'}"], r"checkpoint .*junk\.ckpt: cannot load \("),
        ([f"ckpt={tmp_path / 'missing.ckpt'}"], r"checkpoint .*missing\.ckpt: no such file"),
        ([f"output={tmp_path / 'notes.txt'}"], r"output .*notes\.txt: exists and is not an HDF5 file"),
        ([f"output={tmp_path / 'adir'}"], r"output=.*adir: is a directory"),
    ]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for overrides, pattern in cases:
        args = {"ckpt": f"ckpt={ckpt}", "input": f"input={ok}", "output": f"output={out}"}
        for o in overrides:
            args[o.split("=")[0]] = o
        code, err = run_script("embed", capsys, *args.values(), "progress=false")
        assert code == 2, (overrides, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (overrides, err)
        assert re.search(pattern, lines[0]), (pattern, lines[0])
        assert sorted(p.name for p in tmp_path.rglob("*")) == before, overrides  # nothing written
    assert (tmp_path / "notes.txt").read_text() == "keep me\n"
    # no arguments at all: the first missing key named is ckpt
    code, err = run_script("embed", capsys)
    assert code == 2 and err.startswith("error: ckpt is required")


def test_cli_no_arguments_and_help():
    r = forks().run([sys.executable, str(ROOT / "scripts" / "embed.py")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: ckpt is required: python scripts/embed.py ckpt=CHECKPOINT input=FILE output=OUT.h5 "
        "(--help lists every key)"]
    r = forks().run([sys.executable, str(ROOT / "scripts" / "embed.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("Embed proteins with a trained model")
    for key in ("ckpt", "input", "output", "pt_dir", "overwrite", "layers", "pooling", "max_tokens", "on_invalid"):
        assert f"\n  {key} " in r.stdout, key


def test_bom_input_and_the_character_in_errors(ckpt, tmp_path):
    p = tmp_path / "bom.csv"
    p.write_bytes("\ufeffid,seq\nA,MKTAYIAKQR\nB,MKé\n".encode())
    with pytest.raises(UserError, match=r"bom\.csv:3: record 'B': invalid residue 'é' at position 3"):
        E.embed_file(ckpt, p, tmp_path / "e.h5", on_invalid="error", progress=False)
    s = E.embed_file(ckpt, p, tmp_path / "e.h5", progress=False)
    assert (s["embedded"], s["invalid"]) == (1, 1)
    with h5py.File(tmp_path / "e.h5") as f:
        assert [x.decode() for x in f["ids"][:]] == ["A"]

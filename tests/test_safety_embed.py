"""embed never mixes, loses or runs a file: kill -9 at seeded points and resume (another
max_tokens / sort_records included) gives the clean run's files; one writer per output; the
model's config is part of its identity; NaN refused naming the protein; every setting, id and
path checked before work; ``overwrite`` removes only what embed recorded writing; no pickle
(checkpoint or journal batch) is ever run."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from protein_performer import embed as E
from protein_performer.embed.h5 import H5Output
from protein_performer.embed.identity import lock_path
from protein_performer.embed.pt_dir import PtOutput
from protein_performer.errors import UserError
from protein_performer.files import file_sha256
from protein_performer.hub.load import load_model, weights_sha256
from protein_performer.hub.export import export

from conftest import save_checkpoint
from forkserver import forks
from test_embed import h5_contents, run_script, tiny

AA = "ACDEFGHIKLMNPQRSTVWY"


#: float32 outputs of one protein embedded in batches of other lengths (the local head's blocks follow
#: the batch's padded length, and SDPA's blocked softmax rounds with them): a few 1e-6 on values near 1
FLOAT_ROUNDING = 1e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return Path(save_checkpoint(tiny(), tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"))


def proteins(n=36, seed=0, alphabet=AA.replace("W", "")):
    rng = random.Random(seed)
    return [(f"p{i:02d}", "".join(rng.choice(alphabet) for _ in range(rng.randint(15, 110)))) for i in range(n)]


def write_fasta(path, recs):
    path.write_text("".join(f">{r}\n{s}\n" for r, s in recs))
    return path


def checksums(folder, skip=()):
    return {str(p.relative_to(folder)): file_sha256(p) for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and p.name not in skip}


def one_line(code, err, pattern):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(pattern, lines[0]), (pattern, lines[0])


# --- kill -9 at seeded points, then resume ---------------------------------------------------
CHILD = r"""
import json, os, signal, sys
from pathlib import Path
import torch
from protein_performer import embed as E
from protein_performer.embed.h5 import H5Output
where, n, kw = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
calls = [0]
def kill_at_nth(f):
    def g(*a, **k):
        r = f(*a, **k)
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return r
    return g
if where == "batch":    # after the n-th journal batch is saved, before its .pt files
    H5Output.write_batch = kill_at_nth(H5Output.write_batch)
elif where == "pt":     # the n-th .pt file written to its temporary name, not yet renamed
    torch.save = kill_at_nth(torch.save)
elif where == "finish":  # the HDF5 file assembled in the journal, not yet renamed into place
    real, out = os.replace, Path(kw["output"]).resolve()
    os.replace = lambda a, b: (Path(b).resolve() == out and os.kill(os.getpid(), signal.SIGKILL), real(a, b))[1]
E.embed_file(**kw)
print("finished without being killed")
"""


def test_kill_9_at_seeded_points_then_resume_gives_the_clean_files(ckpt, tmp_path):
    rng = random.Random(17)
    inp = write_fasta(tmp_path / "in.fasta", proteins())
    clean, work = tmp_path / "clean", tmp_path / "work"
    (work / "pt").mkdir(parents=True)
    for name, text in {"notes.txt": "mine\n", "config.yaml": "a: 1\n", "train.log": "log\n",
                       "pt/mine.pt": "not a tensor\n", "pt/notes.txt": "keep\n"}.items():
        (work / name).write_text(text)
    before = {**checksums(work), "in": file_sha256(inp), "ckpt": file_sha256(ckpt)}

    def kw(folder, max_tokens=600, sort_records=12):
        return dict(ckpt=str(ckpt), input=str(inp), output=str(folder / "e.h5"), pt_dir=str(folder / "pt"),
                    layers=[0, -1], pooling=["mean", "max"], per_residue=True, max_tokens=max_tokens,
                    sort_records=sort_records, progress=False)

    s = E.embed_file(**kw(clean))
    assert s["embedded"] == 36
    n_batches = len(E.Embedder(tiny().model, [2], ["mean"]).batches([len(q) + 2 for _, q in proteins()[:12]], 600))

    def killed(where, n, **settings):
        r = forks().run([sys.executable, "-c", CHILD, where, str(n), json.dumps(kw(work, **settings))],
                        capture_output=True, text=True, cwd=tmp_path)  # a child process, its imports done
        assert r.returncode == -signal.SIGKILL, (where, n, r.stdout, r.stderr[-3000:])

    k = rng.randint(1, n_batches - 1)
    killed("batch", k)
    assert not (work / "e.h5").exists()
    assert len(list((work / "e.h5.partial").glob("batch-*.npz"))) == k
    assert len(list((work / "pt").glob("p*.pt"))) < 36
    # another max_tokens and sort_records: killed while writing a .pt file (it stays half-written)
    killed("pt", rng.randint(2, 8), max_tokens=250, sort_records=7)
    killed("finish", 1)
    assert (work / "e.h5.partial" / "assembled.h5").is_file() and not (work / "e.h5").exists()
    s = E.embed_file(**kw(work))
    assert s["embedded"] == 0 and s["already_done"] == 36  # finish had nothing left to embed

    # the same HDF5 contents as the clean run: every protein once, nothing from two batchings mixed
    (dc, ac), (dw, aw) = h5_contents(clean / "e.h5"), h5_contents(work / "e.h5")
    assert sorted(dw) == sorted(dc) and len([k for k in dw if k.startswith("per_residue/2/")]) == 36
    assert aw == ac
    for key in dc:
        assert dw[key].dtype == dc[key].dtype and dw[key].shape == dc[key].shape, key
        if dc[key].dtype.kind == "f":  # only float rounding may depend on the batches of another max_tokens
            # (float32; the local head's block follows the batch's padded length: ~1e-6 relative)
            np.testing.assert_allclose(dw[key], dc[key], rtol=0, atol=FLOAT_ROUNDING, err_msg=key)
        else:
            np.testing.assert_array_equal(dw[key], dc[key], err_msg=key)
    # ... the same .pt files, and the same bookkeeping
    names = sorted(p.name for p in (clean / "pt").iterdir())
    assert sorted(p.name for p in (work / "pt").iterdir() if p.name not in ("mine.pt", "notes.txt")) == names
    assert ".protein-performer-tmp" not in names and len([n for n in names if n.endswith(".pt")]) == 36
    for name in (n for n in names if n.endswith(".pt")):
        a, b = (torch.load(f / "pt" / name, weights_only=True) for f in (clean, work))
        assert a["label"] == b["label"] == name[:-3] and sorted(a) == sorted(b)
        for key in sorted(set(a) - {"label"}):
            assert sorted(a[key]) == sorted(b[key]) == [0, 2]
            for layer in a[key]:
                torch.testing.assert_close(b[key][layer], a[key][layer], rtol=0, atol=FLOAT_ROUNDING)
    journal = {f: json.loads((f / "pt" / ".protein-performer-written.json").read_text()) for f in (clean, work)}
    assert sorted(journal[clean]["written"]) == sorted(journal[work]["written"])
    # nothing else in the folder touched, nothing left over
    assert sorted(p.name for p in work.iterdir()) == sorted(["e.h5", "e.h5.lock", "pt", "notes.txt", "config.yaml",
                                                             "train.log"])
    after = {**checksums(work), "in": file_sha256(inp), "ckpt": file_sha256(ckpt)}
    assert {k: v for k, v in after.items() if k in before} == before


def test_interrupted_per_residue_run_resumes_with_other_batches(ckpt, tmp_path, monkeypatch):
    """The old journal was keyed by batch: resuming with other batches stored proteins twice and
    every later per_residue run crashed in h5py. Now each protein is saved (and taken) once."""
    inp = write_fasta(tmp_path / "in.fasta", proteins(20, seed=3))
    kw = dict(per_residue=True, progress=False)
    ref = E.embed_sequences(str(ckpt), str(inp), per_residue=True)
    orig, calls = H5Output.write_batch, {"n": 0}

    def dying(self, index, results):
        orig(self, index, results)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(H5Output, "write_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        E.embed_file(ckpt, inp, tmp_path / "e.h5", max_tokens=300, sort_records=20, **kw)
    saved = [np.load(p, allow_pickle=False)["index"] for p in sorted((tmp_path / "e.h5.partial").glob("*.npz"))]
    n_saved = sum(len(i) for i in saved)
    calls["n"] = -10**9
    s = E.embed_file(ckpt, inp, tmp_path / "e.h5", max_tokens=1000, sort_records=6, **kw)
    assert s["already_done"] == n_saved and s["embedded"] == 20 - n_saved
    with h5py.File(tmp_path / "e.h5") as f:
        assert [x.decode() for x in f["ids"][:]] == ref["ids"] and sorted(f["per_residue"]) == sorted(ref["ids"])
        np.testing.assert_allclose(f["mean"][:], ref["mean"], rtol=0, atol=FLOAT_ROUNDING)
        for rid in ref["ids"]:
            np.testing.assert_allclose(f["per_residue"][rid][:], ref["per_residue"][rid], rtol=0, atol=FLOAT_ROUNDING)
    # later runs are fine: nothing to do, and a new output next to it works
    assert E.embed_file(ckpt, inp, tmp_path / "e.h5", **kw)["already_done"] == 20
    assert E.embed_file(ckpt, inp, tmp_path / "f.h5", **kw)["embedded"] == 20


# --- one writer, one model ---------------------------------------------------------------------
HOLD = ("import sys, time; from protein_performer import files\n"
        "with files.exclusive_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n")


@pytest.mark.parametrize("target", ["output", "pt_dir"])
def test_second_writer_of_one_output_gets_one_line(ckpt, tmp_path, capsys, target):
    inp = write_fasta(tmp_path / "in.fasta", proteins(4))
    out, pt = tmp_path / "e.h5", tmp_path / "pt"
    lock = lock_path(out) if target == "output" else pt / PtOutput.LOCK
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err = run_script("embed", capsys, f"ckpt={ckpt}", f"input={inp}", f"{target}={out if target == 'output' else pt}",
                               "progress=false")
        one_line(code, err, rf"{target} .*: another process is writing it now")
        assert not out.exists() and not (tmp_path / "e.h5.partial").exists() and not list(pt.glob("*.pt"))
    finally:
        holder.kill()
        holder.wait()
    code, _ = run_script("embed", capsys, f"ckpt={ckpt}", f"input={inp}", f"output={out}", f"pt_dir={pt}",
                         "progress=false")
    assert code == 0 and len(list(pt.glob("*.pt"))) == 4


def edited_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key == "kernel":
            cfg["attention"]["kernel"] = value
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_identity_covers_the_model_config_not_only_the_weights(ckpt, tmp_path, monkeypatch):
    inp = write_fasta(tmp_path / "in.fasta", proteins(8))
    exported = export(ckpt, tmp_path / "exported")
    relu = edited_copy(exported, tmp_path / "relu", kernel="relu")
    clm = edited_copy(exported, tmp_path / "clm", objective="clm")
    same = weights_sha256(load_model(str(exported)).net)
    assert weights_sha256(load_model(str(relu)).net) == weights_sha256(load_model(str(clm)).net) == same
    out = tmp_path / "e.h5"
    E.embed_file(exported, inp, out, progress=False)
    first = file_sha256(out)
    with pytest.raises(UserError, match=r"e\.h5 was written with a different model config attention\.kernel "
                                          r"softmax \(now relu\): write to a new output path"):
        E.embed_file(relu, inp, out, progress=False)
    with pytest.raises(UserError, match=r"different model config causal False \(now True\)"):
        E.embed_file(clm, inp, out, progress=False)
    assert file_sha256(out) == first
    # ... an interrupted run's journal too
    monkeypatch.setattr(H5Output, "finish", lambda self, ids: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        E.embed_file(exported, inp, tmp_path / "g.h5", progress=False)
    with pytest.raises(UserError, match=r"g\.h5\.partial \(left by an interrupted run\) was written with a "
                                          r"different model config attention\.kernel softmax \(now relu\)"):
        E.embed_file(relu, inp, tmp_path / "g.h5", progress=False)
    monkeypatch.undo()
    s = E.embed_file(relu, inp, tmp_path / "g.h5", overwrite=True, progress=False)
    expected = E.embed_sequences(str(relu), str(inp))
    assert s["embedded"] == 8
    with h5py.File(tmp_path / "g.h5") as f, h5py.File(out) as old:
        assert json.loads(f.attrs["model_config"])["attention"]["kernel"] == "relu"
        np.testing.assert_allclose(f["mean"][:], expected["mean"], rtol=0, atol=1e-6)
        assert not np.allclose(f["mean"][:], old["mean"][:], atol=1e-3)  # really another model


def test_non_finite_embeddings_are_refused_naming_the_protein(tmp_path, capsys):
    recs = proteins(12)
    recs[7] = ("has_w", "MKTAYW" + recs[7][1])  # its W makes layer norm overflow: NaN for it alone
    inp = write_fasta(tmp_path / "in.fasta", recs)
    model = tiny()
    with torch.no_grad():
        model.model.embed.weight[model.tokenizer.encode("W")[1]] = 3e38
    bad = save_checkpoint(model, tmp_path / "w.ckpt")
    out, pt = tmp_path / "e.h5", tmp_path / "pt"
    before = checksums(tmp_path)
    code, err = run_script("embed", capsys, f"ckpt={bad}", f"input={inp}", f"output={out}", f"pt_dir={pt}",
                           "max_tokens=200", "progress=false")
    one_line(code, err, r"in\.fasta:15: record 'has_w': the model's embedding holds NaN or inf values")
    assert not out.exists() and not (pt / "has_w.pt").exists() and not (pt / ".protein-performer-tmp").exists()
    for p in (tmp_path / "e.h5.partial").glob("*.npz"):  # what is left is a resumable journal of finite rows
        with np.load(p, allow_pickle=False) as z:
            assert 7 not in z["index"] and all(np.isfinite(z[k]).all() for k in z.files)
    assert {k: v for k, v in checksums(tmp_path).items() if k in before} == before
    # NaN weights: refused before any work
    with torch.no_grad():
        model.model.blocks[0].norm1.weight[3] = float("nan")
    nan = save_checkpoint(model, tmp_path / "nan.ckpt")
    code, err = run_script("embed", capsys, f"ckpt={nan}", f"input={inp}", f"output={tmp_path / 'n.h5'}",
                           "progress=false")
    one_line(code, err, r"checkpoint .*nan\.ckpt: blocks\.0\.norm1\.weight holds NaN or inf values")
    assert not (tmp_path / "n.h5.lock").exists() and not (tmp_path / "n.h5.partial").exists()


# --- settings, ids and paths: checked before any work -------------------------------------------
def test_every_setting_id_and_path_is_checked_before_work(ckpt, tmp_path, capsys):
    inp = write_fasta(tmp_path / "in.fasta", proteins(3))
    long_id = write_fasta(tmp_path / "long.fasta", [("a", "MKV"), ("x" * 300, "MKTAY")])
    (tmp_path / "empty_id.csv").write_text("id,seq\nA,MKTAYIAK\n ,MKVLA\n")
    (tmp_path / "notes.txt").write_text("keep\n")
    with h5py.File(tmp_path / "user.h5", "w") as f:
        f["mean"] = np.ones((2, 3))
    exported = export(ckpt, tmp_path / "exported")
    before = checksums(tmp_path)
    listing = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    cases = [
        (["pooling=[]"], r"pooling=\[\]: expected one or more of mean, cls, max"),
        (["layers=[]"], r"layers=\[\]: expected an integer or a non-empty list of integers"),
        (["layers=[1.7]"], r"layers=\[1\.7\]: expected an integer"),
        (["layers=1.7"], r"layers=1\.7: expected an integer"),
        (["layers=[a]"], r"layers=\[\"a\"\]: expected an integer"),
        (["layers=[true]"], r"layers=\[true\]: expected an integer"),
        (["layers=[3]"], r"layer 3 does not exist: the model has layers 0\.\.2"),
        (["pooling=[sum]"], r"pooling 'sum' is not one of mean, cls, max"),
        (["precision=8"], r"precision 8: expected 32, bf16 or 16"),
        (["max_tokens=0"], r"max_tokens=0: expected a positive integer"),
        (["max_tokens=1.5"], r"max_tokens=1\.5: expected a positive integer"),
        (["sort_records=-3"], r"sort_records=-3: expected a positive integer"),
        (["long_alone=0"], r"long_alone=0: expected a positive integer or null"),
        (["per_residue=maybe"], r"per_residue=\"maybe\": expected true or false"),
        (["overwrite=1"], r"overwrite=1: expected true or false"),
        (["format=xml"], r"format=\"xml\": expected fasta, uniprot, csv, tsv or null"),
        (["on_invalid=ignore"], r"on_invalid=\"ignore\": expected error or skip"),
        (["unknown=Q"], r"unknown must be 'error', 'X' or 'unk', got 'Q'"),
        (["device=gpu"], r"device=\"gpu\": expected auto, cpu, cuda or cuda:N"),
        ([f"output={tmp_path / 'user.h5'}", "overwrite=true"],
         r"output .*user\.h5: an HDF5 file that embed did not write \(no embed attributes\); refusing to replace it"),
        ([f"input={long_id}", f"pt_dir={tmp_path / 'pt'}"],
         r"long\.fasta:3: record 'x{40}\.\.\.': its id makes a 303-byte file name in pt_dir, over the 255-byte"),
        ([f"input={tmp_path / 'empty_id.csv'}", "per_residue=true"],
         r"empty_id\.csv:3: record has an empty id, and per_residue names each protein by its id"),
        ([f"output={inp}"], r"output=.*in\.fasta: is the input input=.*in\.fasta"),
        ([f"output={tmp_path / 'notes.txt' / 'e.h5'}"], r"output=.*notes\.txt/e\.h5: .*notes\.txt is a file, not a folder"),
        ([f"pt_dir={tmp_path / 'notes.txt' / 'pt'}"], r"pt_dir=.*: .*notes\.txt is a file, not a folder"),
        ([f"ckpt={exported}", f"pt_dir={exported}"], r"pt_dir=.*exported: is the input ckpt=.*exported"),
        ([f"output={tmp_path / 'x'}", f"pt_dir={tmp_path / 'x'}"], r"output .*x and pt_dir .*x are the same path"),
    ]
    for overrides, pattern in cases:
        args = {"ckpt": f"ckpt={ckpt}", "input": f"input={inp}", "output": f"output={tmp_path / 'e.h5'}"}
        for o in overrides:
            args[o.split("=")[0]] = o
        code, err = run_script("embed", capsys, *args.values(), "progress=false")
        one_line(code, err, pattern)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == listing, overrides  # nothing written
    assert checksums(tmp_path) == before
    # the same ids are fine where they name nothing: pooled output only
    assert E.embed_file(ckpt, tmp_path / "empty_id.csv", tmp_path / "ok.h5", progress=False)["embedded"] == 2


# --- pt_dir: only what embed wrote -----------------------------------------------------------------
def test_pt_dir_overwrite_removes_only_files_embed_recorded(ckpt, tmp_path, capsys):
    inp = write_fasta(tmp_path / "in.fasta", proteins(5))
    pt = tmp_path / "pt"
    pt.mkdir()
    (pt / "mine.pt").write_bytes(b"user's own tensor file")
    (pt / "notes.txt").write_text("keep\n")
    user = checksums(pt)
    E.embed_file(ckpt, inp, pt_dir=pt, progress=False)
    assert sorted(p.name for p in pt.glob("*.pt")) == ["mine.pt"] + [f"p{i:02d}.pt" for i in range(5)]
    with pytest.raises(UserError, match=r"pt_dir .*pt was written with a different layers \[2\] \(now \[0\]\)"):
        E.embed_file(ckpt, inp, pt_dir=pt, layers=[0], progress=False)
    # overwrite with another input and layer: the old proteins' files go, the user's stay
    other = write_fasta(tmp_path / "other.fasta", [("q1", "MKTAYIAKQR"), ("q2", "MKVLAAGIV")])
    s = E.embed_file(ckpt, other, pt_dir=pt, layers=[0], overwrite=True, progress=False)
    assert s["embedded"] == 2
    assert sorted(p.name for p in pt.glob("*.pt")) == ["mine.pt", "q1.pt", "q2.pt"]
    assert {k: v for k, v in checksums(pt).items() if k in user} == user
    ref = E.embed_sequences(str(ckpt), str(other), layers=[0])
    got = torch.load(pt / "q2.pt", weights_only=True)
    np.testing.assert_allclose(got["mean_representations"][0].numpy(), ref["mean"][1], rtol=0, atol=1e-6)
    # a protein whose file name is a user's file: refused before anything is written, overwrite or not
    clash = write_fasta(tmp_path / "clash.fasta", [("q1", "MKTAYIAKQR"), ("mine", "MKV")])
    listing = checksums(pt)
    for flag in ("false", "true"):
        code, err = run_script("embed", capsys, f"ckpt={ckpt}", f"input={clash}", f"pt_dir={pt}", "layers=[0]",
                               f"overwrite={flag}", "progress=false")
        one_line(code, err, r"pt_dir .*pt/mine\.pt: exists and was not written by embed")
        assert checksums(pt) == listing


# --- no code from files --------------------------------------------------------------------------------
class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def live(load, marker) -> bool:
    """The crafted file really runs code when unpickled (checked, then the marker removed)."""
    load()
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran


def test_no_pickle_is_run_checkpoint_or_journal_batch(ckpt, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "pwned"
    evil_ckpt = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": Evil(marker)}, evil_ckpt)
    assert live(lambda: torch.load(evil_ckpt, weights_only=False), marker)
    inp = write_fasta(tmp_path / "in.fasta", proteins(6))
    code, err = run_script("embed", capsys, f"ckpt={evil_ckpt}", f"input={inp}", f"output={tmp_path / 'a.h5'}",
                           "progress=false")
    one_line(code, err, r"checkpoint .*evil\.ckpt: cannot load")
    assert not marker.exists()
    # a journal batch holding a pickled object array: refused, never unpickled
    out = tmp_path / "e.h5"
    monkeypatch.setattr(H5Output, "finish", lambda self, ids: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        E.embed_file(ckpt, inp, out, max_tokens=200, progress=False)
    monkeypatch.undo()
    batch = sorted((tmp_path / "e.h5.partial").glob("batch-*.npz"))[-1]
    with np.load(batch) as z:
        arrays = {k: z[k] for k in z.files}
    key = next(k for k in arrays if k.startswith("pooled|"))
    arrays[key] = np.array([Evil(marker)], dtype=object)
    with zipfile.ZipFile(batch, "w") as zf:
        for k, v in arrays.items():
            with zf.open(f"{k}.npy", "w") as fh:
                np.lib.format.write_array(fh, v, allow_pickle=True)
    assert live(lambda: np.load(batch, allow_pickle=True)[key], marker)
    code, err = run_script("embed", capsys, f"ckpt={ckpt}", f"input={inp}", f"output={out}", "max_tokens=200",
                           "progress=false")
    one_line(code, err, rf"{batch.name}: not a readable journal batch of this input \(pooled\|mean\|2: ValueError\)")
    assert not marker.exists() and not out.exists()

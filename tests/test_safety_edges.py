"""Issue 65's rough edges, items 1-8, as tests: each a setting or an input a new user tripped on,
answered in one ``error:`` line with exit 2 and nothing written (or done right). Commands run
through the console entry point in this process (tests/inprocess.py)."""
import pytest

from inprocess import checksums, run_main

TRAIN = ["model.dim=16", "model.depth=1", "model.heads=2", "model.attention.nb_features=8", "model.dropout=0.0",
         "data.max_len=48", "data.batch_size=16", "data.max_tokens=null", "data.crop_schedule=null",
         "data.valid_fraction=0.1", "optim.warmup_steps=2", "trainer.enable_progress_bar=false",
         "+trainer.enable_model_summary=false", "logger=none", "trainer.max_steps=2"]


def one_line(code: int, out: str, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out[-2000:], err[-3000:])
    assert "Traceback" not in out + err
    return lines[0]


# --- item 1: max_records, one check for every command ---------------------------------------
@pytest.mark.parametrize("value", ["-1", "0", "2.5", "true"])
def test_max_records_is_checked_one_way_by_every_command(tmp_path, capsys, monkeypatch, ckpts, small_fasta, value):
    monkeypatch.chdir(tmp_path)
    shown = {"-1": "-1", "0": "0", "2.5": "2.5", "true": "True"}[value]
    why = "a positive number of records, or null for all"
    line = one_line(*run_main(capsys, "train", *TRAIN, f"data.path={small_fasta}", "hydra.run.dir=run",
                              f"data.max_records={value}"))
    assert line == f"error: data.max_records={shown}: {why}"
    line = one_line(*run_main(capsys, "evaluate", f"ckpt={ckpts['mlm']}", f"data.path={small_fasta}",
                              f"data.max_records={value}", "output_dir=ev"))
    assert line == f"error: data.max_records={shown}: {why}"
    for key in ("heldout.max_records", "train.data.max_records"):  # before any model trains
        line = one_line(*run_main(capsys, "compare", "models=[linear]", "exact=linear", "hydra.run.dir=cmp",
                                  f"train.data.path={small_fasta}", f"{key}={value}", "trainer.max_steps=2"))
        assert line == f"error: {key}={shown}: {why}"
    assert list(tmp_path.iterdir()) == []


# --- item 3: exact attention takes no linear-attention backend --------------------------------
@pytest.mark.parametrize("objective", ["clm", "mlm"])
@pytest.mark.parametrize("backend", ["fla", "parallel"])
def test_exact_attention_refuses_a_backend_it_would_not_run(tmp_path, capsys, monkeypatch, small_fasta, objective,
                                                            backend):
    monkeypatch.chdir(tmp_path)
    line = one_line(*run_main(capsys, "train", *TRAIN, "model=transformer", f"objective={objective}",
                              f"data.path={small_fasta}", "hydra.run.dir=run", f"model.attention.backend={backend}"))
    assert line == (f"error: model.attention.backend={backend}: exact attention (model.attention.kernel=exact) runs "
                    f"no linear-attention backend; leave model.attention.backend=auto")
    assert list(tmp_path.iterdir()) == []


# --- item 4: finetune's closing line counts proteins, not residues ---------------------------
def test_residue_finetune_says_how_many_proteins_the_probe_was_refitted_on(tmp_path, capsys, ckpts):
    import json
    import random

    from conftest import run_command
    rng = random.Random(0)
    seqs = ["".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(15, 45))) for _ in range(40)]
    rows = [f"p{i},{s},{''.join(rng.choice('HEC') for _ in s)},{'test' if i < 8 else 'train'}"
            for i, s in enumerate(seqs)]
    labels = tmp_path / "residues.csv"
    labels.write_text("id,sequence,label,split\n" + "\n".join(rows) + "\n")
    out = tmp_path / "out"
    code, stdout, err = run_command("finetune", capsys, f"ckpt={ckpts['mlm']}", f"labels={labels}", "task=residue",
                                    f"output_dir={out}", "lr=0", "head_lr=0", "trainer.max_epochs=1", "max_tokens=1200")
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert m["selection"]["kept"] == "probe" and m["probe"]["refit"]["proteins"] == 32
    assert m["probe"]["refit"]["examples"] == sum(len(s) for s in seqs[8:])  # its residues
    assert "then fitted again on all 32 training proteins, the validation proteins" in stdout


# --- item 5: the GPU check without a GPU ------------------------------------------------------
def test_gpu_check_without_a_gpu_says_so_first_and_exits_2(tmp_path):
    import os
    import subprocess
    import sys

    import torch

    from conftest import ROOT
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the check runs")
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=dict(os.environ, PYTHON=sys.executable))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"gpu_check: no CUDA GPU here (torch.cuda.is_available() is false, or torch does not import with "
        f"{sys.executable}): run it on a machine with an NVIDIA GPU and a CUDA build of torch; the CPU tests are pytest -q"]
    assert list(tmp_path.iterdir()) == []


# --- item 6: a prompt as long as max_length ---------------------------------------------------
def test_generate_refuses_a_prompt_that_leaves_nothing_to_generate(tmp_path, capsys, monkeypatch, ckpts):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("mine\n")
    line = one_line(*run_main(capsys, "generate", f"ckpt={ckpts['clm']}", "prompt=MKTAY", "max_length=5",
                              "num_samples=2", "output=out.fasta"))
    assert line == ("error: prompt has 5 residues, max_length=5 leaves none to generate (max_length counts the "
                    "prompt): give max_length above 5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    code, out, err = run_main(capsys, "generate", f"ckpt={ckpts['clm']}", "prompt=MKTAY", "max_length=6",
                              "num_samples=2", "output=out.fasta")
    assert code == 0, err
    records = (tmp_path / "out.fasta").read_text().split(">")[1:]
    assert len(records) == 2 and all("length=6 " in r and "mean_loglik=nan" not in r for r in records)


# --- item 7: embed checks every protein against learned positions before writing --------------
def test_embed_names_a_protein_too_long_for_learned_positions_before_any_output(tmp_path, capsys, monkeypatch):
    import random

    import torch

    from conftest import TINY_MODEL, save_checkpoint
    from protein_performer.training.task import ProteinLM
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    ckpt = save_checkpoint(ProteinLM(model=dict(TINY_MODEL, position="learned", max_positions=40)), tmp_path / "m.ckpt")
    rng = random.Random(0)
    recs = [(f"p{i}", "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(10, 30))))
            for i in range(40)]
    recs[35] = ("long_one", "M" * 39)  # 41 tokens with <cls> and <eos>: line 71 of the file
    (tmp_path / "in.fasta").write_text("".join(f">{r}\n{s}\n" for r, s in recs))
    before = checksums(tmp_path)
    for outputs in (["output=e.h5"], ["pt_dir=pt"], ["output=e.h5", "pt_dir=pt"]):
        line = one_line(*run_main(capsys, "embed", f"ckpt={ckpt}", "input=in.fasta", *outputs, "max_tokens=64",
                                  "sort_records=5", "progress=false"))
        assert line == ("error: in.fasta:71: record 'long_one' has 41 tokens (<cls> and <eos> included), more than "
                        "the model's learned positions (model.max_positions=40); leave it out or use a model with "
                        "rotary positions")
        assert checksums(tmp_path) == before
    with pytest.raises(Exception, match="^in.fasta:71: record 'long_one' has 41 tokens"):
        from protein_performer.embed import embed_sequences
        embed_sequences(ckpt, "in.fasta")


# --- item 8: a key a command does not take ----------------------------------------------------
@pytest.mark.parametrize("command, args", [
    ("embed", ["input=in.fasta", "output=e.h5", "+model.attention.backend=fla"]),
    ("generate", ["output=g.fasta", "+model.attention.backend=fla"]),
    ("score", ["input=assay.csv", "sequence=MKTAY", "output=s.csv", "+sequences.path=x"]),
])
def test_a_key_the_command_does_not_take_is_one_line(tmp_path, capsys, monkeypatch, ckpts, command, args):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.fasta").write_text(">a\nMKTAYIAKQR\n")
    (tmp_path / "assay.csv").write_text("mutant\nM1A\n")
    before = checksums(tmp_path)
    line = one_line(*run_main(capsys, command, f"ckpt={ckpts['clm']}", *args))
    key = args[-1][1:].split("=")[0]
    assert line == f"error: {key}: protein-performer {command} takes no such key (--help lists every key)"
    assert checksums(tmp_path) == before


# --- item 2: the memory a training step needs, before the model is built -----------------------
def test_the_memory_estimate_is_the_documented_formula_counted_by_hand():
    from protein_performer.training.memory import step_bytes
    model = dict(dim=16, depth=1, heads=2, ff_mult=4, attention=dict(kernel="softmax", nb_features=8, local_heads=1,
                                                                       local_window=128))
    data = dict(max_len=48, batch_size=16, max_tokens=None)
    # parameters: head bias 30 + embedding 30 x 16 + a block (norms 2 x 32, to_qkv 48 x 16, to_out 16 x 16 + 16,
    # fc1 64 x 16 + 64, fc2 16 x 64 + 16) + final norm 32 = 30 + 480 + 3232 + 32 = 3774
    # tokens 16 x 48 = 768; per token 34 x 16 + 2 x 8 x (2 - 1) + 1 x min(256, 48) = 544 + 16 + 48 = 608 floats
    assert step_bytes(model, data, causal=False) == {"parameters": 3774, "state": 16 * 3774,
                                                     "activations": 4 * 1 * 768 * 608, "tokens": 768,
                                                     "total": 16 * 3774 + 4 * 768 * 608}
    # exact attention: 3 x heads x L scores a token instead (544 + 3 x 2 x 48 = 832); a token budget sets T
    exact = dict(model, attention=dict(kernel="exact", local_heads=0))
    assert step_bytes(exact, dict(data, max_tokens=512), causal=True)["activations"] == 4 * 512 * 832


def test_a_run_far_above_the_machines_memory_is_refused_and_a_close_one_warned(tmp_path, capsys, monkeypatch,
                                                                              small_fasta):
    from protein_performer.training import memory
    monkeypatch.chdir(tmp_path)
    args = [*TRAIN, f"data.path={small_fasta}"]
    code, out, err = run_main(capsys, "train", *args, "hydra.run.dir=run")  # the estimate among the first lines
    assert code == 0, err
    first = (out + err).splitlines()
    line = next(i for i, s in enumerate(first) if "memory: a training step needs about 1.9 MB: 0.1 MB of weights" in s)
    assert line < 5 and "(3,774 parameters) and 1.9 MB of activations (768 tokens a batch)" in first[line]
    monkeypatch.setattr(memory, "machine_memory", lambda device: (1_500_000, "RAM"))  # 1.93 MB > 1.25 x 1.5 MB
    line = one_line(*run_main(capsys, "train", *args, "hydra.run.dir=refused"))
    assert line == ("error: memory: a training step needs about 1.9 MB: 0.1 MB of weights, gradients and AdamW state "
                    "(3,774 parameters) and 1.9 MB of activations (768 tokens a batch); this machine has 1.5 MB of "
                    "RAM: lower data.max_tokens (or data.max_len, data.batch_size), model.dim or model.depth, or "
                    "train on a larger machine")
    assert not (tmp_path / "refused").exists()
    monkeypatch.setattr(memory, "machine_memory", lambda device: (2_200_000, "RAM"))  # above 0.75 x 2.2 MB: a warning
    code, out, err = run_main(capsys, "train", *args, "hydra.run.dir=warned")
    assert code == 0, err
    assert ("memory: a training step needs about 1.9 MB: 0.1 MB of weights, gradients and AdamW state (3,774 "
            "parameters) and 1.9 MB of activations (768 tokens a batch); this machine has 2.2 MB of RAM: close to all "
            "of it (steps may swap or run out of memory)") in out + err

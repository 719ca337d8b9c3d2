"""User errors of train / prepare_data end in one line naming the file, exit status 2, and
leave nothing half-written; a run folder holds one run (refused, resumed or overwritten on
purpose) with last.ckpt and one best-<step>.ckpt. Most cases call the functions inside the
same ``cli`` wrapper the scripts use; two run the scripts themselves."""
import gzip
import os
import re
import socket
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from protein_performer.data.shard_datamodule import ShardDataModule
from protein_performer.errors import UserError, cli
from protein_performer.training.run_folder import check_run_folder, open_run_folder
from protein_performer.tokenizer import InvalidSequenceError, Tokenizer
from protein_performer.training.run import check_checkpoint, train

from conftest import ROOT
from forkserver import forks

SAMPLE = ROOT / "data" / "sample" / "swissprot_sample_20k.fasta.gz"
TINY = ["model.dim=16", "model.depth=1", "model.heads=2", "model.attention.nb_features=8", "model.dropout=0.0",
        "data.max_len=48", "data.batch_size=16", "data.max_tokens=null", "data.crop_schedule=null",
        "data.valid_fraction=0.1", "optim.warmup_steps=2", "trainer.enable_progress_bar=false",
        "+trainer.enable_model_summary=false", "logger=none"]


def one_line_exit_2(fn, capsys) -> str:
    """Run ``fn`` as a command runs (inside ``cli``): exit status 2 and one ``error:`` line."""
    with pytest.raises(SystemExit) as e:
        cli(fn)()
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def files_under(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


def refused_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connections are refused
    return port


# --- inputs -------------------------------------------------------------------------------
def _write(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


CASES = {
    "missing": (lambda t: t / "nope.fasta", "data.path={p}: no such file"),
    "directory": (lambda t: (t / "adir").mkdir() or t / "adir", "data.path={p}: is a directory"),
    "empty": (lambda t: _write(t, "empty.fasta", b""), "{p}: is empty"),
    "empty gzip": (lambda t: _write(t, "empty.fasta.gz", gzip.compress(b"")), "{p}: is empty (a gzip file"),
    "binary": (lambda t: _write(t, "bin.fasta", bytes(range(256)) * 8), "{p}: is a binary file"),
    "no valid record": (lambda t: _write(t, "bad.fasta", b">a\nMK1\n>b\nMK2\n"),
                        "{p}: no usable protein records (2 read, 2 invalid, 0 duplicates)"),
    # valid_fraction 1e-9: both records go to train whatever their hash
    "too small": (lambda t: _write(t, "small.fasta", b">a\nMKV\n>b\nMKL\n"),
                  "{p}: 2 records went to train and 0 to valid; training needs both: change data.valid_fraction "
                  "(now 1e-09)"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_leaves_no_prepared_folder(tmp_path, capsys, case):
    make, expected = CASES[case]
    path = make(tmp_path)
    cache = tmp_path / "cache"
    dm = ShardDataModule(path=str(path), data_dir=str(cache), prepare_workers=0, progress=False,
                         valid_fraction=1e-9, test_fraction=0.0)
    line = one_line_exit_2(dm.prepare_data, capsys)
    assert expected.format(p=path) in line
    assert [f for f in files_under(cache) if not f.startswith("checksums")] == []  # only the hash memo


def test_download_without_network_gives_up_in_one_line_and_leaves_nothing(tmp_path, capsys):
    url = f"http://127.0.0.1:{refused_port()}/uniprot_trembl.fasta.gz"
    cache = tmp_path / "cache"
    dm = ShardDataModule(url=url, download=True, data_dir=str(cache), progress=False, download_retries=1,
                         download_backoff=0)
    line = one_line_exit_2(dm.prepare_data, capsys)
    dest = cache / "downloads" / "uniprot_trembl.fasta.gz"
    assert f"{url}: gave up after 2 failed attempts to download it to {dest}" in line
    assert "refused" in line.lower() and "resumes" not in line  # no partial file to resume
    assert files_under(cache) == []


def test_unknown_residue_hint_names_the_key_that_works(tmp_path, capsys):
    # the library names its argument; a command whose config nests it names the key a user sets
    with pytest.raises(InvalidSequenceError, match=r"^x\.fasta:2: record 'a': invalid residue '1' at position 3 "
                                                   r"\(set unknown=X to map unknown residues to X\)$"):
        Tokenizer().encode("MK1", source="x.fasta:2", record="a")
    with pytest.raises(UserError, match="^unknown must be 'error', 'X' or 'unk', got '\\?'$"):
        Tokenizer(unknown="?")
    from conftest import run_command
    bad = _write(tmp_path, "bad.fasta", b">a\nMKV\n>b\nMK1\n")
    (tmp_path / "x.ckpt").write_bytes(b"")  # proteins are read before any checkpoint is opened
    code, _, err = run_command("evaluate", capsys, f"ckpt={tmp_path / 'x.ckpt'}", f"data.path={bad}",
                               f"output_dir={tmp_path / 'out'}")
    assert code == 2 and f"{bad}:3: record 'b': invalid residue '1' at position 3 (set data.unknown=X" in err
    code, _, err = run_command("evaluate", capsys, f"ckpt={tmp_path / 'x.ckpt'}", f"data.path={bad}",
                               "data.unknown=?", f"output_dir={tmp_path / 'out'}")
    assert code == 2 and "data.unknown must be 'error', 'X' or 'unk', got '?'" in err


# --- checkpoints and run folders ----------------------------------------------------------
def test_resume_checkpoint_is_checked_before_anything_is_written(tmp_path, capsys):
    junk = _write(tmp_path, "notes.ckpt", b"this is not a checkpoint\n")
    assert one_line_exit_2(lambda: check_checkpoint(str(junk)), capsys) == (
        f"error: ckpt_path={junk}: not a checkpoint (not a file written by torch.save)")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "weights.pt")
    line = one_line_exit_2(lambda: check_checkpoint(str(tmp_path / "weights.pt")), capsys)
    assert f"ckpt_path={tmp_path / 'weights.pt'}: not a Lightning training checkpoint" in line
    assert one_line_exit_2(lambda: check_checkpoint(str(tmp_path)), capsys) == (
        f"error: ckpt_path={tmp_path}: is a directory, not a checkpoint file")
    assert one_line_exit_2(lambda: check_checkpoint(str(tmp_path / "nope.ckpt")), capsys) == (
        f"error: ckpt_path={tmp_path / 'nope.ckpt'}: no such checkpoint file")


def test_a_run_folder_with_checkpoints_is_refused_unless_resumed_or_overwritten(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    check_run_folder(ckpts, None, False)  # no folder yet
    ckpts.mkdir(parents=True)
    (ckpts / "last.ckpt").write_bytes(b"x")
    with pytest.raises(UserError, match=rf"^{re.escape(str(ckpts))}: already holds checkpoints \(last\.ckpt\).*"
                                        rf"ckpt_path={re.escape(str(ckpts / 'last.ckpt'))}.*overwrite=true"):
        check_run_folder(ckpts, None, False)
    with pytest.raises(UserError):
        check_run_folder(ckpts, str(tmp_path / "elsewhere" / "last.ckpt"), False)
    check_run_folder(ckpts, str(ckpts / "last.ckpt"), False)  # resuming this run
    check_run_folder(ckpts, None, True)


def _hydra_files(run: Path) -> None:
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    for name in (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "train.log", "config.yaml"):
        (run / name).write_text("x")


def test_a_run_that_fails_on_a_user_error_leaves_no_folder(tmp_path):
    run = tmp_path / "outputs" / "2024-01-01" / "10-00-00-performer-mlm"
    folder = open_run_folder(run, "train", None, False)  # before Hydra writes its files
    _hydra_files(run)
    with pytest.raises(UserError):
        with folder.discard_on_user_error():
            raise UserError("x.fasta: is empty")
    assert files_under(tmp_path) == []  # and the folders it created, up to the first that existed
    folder = open_run_folder(run, "train", None, False)
    _hydra_files(run)
    with pytest.raises(RuntimeError):  # a bug: everything stays for the post-mortem
        with folder.discard_on_user_error():
            raise RuntimeError("bug")
    assert (run / "train.log").is_file()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_text("x")
    folder = open_run_folder(run, "train", None, True)
    with pytest.raises(UserError):  # the folder holds checkpoints: nothing of it is removed
        with folder.discard_on_user_error():
            raise UserError("refused")
    assert (run / "train.log").is_file() and (run / ".hydra" / "config.yaml").is_file()


def _train(run: Path, fasta: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=TINY + [f"data.path={fasta}", *overrides])
    return train(cfg, run)


def _checkpoints(run: Path) -> dict[str, int]:
    return {p.name: torch.load(p, weights_only=False)["global_step"] for p in (run / "checkpoints").iterdir()}


def test_one_run_per_folder_last_is_resumed_and_best_always_exists(tmp_path, small_fasta):
    run = tmp_path / "run"
    # max_steps below the validation interval: the final validation still names a best checkpoint
    _train(run, small_fasta, "trainer.max_steps=3", "trainer.val_check_interval=100")
    assert _checkpoints(run) == {"last.ckpt": 3, "best-3.ckpt": 3}
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}

    with pytest.raises(UserError, match="already holds checkpoints"):
        _train(run, small_fasta, "trainer.max_steps=5")
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before

    # resuming the folder's own run: last.ckpt goes on (no last-v1.ckpt), one best file stays
    _train(run, small_fasta, "trainer.max_steps=6", "trainer.val_check_interval=2",
           f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    got = _checkpoints(run)
    assert got["last.ckpt"] == 6 and len(got) == 2
    (best,) = [n for n in got if n.startswith("best-")]
    assert best == f"best-{got[best]}.ckpt" and 3 <= got[best] <= 6
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["optimizer_states"]

    _train(run, small_fasta, "trainer.max_steps=2", "trainer.val_check_interval=100", "overwrite=true")
    assert _checkpoints(run) == {"last.ckpt": 2, "best-2.ckpt": 2}


def test_a_resume_keeps_the_checkpoints_model_settings(tmp_path, small_fasta):
    """A setting the weights do not show (the rotary base: a non-persistent buffer; its default
    changed) must be the checkpoint's on resume: else one line naming it and nothing written."""
    run = tmp_path / "run"
    _train(run, small_fasta, "trainer.max_steps=2", "trainer.val_check_interval=100", "model.rotary_base=10000")
    last = run / "checkpoints" / "last.ckpt"
    before = {p.name: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    with pytest.raises(UserError) as e:
        _train(run, small_fasta, "trainer.max_steps=4", f"ckpt_path={last}")  # the config's default base
    assert str(e.value) == (f"ckpt_path={last}: its model has model.rotary_base=10000, this run's config "
                            f"model.rotary_base=1000000; resume with the checkpoint's settings (model.rotary_base=10000)")
    assert {p.name: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before
    _train(run, small_fasta, "trainer.max_steps=4", f"ckpt_path={last}", "model.rotary_base=10000")
    assert torch.load(last, weights_only=False)["global_step"] == 4


# --- the commands themselves --------------------------------------------------------------
def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return forks().run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                       cwd=cwd, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_train_command_on_a_binary_file_exits_2_with_one_line_and_no_run_folder(tmp_path):
    binary = _write(tmp_path, "proteins.fasta", bytes(range(256)) * 8)
    out = _run("train.py", "data=fasta", f"data.path={binary}", f"data.data_dir={tmp_path / 'cache'}",
               "logger=none", "hydra.run.dir=runs/r1", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"error: {binary}: is a binary file, not FASTA or UniProt text"]
    assert files_under(tmp_path) == ["proteins.fasta"]  # no run folder, no prepared data


def test_prepare_data_command_without_network_exits_2_with_one_line_and_writes_nothing(tmp_path):
    url = f"http://127.0.0.1:{refused_port()}/uniprot_trembl.fasta.gz"
    out = _run("prepare_data.py", "data=trembl", f"data.url={url}", "data.metalink=null",
               f"data.data_dir={tmp_path / 'cache'}", "data.download_retries=1", "data.download_backoff=0",
               cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {url}: gave up after 2 failed attempts"), lines
    assert "Traceback" not in out.stdout + out.stderr
    assert files_under(tmp_path) == ["cache"]  # the (empty) data folder: no download, lock or Hydra log folder


# --- help and outputs of the commands -----------------------------------------------------
HELP = {"train": ["Trains a protein language model", "data.path", "ckpt_path", "overwrite", "logger.log_model"],
        "prepare_data": ["prepares a", "data.path", "data.valid_fraction", "data.download_retries"],
        "generate": ["Samples proteins", "ckpt", "num_samples", "temperature", "output"],
        "compare": ["Trains each model", "models", "train.*", "doc", "output_dir/comparison.md"]}


@pytest.mark.parametrize("name", HELP)
def test_help_says_what_the_command_does_and_its_keys(name):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(name, return_hydra_config=True)
    template = cfg.hydra.help.template
    for needle in HELP[name]:
        assert needle in template, needle
    # Hydra fills the template with string.Template: any other '$' would crash --help
    string.Template(template).substitute(FLAGS_HELP="", HYDRA_CONFIG_GROUPS="", APP_CONFIG_GROUPS="", CONFIG="")


@pytest.mark.parametrize("name", ["generate", "prepare_data"])
def test_commands_whose_output_is_a_file_write_no_hydra_folder(name):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(name, return_hydra_config=True)
    assert cfg.hydra.run.dir == "." and cfg.hydra.output_subdir is None
    assert "file" not in cfg.hydra.job_logging.handlers


def test_compare_writes_tracked_docs_only_when_asked():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        assert compose("compare").doc is None and compose("long_proteins").doc is None
        assert compose("compare", overrides=["doc=docs/comparison.md"]).doc == "docs/comparison.md"


def test_compare_model_overrides_take_a_list_or_a_tree_and_refuse_anything_else(tmp_path, capsys):
    from conftest import run_command
    from protein_performer.compare import flatten_overrides
    # the two spellings give the same overrides
    assert flatten_overrides(["model.attention.redraw_interval=100"]) == ["model.attention.redraw_interval=100"]
    assert flatten_overrides({"model": {"attention": {"redraw_interval": 100, "kernel": None}}}) == \
        ["model.attention.redraw_interval=100", "model.attention.kernel=null"]
    # anything else: one line naming the setting, exit 2, before any training (nothing written)
    out = tmp_path / "cmp"
    code, _, err = run_command("compare", capsys, "models=[performer]", "+model_overrides.performer=5",
                               f"output_dir={out}")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "model_overrides.performer" in lines[0], err
    assert not out.exists()


def test_hydra_flags_after_overrides_work(tmp_path, capsys, monkeypatch):
    """``protein-performer train trainer.max_steps=3 --cfg job`` prints the composed job config: the
    command's own hydra.job.name override goes before the user's flags (after them, Hydra's argument
    parser refused it: "unrecognized arguments")."""
    from inprocess import run_main
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "train", "trainer.max_steps=3", "--cfg", "job")
    assert code == 0, err
    assert "max_steps: 3" in out and "unrecognized" not in err
    assert list(tmp_path.iterdir()) == []          # printing the config writes nothing

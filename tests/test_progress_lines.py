"""Readable progress in logs (issue 43 item 2, issue 45 item 5): with stdout not a terminal the
long commands print plain lines (step k/N, loss, a rate, elapsed, ETA) every N steps or S seconds
and a final line, never a carriage return; fine-tuning prints a line per epoch with the
validation loss and the ETA. The helper's triggers and ETA are checked on a fake clock."""
import io
import json
import math
import random
import re
import subprocess
import sys

import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.training.progress import (ProgressLines, check_progress, duration, lightning_progress,
                                                 progress_bar)

from conftest import ROOT, TINY_MODEL, run_command, save_checkpoint
from forkserver import forks

TINY = ["model.dim=16", "model.depth=1", "model.heads=2", "model.attention.nb_features=8", "model.dropout=0.0",
        "data.max_len=48", "data.batch_size=16", "data.max_tokens=null", "data.crop_schedule=null",
        "data.valid_fraction=0.2", "optim.warmup_steps=1", "+trainer.enable_model_summary=false", "logger=none",
        "trainer.val_check_interval=3", "seed=0"]
STEP_LINE = re.compile(r"^train: step (\d+)/(\d+) \(\d+%\) \| loss (\S+) \| [\d,.]+ tokens/s \| elapsed \d+:\d\d "
                       r"\| ETA \d+:\d\d$")


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


# --- the helper ---------------------------------------------------------------------------------
def test_step_trigger_rate_and_eta_on_a_fake_clock():
    clock, out = Clock(), io.StringIO()
    p = ProgressLines("embed", 20, unit="proteins", every=2, seconds=None, stream=out, clock=clock)
    clock.t += 2.0
    assert p.update(4) is None  # one update: not yet
    clock.t += 3.0
    line = p.update(6)  # 10 proteins in 5 s, 10 left: ETA 5 s
    assert line is not None and p.eta() == pytest.approx(5.0)
    assert line == "embed: 10/20 proteins (50%) | 2 proteins/s | elapsed 0:05 | ETA 0:05"
    clock.t += 10.0
    assert p.update(5) is None  # the count restarts at each line
    assert p.eta() == pytest.approx(5.0)  # 15 in 15 s, 5 left
    final = p.close()
    assert final.startswith("embed: done 15/20 proteins | 1 proteins/s | elapsed 0:15")
    assert p.close() is None  # once
    assert out.getvalue().splitlines() == [line, final] and "\r" not in out.getvalue()


def test_time_trigger_fires_between_step_triggers():
    clock, out = Clock(), io.StringIO()
    p = ProgressLines("train", 100, every=50, seconds=30, rate_unit="tokens/s", stream=out, clock=clock)
    printed = []
    for step in range(1, 21):  # 10 s a step: lines after 30 s, whatever the step count
        clock.t += 10.0
        if p.update(1, rated=1000, loss=2.5) is not None:
            printed.append(step)
    assert printed == [3, 6, 9, 12, 15, 18]
    last = out.getvalue().splitlines()[-1]
    assert last == "train: step 18/100 (18%) | loss 2.5000 | 100 tokens/s | elapsed 3:00 | ETA 13:40"
    assert p.eta() == pytest.approx(80 * 10.0)  # 20 steps in 200 s, 80 left


def test_a_rate_counted_in_device_tensors_is_the_tokens_since_the_last_line():
    """The training callback counts tokens as tensors (no sync per step). The rate of every line, not
    only the first, is the tokens since the previous line over its seconds: 0 tokens/s in the second
    line meant the count and the last line's mark were one tensor, both grown in place."""
    clock, out = Clock(), io.StringIO()
    p = ProgressLines("train", 10, every=2, seconds=None, rate_unit="tokens/s", stream=out, clock=clock)
    for tokens in (300, 500, 200, 600, 100, 700):  # 2 s a step; a line every 2 steps
        clock.t += 2.0
        p.update(1, rated=torch.tensor(tokens))
    assert [re.search(r"\| ([\d,]+) tokens/s", l).group(1) for l in out.getvalue().splitlines()] == ["200", "200", "200"]
    assert p.close().startswith("train: done 6/10 steps | 200 tokens/s")  # 2,400 tokens in 12 s


def test_no_total_no_eta_and_a_time_limit_caps_it():
    clock = Clock()
    p = ProgressLines("train", None, every=1, seconds=0, stream=io.StringIO(), clock=clock)
    clock.t += 4
    assert "ETA" not in p.update(2) and p.eta() is None
    capped = ProgressLines("train", 100, every=1, seconds=0, stream=io.StringIO(), clock=clock, time_left=lambda: 7.0)
    clock.t += 1
    capped.update(1)  # 99 steps at 1 s each would take 99 s; the time limit ends the run in 7 s
    assert capped.eta() == 7.0
    assert duration(3725) == "1:02:05" and duration(65) == "1:05" and duration(None) == "?"


def test_progress_bar_is_lines_off_a_terminal_and_a_failure_prints_no_final_line():
    out = io.StringIO()
    bar = progress_bar(10, "evaluate", "tokens", stream=out, every=1)
    assert isinstance(bar, ProgressLines)
    with pytest.raises(RuntimeError), bar:
        bar.update(3)
        raise RuntimeError("boom")
    assert len(out.getvalue().splitlines()) == 1 and "done" not in out.getvalue()
    # the Lightning commands: a bar on a terminal, lines (and no bar) otherwise, nothing when the bar is off
    assert lightning_progress(True, "train", stream=io.StringIO())[0] is False
    assert len(lightning_progress(True, "train", stream=io.StringIO())[1]) == 1
    assert lightning_progress(False, "train", stream=io.StringIO()) == (False, [])


@pytest.mark.parametrize("every,seconds", [(-1, 30), (1.5, 30), (True, 30), (50, -1), (50, float("nan")), (50, "x")])
def test_bad_settings_are_one_line(every, seconds):
    with pytest.raises(UserError, match="progress_"):
        check_progress(every, seconds)


# --- train, stdout in a file ----------------------------------------------------------------------
def test_train_into_a_file_prints_lines_never_a_carriage_return(tmp_path, small_fasta):
    """6 steps, a line every 2 steps (30 s never passes... the time trigger is off): lines at steps 2,
    4 and 6, then the final line."""
    log = tmp_path / "train.log"
    run = tmp_path / "run"
    proc = forks().run([sys.executable, str(ROOT / "scripts" / "train.py"), *TINY, f"data.path={small_fasta}",
                        "trainer.max_steps=6", "progress_every=2", "progress_seconds=0",
                        f"hydra.run.dir={run}"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, timeout=240)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text
    lines = [ln for ln in text.splitlines() if ln.startswith("train: ")]
    steps = [m for m in map(STEP_LINE.match, lines) if m]
    assert [(int(m[1]), int(m[2])) for m in steps] == [(2, 6), (4, 6), (6, 6)], lines
    assert all(math.isfinite(float(m[3])) for m in steps)
    assert len(lines) == 4 and re.match(r"^train: done 6/6 steps \| loss \S+ \| [\d,.]+ tokens/s \| elapsed \d+:\d\d$",
                                        lines[-1]), lines
    assert "validation: perplexity" in text  # the command's own output is unchanged


# --- finetune: a line per epoch -------------------------------------------------------------------
def test_finetune_prints_a_line_per_epoch_with_the_validation_loss_metric_and_eta(tmp_path, capsys, monkeypatch,
                                                                                  caplog):
    import logging

    from protein_performer.training import quiet
    from protein_performer.training.quiet import DROPPED_LOG_LINES, LIGHTNING_LOGGERS
    torch.manual_seed(0)
    from protein_performer.training.task import ProteinLM
    ckpt = save_checkpoint(ProteinLM(model=TINY_MODEL, objective="mlm").eval(), tmp_path / "mlm.ckpt")
    rng = random.Random(0)
    labels = tmp_path / "labels.csv"
    with open(labels, "w") as fh:
        fh.write("id,sequence,label,split\n")
        for k in range(40):
            seq = "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(20, 30)))
            fh.write(f"p{k},{seq},{'ab'[k % 2]},{('train', 'train', 'valid', 'test')[k % 4]}\n")
    lightning = logging.getLogger(LIGHTNING_LOGGERS[0])   # Lightning's lines, from finetune's Trainer alone
    monkeypatch.setattr(lightning, "filters", [])  # as in a fresh process: no command has quietened it yet
    caplog.set_level(logging.INFO, logger=LIGHTNING_LOGGERS[0])
    seen, dropped = [], []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    keep = quiet._DropLines.filter
    monkeypatch.setattr(quiet._DropLines, "filter",
                        lambda self, record: keep(self, record) or dropped.append(record.getMessage()) or False)
    monkeypatch.setattr(lightning, "handlers", [*lightning.handlers, handler])  # undone after the test
    code, out, err = run_command("finetune", capsys, f"ckpt={ckpt}", f"labels={labels}", "task=classification",
                                 f"output_dir={tmp_path / 'out'}", "trainer.max_epochs=3", "patience=10",
                                 "max_tokens=2000")
    assert code == 0, err
    assert "\r" not in out
    epochs = [ln for ln in out.splitlines() if ln.startswith("finetune: epoch")]
    assert len(epochs) == 3, out
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    chosen_by = {c["name"]: c for c in metrics["selection"]["candidates"]}
    for k, line in enumerate(epochs, 1):
        m = re.match(rf"^finetune: epoch {k}/3 \| step \d+ \| train loss (\S+) \| val/loss (\S+) \(best (\S+)\) \| "
                     rf"val/accuracy (\S+) \| elapsed \d+:\d\d \| ETA \d+:\d\d", line)
        assert m and all(math.isfinite(float(v)) for v in m.groups()), line
        # the line's validation accuracy and loss are those the kept weights were chosen by
        assert float(m[4]) == pytest.approx(chosen_by[f"epoch {k}"]["accuracy"], abs=5e-5)
        assert float(m[2]) == pytest.approx(chosen_by[f"epoch {k}"]["loss"], abs=5e-5)
    assert "ETA 0:00" in epochs[-1]
    assert metrics["epochs"] >= 1
    # Lightning's own lines reach the log, less its tips and notices (training.quiet)
    assert any("GPU available" in m for m in seen), seen
    assert not [m for m in seen if any(d in m for d in DROPPED_LOG_LINES)], seen
    # what finetune's Trainer says and the filter dropped: the tip and two notices, each matched by its own entry
    for line in ("💡 Tip:", "was configured so validation will run at the end of the training epoch",
                 "to estimate number of stepping batches"):
        assert line in DROPPED_LOG_LINES and [m for m in dropped if line in m], (line, dropped)


# --- a loop of its own: evaluate, stderr not a terminal -------------------------------------------
def test_evaluate_off_a_terminal_prints_lines_not_a_bar(capsys):
    from protein_performer.evaluate import evaluate_model
    from protein_performer.training.task import ProteinLM
    torch.manual_seed(0)
    task = ProteinLM(model=TINY_MODEL, objective="mlm").eval()
    evaluate_model(task, ["MKTAYIAKQRQISFVKSHFSRQ", "MLEERLGLIEVQ"], progress=True, desc="evaluate")
    err = capsys.readouterr().err
    assert "\r" not in err
    assert re.search(r"^evaluate: done [\d,]+/[\d,]+ tokens \| .*elapsed \d+:\d\d$", err, re.M), err

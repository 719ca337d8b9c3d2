"""Progress that reads well in a log file (issue 43 item 2, issue 45 item 5).

On a terminal the commands show what they showed before (Lightning's bar, tqdm's bar); when the
stream a bar would write to is not a terminal (``python scripts/train.py > train.log``) they
print one plain line every ``every`` updates or every ``seconds`` seconds, whichever comes first,
and a final line, never a carriage return::

    train: step 100/600 (17%) | loss 2.8731 | 4,812 tokens/s | elapsed 1:02 | ETA 5:10
    train: done 600/600 steps | loss 2.6012 | 4,770 tokens/s | elapsed 6:15

:class:`ProgressLines` is the helper (tqdm's ``update(n)`` / ``close()``, so a loop that drives a
tqdm bar drives it too; :func:`progress_bar` picks one of them); :class:`ProgressCallback` is the
one Lightning callback of every Lightning command (train, finetune): step lines, and with
``epochs=True`` one line per validation of a fit with the validation metric and the ETA (on a
terminal too: finetune shows no bar); :func:`lightning_progress` wires it in.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Callable, TextIO

import pytorch_lightning as pl
import torch

from ..errors import UserError

#: a progress line at most every EVERY updates (steps, batches) or SECONDS seconds, whichever first
EVERY = 50
SECONDS = 30.0


def check_progress(every, seconds, every_key: str = "progress_every", seconds_key: str = "progress_seconds") -> None:
    """The two settings: a non-negative integer (steps) and a non-negative number (seconds), or
    null; 0 or null turns that trigger off."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        raise UserError(f"{every_key}={every!r}: expected a non-negative integer (steps between progress lines; "
                        f"0: none by count)")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not seconds >= 0 or not math.isfinite(seconds)):
        raise UserError(f"{seconds_key}={seconds!r}: expected a non-negative number of seconds between progress "
                        f"lines (0: none by time)")


def is_terminal(stream: TextIO | None) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # a closed or odd stream
        return False


def duration(seconds: float | None) -> str:
    """``0:05``, ``3:05``, ``1:02:03``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _number(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if v >= 1 else f"{v:.2g}"


def _field(key: str, v) -> str:
    if isinstance(v, float):
        return f"{key} {v:.4f}" if math.isfinite(v) and abs(v) < 1e5 else f"{key} {v:.4g}"
    return f"{key} {v}"


class ProgressLines:
    """Plain progress lines for a log: ``update(n_items, **fields)`` counts ``n_items`` towards
    ``total`` and prints a line when ``every`` updates or ``seconds`` seconds passed since the
    last one (0 or None: that trigger off); ``close(**fields)`` prints the final line.

    ``what``: the line's prefix; ``unit``: what is counted (``step`` is shown as ``step k/N``, any
    other unit as ``k/N unit``); ``rated``: what the rate counts (``update``'s ``rated=``, e.g.
    tokens per step) and ``rate_unit`` its name, else the rate counts ``n_items``. The rate is
    since the last line; the ETA is the remaining items at the pace since the start. ``done``:
    items already done (a resume), not counted in the pace. ``write``: where a line goes (default:
    ``stream``, stdout, flushed). ``clock``: seconds (time.perf_counter; a test's fake).
    ``time_left``: seconds until a time limit ends the run (trainer.max_time), which caps the ETA."""

    def __init__(self, what: str, total: float | None = None, *, unit: str = "step", every: int | None = EVERY,
                 seconds: float | None = SECONDS, rate_unit: str | None = None, done: float = 0,
                 stream: TextIO | None = None, write: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, time_left: Callable[[], float | None] | None = None):
        self.time_left = time_left
        self.what, self.total, self.unit = what, total if total and total > 0 else None, unit
        self.every, self.seconds = int(every or 0), float(seconds or 0.0)
        self.rate_unit = rate_unit or (f"{unit}/s" if unit.endswith("s") else f"{unit}s/s")
        self.stream, self._write, self.clock = stream, write, clock
        self.start_done = self.done = done
        self.start = self.last_time = clock()
        self.updates = 0            # since the last line
        self.rated = self.last_rated = 0.0
        self.lines: list[str] = []  # what was printed
        self.closed = False

    # --- counting ----------------------------------------------------------------------
    def update(self, n_items: float = 1, *, rated=None, **fields) -> str | None:
        """Count ``n_items`` (and ``rated`` for the rate: a number, or a device tensor that is read only
        when a line is printed); the printed line, or None.  A field may be a callable, called only then
        (a training loop's mean loss: no device sync on the steps that print nothing)."""
        self.done += n_items
        # not +=: a tensor grown in place would grow last_rated, the same object, with it (0 tokens/s)
        self.rated = self.rated + (n_items if rated is None else rated)
        self.updates += 1
        now = self.clock()
        if (self.every and self.updates >= self.every) or (self.seconds and now - self.last_time >= self.seconds):
            fields = {k: v() if callable(v) else v for k, v in fields.items()}
            return self._emit(self.line(now, **fields), now)
        return None

    def elapsed(self, now: float | None = None) -> float:
        return (self.clock() if now is None else now) - self.start

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the pace since the start, at most ``time_left()`` (None: no total and no
        time limit, or nothing done yet)."""
        done = self.done - self.start_done
        eta = None if self.total is None or done <= 0 else max(self.total - self.done, 0) * self.elapsed(now) / done
        limit = self.time_left() if self.time_left is not None else None
        if limit is not None:
            eta = max(limit, 0.0) if eta is None else min(eta, max(limit, 0.0))
        return eta

    def rate(self, now: float | None = None, overall: bool = False) -> float | None:
        now = self.clock() if now is None else now
        seconds = now - (self.start if overall else self.last_time)
        items = float(self.rated - (0.0 if overall else self.last_rated))
        return items / seconds if seconds > 0 else None

    # --- lines -------------------------------------------------------------------------
    def count(self, done: float) -> str:
        shown = f"{done:,.0f}" if float(done).is_integer() else f"{done:,.1f}"
        of = "" if self.total is None else f"/{self.total:,.0f}"
        if self.unit == "step":
            return f"step {shown}{of}"
        return f"{shown}{of} {self.unit}"

    def line(self, now: float | None = None, **fields) -> str:
        now = self.clock() if now is None else now
        head = self.count(self.done)
        if self.total is not None:
            head += f" ({min(self.done / self.total, 1.0):.0%})"
        parts = [head, *(_field(k, v) for k, v in fields.items() if v is not None)]
        rate = self.rate(now)
        if rate is not None:
            parts.append(f"{_number(rate)} {self.rate_unit}")
        parts.append(f"elapsed {duration(self.elapsed(now))}")
        if self.total is not None or self.time_left is not None:
            parts.append(f"ETA {duration(self.eta(now))}")
        return f"{self.what}: " + " | ".join(parts)

    def final_line(self, now: float | None = None, **fields) -> str:
        now = self.clock() if now is None else now
        done = self.count(self.done)
        head = f"done {done}" if self.unit != "step" else f"done {done.removeprefix('step ')} steps"
        parts = [head, *(_field(k, v) for k, v in fields.items() if v is not None)]
        rate = self.rate(now, overall=True)
        if rate is not None and self.rated:
            parts.append(f"{_number(rate)} {self.rate_unit}")
        parts.append(f"elapsed {duration(self.elapsed(now))}")
        return f"{self.what}: " + " | ".join(parts)

    def close(self, **fields) -> str | None:
        """The final line (once)."""
        if self.closed:
            return None
        self.closed = True
        now = self.clock()
        return self._emit(self.final_line(now, **fields), now)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:  # a failure shows its own message, not a final line
            self.close()

    def _emit(self, text: str, now: float) -> str:
        self.updates, self.last_time, self.last_rated = 0, now, self.rated
        self.lines.append(text)
        if self._write is not None:
            self._write(text)
        else:
            stream = self.stream if self.stream is not None else sys.stdout
            stream.write(text + "\n")
            stream.flush()
        return text


def progress_bar(total: float | None, what: str, unit: str, *, stream: TextIO | None = None,
                 every: int | None = EVERY, seconds: float | None = SECONDS, tqdm_kw: dict | None = None):
    """tqdm's bar (``tqdm_kw``) on ``stream`` (default stderr) when it is a terminal, else
    :class:`ProgressLines` on it (a line every ``every`` updates or ``seconds`` seconds, counting
    ``unit``): both take ``update(n)`` and ``close()`` and are context managers."""
    stream = sys.stderr if stream is None else stream
    if is_terminal(stream):
        from tqdm.auto import tqdm
        return tqdm(total=total, desc=what, file=stream, **(tqdm_kw or {}))
    return ProgressLines(what, total, unit=unit, every=every, seconds=seconds, stream=stream)


# --- Lightning -------------------------------------------------------------------------------
def _tokens(batch):
    """Non-padding tokens of a batch (``padding_mask``: True at padding; a device tensor, not read here),
    else its tokens, else 0."""
    if isinstance(batch, dict):
        mask = batch.get("padding_mask")
        if mask is not None:
            return (~mask).sum()
        tokens = batch.get("tokens")
        if tokens is not None:
            return int(tokens.numel())
    return 0


def _loss(outputs) -> torch.Tensor | None:
    """The step's loss as a detached float32 tensor on its device (not read here: no sync per step)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if loss is None:
        return None
    try:
        return loss.detach().float().reshape(()) if hasattr(loss, "detach") else torch.tensor(float(loss))
    except (TypeError, ValueError, RuntimeError):
        return None


class ProgressCallback(pl.Callback):
    """The progress lines of a Lightning fit. ``steps``: a line every ``every`` optimizer steps or
    ``seconds`` seconds (step k/N, the mean training loss since the last line, tokens/s, elapsed,
    ETA) and a final line when the fit ends. ``epochs``: a line at each validation of the fit (the
    epoch, the training loss, ``monitor`` and its best so far, elapsed, ETA to ``max_epochs`` or
    ``max_steps``; and each logged metric named in ``also``). Rank zero prints; ``what`` prefixes the lines."""

    def __init__(self, what: str = "train", *, steps: bool = True, epochs: bool = False, every: int | None = EVERY,
                 seconds: float | None = SECONDS, monitor: str = "val/loss", stream: TextIO | None = None,
                 clock: Callable[[], float] = time.perf_counter, also: tuple[str, ...] = ()):
        self.what, self.steps, self.epochs, self.every, self.seconds = what, steps, epochs, every, seconds
        self.also = tuple(also)
        self.monitor, self.stream, self.clock = monitor, stream, clock
        self.lines: ProgressLines | None = None
        self.best: float | None = None

    def _write(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(text + "\n")
        stream.flush()

    @staticmethod
    def _total(trainer) -> int | None:
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        try:
            total = trainer.estimated_stepping_batches
        except Exception:  # noqa: BLE001 - an iterable dataset without a length: no total
            return None
        return int(total) if total is not None and math.isfinite(total) else None

    @staticmethod
    def _time_left(trainer) -> Callable[[], float | None] | None:
        """trainer.max_time's Timer: the seconds of training it leaves."""
        timer = next((c for c in trainer.callbacks if isinstance(c, pl.callbacks.Timer)), None)
        if timer is None or getattr(timer, "_duration", None) is None:
            return None
        return lambda: timer.time_remaining("train")

    def on_train_start(self, trainer, pl_module):
        self.start = self.clock()
        self.start_step = trainer.global_step
        self.last_step = trainer.global_step
        self.tokens = 0
        self.loss_sum, self.loss_n, self.shown_loss = 0.0, 0, None
        self.epoch_loss_sum, self.epoch_loss_n = 0.0, 0
        self.best = None
        self.lines = ProgressLines(self.what, self._total(trainer), unit="step", every=self.every,
                                   seconds=self.seconds, rate_unit="tokens/s", done=trainer.global_step,
                                   write=self._write, clock=self.clock, time_left=self._time_left(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.lines is None:
            return
        self.tokens += _tokens(batch) * trainer.world_size
        loss = _loss(outputs)
        if loss is not None:  # summed on the device, non-finite steps left out: read when a line prints
            finite = torch.isfinite(loss)
            loss = torch.where(finite, loss, 0.0)
            self.loss_sum, self.loss_n = self.loss_sum + loss, self.loss_n + finite
            self.epoch_loss_sum, self.epoch_loss_n = self.epoch_loss_sum + loss, self.epoch_loss_n + finite
        step = trainer.global_step
        if step == self.last_step:  # gradient accumulation: the step is not over yet
            return
        n, self.last_step = step - self.last_step, step
        tokens, self.tokens = self.tokens, 0
        if not (self.steps and trainer.is_global_zero):
            self.lines.done += n
            return
        shown = []

        def mean() -> float | None:
            shown.append(self._mean_loss())
            return shown[-1]
        if self.lines.update(n, rated=tokens, loss=mean) is not None:
            self.loss_sum, self.loss_n, self.shown_loss = 0.0, 0, shown[-1]

    def _mean_loss(self) -> float | None:
        n = int(self.loss_n)
        return float(self.loss_sum) / n if n else None

    def on_validation_end(self, trainer, pl_module):
        if not self.epochs or self.lines is None or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metric = trainer.callback_metrics.get(self.monitor)
        metric = None if metric is None else float(metric)
        if metric is not None and math.isfinite(metric) and (self.best is None or metric < self.best):
            self.best = metric
        if trainer.is_global_zero:
            self._write(self.epoch_line(trainer, metric))
        self.epoch_loss_sum, self.epoch_loss_n = 0.0, 0

    def epoch_line(self, trainer, metric: float | None) -> str:
        now = self.clock()
        elapsed = now - self.start
        epoch = trainer.current_epoch + 1
        max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        head = f"epoch {epoch}" + (f"/{max_epochs}" if max_epochs else "")
        parts = [head, f"step {trainer.global_step:,}"]
        if int(self.epoch_loss_n):
            parts.append(_field("train loss", float(self.epoch_loss_sum) / int(self.epoch_loss_n)))
        if metric is not None:
            parts.append(_field(self.monitor, metric) + ("" if self.best is None else f" (best {self.best:.4f})"))
        for name in self.also:
            if trainer.callback_metrics.get(name) is not None:
                parts.append(_field(name, float(trainer.callback_metrics[name])))
        parts.append(f"elapsed {duration(elapsed)}")
        eta = None
        steps_done = trainer.global_step - self.start_step
        if trainer.max_steps and trainer.max_steps > 0 and steps_done > 0:
            eta = max(trainer.max_steps - trainer.global_step, 0) * elapsed / steps_done
        elif max_epochs:
            eta = max(max_epochs - epoch, 0) * elapsed / epoch
        limit = self.lines.time_left() if self.lines.time_left is not None else None
        if limit is not None:
            eta = max(limit, 0.0) if eta is None else min(eta, max(limit, 0.0))
        if eta is not None:
            parts.append(f"ETA {duration(eta)} (at most: early stopping may end sooner)"
                         if any(isinstance(c, pl.callbacks.EarlyStopping) for c in trainer.callbacks)
                         else f"ETA {duration(eta)}")
        return f"{self.what}: " + " | ".join(parts)

    def on_train_end(self, trainer, pl_module):
        if self.lines is None or not self.steps:
            return
        if trainer.is_global_zero:
            mean = self._mean_loss()  # since the last line, else the last line's
            self.lines.close(loss=self.shown_loss if mean is None else mean)
        else:
            self.lines.closed = True


def lightning_progress(enable_progress_bar: bool, what: str, *, every: int | None = EVERY,
                       seconds: float | None = SECONDS, epochs: bool = False,
                       stream: TextIO | None = None, also: tuple[str, ...] = ()) -> tuple[bool, list[pl.Callback]]:
    """(``enable_progress_bar`` for the Trainer, callbacks to add). On a terminal (``stream``,
    default stdout, where Lightning's bar writes) the bar as configured; otherwise no bar and, when
    the bar was on, the step lines. ``epochs``: the per-validation lines too, terminal or not, with the
    metrics named in ``also`` beside the validation loss."""
    stream = sys.stdout if stream is None else stream
    terminal = is_terminal(stream)
    steps = bool(enable_progress_bar) and not terminal and bool(every or seconds)
    callbacks: list[pl.Callback] = []
    if steps or epochs:
        callbacks.append(ProgressCallback(what, steps=steps, epochs=epochs, every=every, seconds=seconds,
                                          stream=None if stream is sys.stdout else stream, also=also))
    return bool(enable_progress_bar) and terminal, callbacks

"""What every benchmark needs, in one place: running one configuration in a fresh child process
(so that its peak memory is its own), reading peak and current memory, timing a call with
warm-up and median, markdown tables, writing generated docs (keeping hand-written text below a
marker), and the anchor figures measured earlier, read from docs/anchors.md where their
provenance is written.

Imports nothing heavy (no torch), so a driver that only starts workers stays small.
"""
from __future__ import annotations

import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SAMPLE = ROOT / "data" / "sample" / "swissprot_sample_20k.fasta.gz"  # the bundled real proteins
ANCHORS = DOCS / "anchors.md"
KEEP_BELOW = "<!-- end of generated part: text below this line is kept when the benchmark rewrites the file -->"


# ----------------------------------------------------------------------------- child processes
@dataclass
class Child:
    """What a child process left: the JSON objects it printed (one a line on stdout), how it ended."""
    records: list[dict] = field(default_factory=list)
    returncode: int | None = None
    stderr: str = ""
    timed_out: bool = False
    timeout: float | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def reason(self) -> str:
        """Why it failed, in one line: the timeout, or the last line of its stderr, or its exit code."""
        if self.timed_out:
            return f"killed after {self.timeout:.0f} s"
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit {self.returncode}"


def run_child(script: str | Path, args: Sequence[str], *, timeout: float | None = None, env: dict | None = None,
              on_record: Callable[[dict], None] | None = None) -> Child:
    """Run ``python SCRIPT ARGS`` in a fresh process and collect every line of its stdout that is a
    JSON object, as it comes (``on_record`` is called with each). stderr goes to a temporary file
    (a full pipe cannot block the child); ``timeout`` seconds after the start the child is killed."""
    child = Child(timeout=timeout)
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)

        def kill() -> None:
            child.timed_out = True
            proc.kill()
        timer = threading.Timer(timeout, kill) if timeout else None
        if timer:
            timer.start()
        try:
            for line in proc.stdout:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    child.records.append(record)
                    if on_record:
                        on_record(record)
            child.returncode = proc.wait()
        finally:
            if timer:
                timer.cancel()
            if proc.poll() is None:  # interrupted: leave no orphan
                proc.kill()
                proc.wait()
        err.seek(0)
        child.stderr = err.read()
    return child


# ----------------------------------------------------------------------------- memory
def proc_memory(key: str) -> int:
    """A memory figure of this process from /proc/self/status in bytes: VmHWM (peak resident set),
    VmRSS (current), VmSize (address space). Linux only (OSError elsewhere)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB (VmHWM; ru_maxrss, the fallback off Linux,
    would carry over the parent's peak across fork + exec)."""
    try:
        return proc_memory("VmHWM") / 2 ** 20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """Resident set size of this process now, in MiB (nan where /proc is missing)."""
    try:
        return proc_memory("VmRSS") / 2 ** 20
    except OSError:
        return float("nan")


def reset_peak_rss() -> int:
    """Set the peak resident memory (VmHWM) back to the current one (Linux clear_refs 5), so that a
    later peak_rss_mib() is the peak of what follows; returns the current resident bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_memory("VmRSS")


# ----------------------------------------------------------------------------- timing
def seconds(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired_times(steps: dict, reps: int) -> dict:
    """Each of ``steps`` (key -> a call) timed in turn, round by round, ``reps`` rounds after a warm-up
    round: key -> its seconds (what a shared, noisy machine does to one it does to its neighbours)."""
    times = {key: [] for key in steps}
    for rep in range(reps + 1):
        for key, step in steps.items():
            t = seconds(step)
            if rep:
                times[key].append(t)
    return times


def paired_ratio(times: dict, num, den) -> float:
    """The median of the per-round ratios times[num] / times[den]."""
    r = sorted(a / b for a, b in zip(times[num], times[den]))
    return r[len(r) // 2]


class TooSlow(Exception):
    """A call took longer than the limit; ``seconds`` holds every call's time so far."""

    def __init__(self, seconds: list[float], limit: float):
        super().__init__(f"a call took {seconds[-1]:.0f} s > {limit:.0f} s")
        self.seconds, self.limit = seconds, limit


@dataclass
class Timing:
    warmup: list[float]  # seconds of the warm-up calls
    runs: list[float]    # seconds of the timed calls

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def best(self) -> float:
        return min(self.runs)

    @property
    def all(self) -> list[float]:
        return self.warmup + self.runs


def measure(fn: Callable[[], object], repeats: int, *, warmup: int = 1, limit_s: float | None = None) -> Timing:
    """``warmup`` calls of ``fn``, then ``repeats`` timed ones; every call's seconds are kept (the
    result's median / best are over the timed ones). Raises TooSlow as soon as one call, warm-up
    included, takes more than ``limit_s``."""
    times: list[float] = []
    for _ in range(warmup + repeats):
        times.append(seconds(fn))
        if limit_s is not None and times[-1] > limit_s:
            raise TooSlow(times, limit_s)
    return Timing(times[:warmup], times[warmup:])


# ----------------------------------------------------------------------------- markdown
def md_row(cells: Iterable[object]) -> str:
    """``| a | b |``; an empty cell is ``| |``."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def md_table(header: Sequence[object], rows: Iterable[Sequence[object]], align: str = "---") -> list[str]:
    """A markdown table as lines: header, separator (``align`` per column: ``---`` or ``---:``), rows."""
    return [md_row(header), "|" + "|".join([align] * len(header)) + "|", *(md_row(r) for r in rows)]


def read_md_table(path: str | Path, heading: str) -> list[dict[str, str]]:
    """The first table below the markdown heading ``heading`` (any level) of a file, as one dict a
    row (header cell -> cell text)."""
    lines = Path(path).read_text().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if re.fullmatch(r"#+\s+" + re.escape(heading) + r"\s*", line))
    except StopIteration:
        raise ValueError(f"{path}: no heading {heading!r}") from None
    table = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif table:
            break
    if len(table) < 2:
        raise ValueError(f"{path}: no table below {heading!r}")
    header = table[0]
    return [dict(zip(header, row)) for row in table[2:]]


def number(text: str) -> int | float:
    """'303' -> 303, '1.40' -> 1.4 (a cell of a doc table)."""
    text = text.strip().replace(",", "")
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


# ----------------------------------------------------------------------------- generated docs
def write_doc(path: str | Path, text: str, *, keep_below: bool = False) -> None:
    """Write a generated doc. Whatever stands below the KEEP_BELOW marker in the existing file is
    kept (hand-written analysis survives a rerun); ``keep_below`` writes the marker even when the
    file has none yet."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.is_file() else ""
    if KEEP_BELOW in old:
        text += "\n\n" + KEEP_BELOW + old.split(KEEP_BELOW, 1)[1]
    elif keep_below:
        text += "\n\n" + KEEP_BELOW + "\n"
    path.write_text(text)


def publish(lines: list[str], doc: str | Path | None, start: str, end: str) -> None:
    """Print a benchmark's table and, unless ``doc`` is None, put it between the doc's markers."""
    table = "\n".join(lines)
    print(table)
    if doc is not None and write_between(doc, start, end, table):
        print(f"\nwritten into {doc}")


def write_between(path: str | Path, start: str, end: str, text: str) -> bool:
    """Put ``text`` between the markers ``start`` and ``end`` of an existing doc (what stands below a
    KEEP_BELOW marker inside them is kept); False, writing nothing, when the file or a marker is missing."""
    path = Path(path)
    doc = path.read_text() if path.is_file() else ""
    if start not in doc or end not in doc:
        return False

    def replace(m: re.Match) -> str:
        kept = m.group(1).split(KEEP_BELOW, 1)[1] if KEEP_BELOW in m.group(1) else None
        return f"{start}\n{text}\n" + ("" if kept is None else f"\n{KEEP_BELOW}{kept}") + end
    path.write_text(re.sub(re.escape(start) + "(.*?)" + re.escape(end), replace, doc, count=1, flags=re.S))
    return True


def git_commit() -> str:
    """$GIT_COMMIT (a working tree copied to a GPU machine may have no .git), else git's short HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def command_line(script: str | Path, args: Sequence[str] | None = None, prefix: str = "python") -> str:
    """How a doc says it was made: ``PREFIX benchmarks/GROUP/NAME.py ARGS`` (the command line's args by default)."""
    path = Path(script).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return " ".join([prefix, str(shown), *map(shlex.quote, sys.argv[1:] if args is None else args)])


def cpu() -> str:
    """The processor's name, or the architecture where the platform does not tell it."""
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The 1-minute load average against the CPU count, e.g. '3.2 on 2 CPUs' ('unknown' off Unix)."""
    try:
        return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    except OSError:
        return "unknown"


# ----------------------------------------------------------------------------- anchors
def anchors(heading: str) -> list[dict[str, str]]:
    """A table of docs/anchors.md: figures measured earlier with other libraries (not rerun by the
    benchmarks), each with its provenance there."""
    return read_md_table(ANCHORS, heading)


def machine_anchors() -> dict[str, int | float]:
    """docs/anchors.md, 'Machine': id -> value (matmul rates, the RSS of Python + torch)."""
    return {row["id"]: number(row["value"]) for row in anchors("Machine")}

"""Python child processes without Python's start-up: ``python -c CODE ARGS`` or ``python SCRIPT ARGS``
run in a process forked from one interpreter that has already imported torch, Lightning, Hydra and
the package (and nothing more: no model built, no thread pool started, no Hydra state). Each child is
a real process of its own (its pid, its exit status or the signal that killed it, its files, its own
stdout and stderr), so what a test checks of a user's run (a kill -9 at a chosen point, what reaches
the disk, one line on stderr) is what a fresh ``subprocess.run([sys.executable, ...])`` shows; only
the ~5 s of imports each fresh process pays is paid once per test session.

Usage: ``forks().run([sys.executable, "-c", CODE, *args], cwd=..., env=..., timeout=...)`` ->
``subprocess.CompletedProcess`` (text stdout and stderr), as ``subprocess.run(..., capture_output=True,
text=True)`` gives; ``forks().popen(...)`` -> a child with ``pid``, ``poll()``, ``wait()``, ``send_signal()``,
``kill()``, and ``stdout``, ``stderr`` once it ended. The server starts on first use, one per test process."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: what the server imports before it forks: what takes the seconds (torch, torch._dynamo, torchmetrics,
#: scipy: most of Lightning's import time) and has no state a run could see. Not Lightning itself:
#: ``import pytorch_lightning`` adds its own log handler only where the root logger has none yet, so it
#: prints "GPU available: ..." or not by when it is imported (before or after Hydra set up logging);
#: a child imports it (0.1 s once the rest is here) at the point a new interpreter would.
PRELOAD = ("torch", "numpy", "h5py", "hydra", "omegaconf", "torch._dynamo", "torch.distributed", "torchmetrics",
           "scipy.signal", "scipy.stats", "protein_performer.cli", "protein_performer.commands",
           "protein_performer.hub.export", "protein_performer.embed")
#: what the preload must not import (see PRELOAD)
NOT_PRELOADED = ("pytorch_lightning", "lightning_fabric", "lightning", "wandb")

SERVER = r'''
import importlib, json, os, sys
omp = os.environ.get("OMP_NUM_THREADS")
for name in sys.argv[1].split(","):
    importlib.import_module(name)
early = [m for m in sys.argv[2].split(",") if m in sys.modules]
if early:
    raise SystemExit(f"the fork server's preload imported {early}: their import depends on when it happens")
channel_in, channel_out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
while True:
    line = channel_in.readline()
    if not line:
        os._exit(0)
    req = json.loads(line)
    channel_out.flush(); sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        break
    channel_out.write(json.dumps({"pid": pid}) + "\n"); channel_out.flush()
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    channel_out.write(json.dumps({"returncode": code}) + "\n"); channel_out.flush()

# the child: become `python ARGV` in req["cwd"] with req["env"]
channel_in.close(); channel_out.close()
os.chdir(req["cwd"])
os.environ.clear(); os.environ.update(req["env"])
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0); os.close(null)
for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
    if path is None:  # stderr=subprocess.STDOUT: the same open file as stdout, in order
        os.dup2(1, 2)
        continue
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(f, fd); os.close(f)
import random, runpy, types
import numpy
import torch
random.seed(); numpy.random.seed(); torch.seed()  # drawn afresh, as a new interpreter's are
if os.environ.get("OMP_NUM_THREADS") != omp:  # torch read it at import: what this child's setting gives
    want = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(want) if want else len(os.sched_getaffinity(0)))
argv = req["argv"]
del req, line, pid


def run():
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


# the ending of a Python process (Py_FinalizeEx: threads joined, atexit run, streams flushed, the exit
# status as SystemExit gives it), without tearing down the thousands of preloaded modules (~2 s)
import atexit, threading
try:
    run()
    code = 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1]
except BaseException:
    sys.excepthook(*sys.exc_info())
    code = 1
threading._shutdown()
atexit._run_exitfuncs()
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except Exception:
        pass
os._exit(code & 0xFF)
'''


class Child:
    """A forked child: like ``subprocess.Popen`` with ``stdout``/``stderr`` (text) read once it ended."""

    def __init__(self, server: "ForkServer", out: Path, err: Path):
        self._server, self._out, self._err = server, out, err
        self.pid = server._read()["pid"]
        self.returncode: int | None = None
        self.stdout = self.stderr = None

    def poll(self) -> int | None:
        if self.returncode is None and self._server._ready(0):
            self._end(self._server._read()["returncode"])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._server._ready(timeout):
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            self._end(self._server._read()["returncode"])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal
        self.send_signal(signal.SIGKILL)

    def _end(self, code: int) -> None:
        self.returncode = code
        self.stdout = self._out.read_text(errors="replace")
        self.stderr = self._err.read_text(errors="replace") if self._err else None
        self._server._busy = False


class ForkServer:
    """One interpreter with ``preload`` imported, forking a child per command (one at a time)."""

    def __init__(self, root: Path, preload=PRELOAD):
        self._tmp = tempfile.TemporaryDirectory(prefix="forkserver-")
        self._log = open(Path(self._tmp.name) / "server.log", "w")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        self._proc = subprocess.Popen([sys.executable, "-c", SERVER, ",".join(preload), ",".join(NOT_PRELOADED)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                      env=env)
        self._fd, self._buf = self._proc.stdout.fileno(), b""  # replies read unbuffered (select sees them)
        self._n, self._busy = 0, False

    def _ready(self, timeout: float | None) -> bool:
        """Whether a whole reply line is here (waiting up to ``timeout`` seconds; None: for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._fd], [], [], left)[0]:
                return False
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise RuntimeError(f"the fork server ended: {Path(self._log.name).read_text()[-3000:]}")
            self._buf += chunk
        return True

    def _read(self) -> dict:
        self._ready(None)
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def popen(self, cmd, cwd=None, env=None, stdout: Path | None = None, stderr=None) -> Child:
        """Start ``cmd`` (``[sys.executable, "-c", CODE, *args]`` or ``[sys.executable, SCRIPT, *args]``);
        ``stdout``: a file to write it into (default: one of the server's, read back); ``stderr``:
        ``subprocess.STDOUT`` to write it into the same open file as stdout."""
        cmd = [str(c) for c in cmd]
        assert cmd[0] == sys.executable and len(cmd) > 1, cmd
        assert not self._busy, "one forked child at a time"
        assert stderr in (None, subprocess.STDOUT), stderr
        self._n += 1
        out = Path(stdout) if stdout is not None else Path(self._tmp.name) / f"{self._n}.out"
        err = None if stderr == subprocess.STDOUT else Path(self._tmp.name) / f"{self._n}.err"
        req = dict(argv=cmd[1:], cwd=str(cwd or os.getcwd()), env=dict(os.environ if env is None else env),
                   stdout=str(out), stderr=None if err is None else str(err))
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        self._busy = True
        return Child(self, out, err)

    def run(self, cmd, cwd=None, env=None, timeout: float | None = None, check: bool = False, stdout=None,
            stderr=None, capture_output=True, text=True) -> subprocess.CompletedProcess:
        """``subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)``
        (``stdout``, ``stderr``: as for :meth:`popen`)."""
        assert text, "text output only"
        child = self.popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        r = subprocess.CompletedProcess([str(c) for c in cmd], child.returncode, child.stdout, child.stderr)
        if check:
            r.check_returncode()
        return r

    def close(self) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
        self._tmp.cleanup()


_SERVER: ForkServer | None = None


def forks() -> ForkServer:
    """This test process's fork server (started on first use, closed at exit)."""
    global _SERVER
    if _SERVER is None:
        import atexit
        _SERVER = ForkServer(Path(__file__).resolve().parents[1])
        atexit.register(_SERVER.close)
    return _SERVER

"""``protein-performer ARGS`` run in this process, through the console entry point itself
(:func:`protein_performer.cli.main`: Hydra's composition, ``hydra.main``, the run folder and the
``cli`` error wrapper), at a fraction of a subprocess's start-up cost."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from pathlib import Path


@contextlib.contextmanager
def _kept_logging():
    """Hydra configures logging for each job (handlers on the captured streams): put it back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in ("protein_performer", "pytorch_lightning",
                                                               "lightning", "lightning.pytorch")}
    try:
        yield
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                with contextlib.suppress(Exception):
                    h.close()
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)
        for name, lv in levels.items():
            logging.getLogger(name).setLevel(lv)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """``protein-performer ARGS`` in this process: (exit status, stdout, stderr). An exception that
    escapes (a bug) is reported as status 1 with its traceback in stderr, as the console would."""
    import traceback

    from protein_performer import cli
    argv = sys.argv[:]
    capsys.readouterr()
    code = 0
    try:
        with _kept_logging():
            cli.main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - what a user would see
        code = 1
        sys.stderr.write("Traceback (most recent call last):\n" + traceback.format_exc())
    finally:
        sys.argv[:] = argv
    out = capsys.readouterr()
    return code, out.out, out.err


def checksums(root: Path) -> dict[str, str]:
    """Every file under ``root`` -> its SHA-256 (folders: their names, so a removed empty one shows)."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}

"""The project's one user-facing error type, and the wrapper every command runs in.

A :class:`UserError` (or a subclass: ``ParseError``, ``InvalidSequenceError``,
``GenerationError``, ``DownloadError``, ...) is a problem with what the user asked for: a
missing or malformed file, a bad setting. Its message is one line naming the file (and
the record and line where there is one). :func:`cli` turns it, and the usual OS errors
about a path, into ``error: <message>`` on stderr and exit status 2; anything else is a
bug and keeps its traceback.
"""
from __future__ import annotations

import functools
import sys

EXIT_USER_ERROR = 2


class UserError(ValueError):
    """Bad input or settings, with a one-line message naming the file / record / line / key."""


#: what :func:`cli` reports in one line with exit status 2 (the rest are bugs: traceback);
#: FileExistsError / NotADirectoryError: an output path below a regular file
USER_ERRORS = (UserError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
               PermissionError)


def user_error(e: BaseException) -> BaseException | None:
    """``e``, or the exception it was raised from (``raise ... from``), when that is a user
    error: Hydra wraps what a ``_target_`` raised (``data.max_tokens=0``) in its own type."""
    while e is not None:
        if isinstance(e, USER_ERRORS):
            return e
        e = e.__cause__
    return None


def one_line(e: BaseException) -> str:
    """The message of ``e`` on one line (OS errors name their path)."""
    if isinstance(e, OSError) and getattr(e, "filename", None) and not isinstance(e, UserError):
        why = e.strerror or type(e).__name__
        return f"{e.filename}: {why[0].lower() + why[1:]}"
    text = " ".join(str(e).split()) or type(e).__name__
    return text


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``: what a library raised, short enough for one line."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def cli(main):
    """Decorator for a command's entry function (inside ``@hydra.main``): user errors exit 2
    with one line instead of a traceback."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as e:
            if (user := user_error(e)) is None:
                raise
            fail(one_line(user))
    return run


def fail(message: str) -> None:
    """Print ``error: message`` on stderr and exit with status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)

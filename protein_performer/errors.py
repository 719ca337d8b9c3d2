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
import re
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
    error: Hydra wraps what a ``_target_`` raised (``data.max_tokens=0``) in its own type.
    Lightning's and Hydra's own errors about a setting come back as a :class:`UserError`
    (:func:`library_error`)."""
    first = e
    while e is not None:
        if isinstance(e, USER_ERRORS):
            return e
        e = e.__cause__
    return library_error(first)


def library_error(e: BaseException) -> UserError | None:
    """What Lightning or Hydra raised about a setting, as one line naming the key: Lightning's
    ``MisconfigurationException`` (``trainer.max_steps=-5``, ``trainer=gpu`` without a GPU), and a
    ``_target_``'s constructor refusing an argument (``+trainer.max_step=3``), and Hydra's composition
    errors in a config a command composes itself (compare's ``models=[nope]``). Matched by class name:
    this module imports neither library. Anything else is None (a bug: its traceback stays)."""
    key = target = None
    while e is not None:
        names = {c.__name__ for c in type(e).__mro__}
        text = (str(e).strip().splitlines() or [""])[0]
        if "InstantiationException" in names:  # Hydra: "Error in call to target 'x.Y':\n...\nfull_key: trainer"
            found = re.search(r"full_key: (\S+)", str(e))
            key = found.group(1) if found else key
            found = re.search(r"target '([^']+)'", str(e))
            target = found.group(1) if found else target
        elif "MisconfigurationException" in names:
            return UserError(f"{key or 'trainer'}: {text}")
        elif names & {"MissingConfigException", "ConfigCompositionException", "OverrideParseException"}:
            return UserError(composition_message(e))  # a config a command composes (compare's models=[...])
        elif target is not None and isinstance(e, TypeError):
            arg = re.search(r"unexpected keyword argument '([^']+)'", text)
            if arg:
                return UserError(f"{key + '.' if key else ''}{arg.group(1)}: {target} takes no such argument"
                                 f"{_close_argument(target, arg.group(1))}")
            if "required positional argument" in text or "positional argument" in text:
                return UserError(f"{key or target}: {text}")
        e = e.__cause__
    return None


def composition_message(e: BaseException) -> str:
    """One line for Hydra's composition errors: the option that does not exist (with the choices), the
    override that does not parse, or Hydra's own text without its search path. Read by attribute:
    this module does not import Hydra."""
    options, missing = getattr(e, "options", None), getattr(e, "missing_cfg_file", None)
    if options and missing:
        group, _, name = missing.rpartition("/")
        return f"{group}={name}: no such option; choose one of {', '.join(options)}"
    if getattr(e, "override", None) is not None and getattr(e, "message", None):
        return f"{e.override}: not a valid override ({e.message.splitlines()[0]})"
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text.split("; Config search path:")[0] or type(e).__name__


def _close_argument(target: str, name: str) -> str:
    """`` (did you mean max_steps?)``: the closest of ``target``'s arguments, when it is imported."""
    import difflib
    import inspect
    module, _, attr = target.rpartition(".")
    try:
        params = list(inspect.signature(getattr(sys.modules[module], attr)).parameters)
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    close = difflib.get_close_matches(name, params, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


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

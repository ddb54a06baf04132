"""Errors colibri reports to users.

Every error a user can cause (bad model files, bad options, missing plugins) or that the
machine causes (a full disk, a read-only directory, no memory left) is a ColibriError:
the CLI prints its message on one line and exits non-zero, without a traceback. Anything
else escaping is a bug in colibri.

Exit statuses: 2 bad input (files, options, budget), 3 the environment (disk full,
read-only, out of memory), 130 interrupted (Ctrl-C), 70 a bug in colibri.
"""

import threading
from contextlib import contextmanager
from contextvars import ContextVar

# How messages spell an option: "--max-tokens" for the command line, "max_tokens=" for
# the Python API. The CLI switches it on while it runs; library callers see keywords.
_CLI_SPELLING: ContextVar[bool] = ContextVar("colibri_cli_spelling")
# cli_spelling blocks open in this process. A thread starts with an empty context, so the
# threads a command starts (expert reads, the server's loader and engine) would otherwise
# name keywords: they take the command's spelling from here.
_cli_blocks = 0
_cli_blocks_lock = threading.Lock()


@contextmanager
def cli_spelling():
    """Name options as command-line flags in messages raised inside this block, and in
    the threads started while it is open."""
    global _cli_blocks
    token = _CLI_SPELLING.set(True)
    with _cli_blocks_lock:
        _cli_blocks += 1
    try:
        yield
    finally:
        with _cli_blocks_lock:
            _cli_blocks -= 1
        _CLI_SPELLING.reset(token)


def option(name: str, *, keyword: bool = False) -> str:
    """``name`` (a keyword of ``load`` or ``generate``) as the caller wrote it: the flag
    on the command line, else the keyword (``name=`` with ``keyword``)."""
    if _CLI_SPELLING.get(_cli_blocks > 0):
        return f"--{name.replace('_', '-')}"
    return f"{name}=" if keyword else name


class ColibriError(Exception):
    """Base class of errors caused by input, configuration or environment."""

    exit_code = 2


class ModelFormatError(ColibriError):
    """A model directory, config or weight file is malformed or inconsistent."""


class NonFiniteError(ModelFormatError):
    """The model computed NaN, infinity or degenerate logits (damaged or absurd weights)."""


class UnsupportedModelError(ColibriError):
    """The model is well formed, but no installed family (or feature) handles it."""


class PluginError(ColibriError):
    """A plugin failed, or two plugins claim the same name."""


class BudgetError(ColibriError):
    """The requested placement (RAM budget, cache caps) cannot hold the model."""


class UsageError(ColibriError):
    """Bad options or arguments from the caller."""


class BackendError(UsageError):
    """The requested compute backend is not installed or cannot run on this machine."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the user should know (e.g. that a conversion resumes)."""


class ResourceError(ColibriError):
    """The machine refused: disk full, read-only file system, no memory or address space."""

    exit_code = 3


def write_error(exc: OSError, path, what: str) -> ColibriError:
    """The one-line error for an OSError while writing ``what`` to ``path``: the machine's
    refusal (disk full, quota, read-only, no memory) a ResourceError (exit 3), anything
    else (a directory in the way, no permission) a UsageError naming the path."""
    import errno

    machine = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOMEM)
    return (ResourceError if machine else UsageError)(f"{path}: cannot write {what}: {exc.strerror or exc}")


def out_of_memory(exc: BaseException) -> ResourceError | None:
    """The out-of-memory ResourceError for ``exc`` when it is the machine running out of
    memory or address space (MemoryError; a thread, or a shared library loaded late, that
    cannot be mapped), else None. An address-space limit (ulimit -v) shows as these."""
    import errno

    text = str(exc)
    if isinstance(exc, MemoryError):
        why = "out of memory"
    elif isinstance(exc, RuntimeError) and "can't start new thread" in text:
        why = "out of memory: cannot start a thread"
    elif isinstance(exc, (ImportError, OSError)) and "failed to map segment from shared object" in text:
        why = f"out of memory: cannot map a shared library ({getattr(exc, 'name', None) or text.split(':')[0]})"
    elif isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        why = f"out of memory: {exc.strerror}"
    else:
        return None
    return ResourceError(f"{why}; try a smaller {option('ram')} budget or {option('cap')}, or raise the memory limits")

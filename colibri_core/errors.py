"""Errors colibri reports to users.

Every error a user can cause (bad model files, bad options, missing plugins) or that the
machine causes (a full disk, a read-only directory, no memory left) is a ColibriError:
the CLI prints its message on one line and exits non-zero, without a traceback. Anything
else escaping is a bug in colibri.

Exit statuses: 2 bad input (files, options, budget), 3 the environment (disk full,
read-only, out of memory), 130 interrupted (Ctrl-C), 70 a bug in colibri.
"""

from contextlib import contextmanager
from contextvars import ContextVar

# How messages spell an option: "--max-tokens" for the command line, "max_tokens=" for
# the Python API. The CLI switches it on while it runs; library callers see keywords.
_CLI_SPELLING: ContextVar[bool] = ContextVar("colibri_cli_spelling", default=False)


@contextmanager
def cli_spelling():
    """Name options as command-line flags in messages raised inside this block."""
    token = _CLI_SPELLING.set(True)
    try:
        yield
    finally:
        _CLI_SPELLING.reset(token)


def option(name: str, *, keyword: bool = False) -> str:
    """``name`` (a keyword of ``load`` or ``generate``) as the caller wrote it: the flag
    on the command line, else the keyword (``name=`` with ``keyword``)."""
    if _CLI_SPELLING.get():
        return f"--{name.replace('_', '-')}"
    return f"{name}=" if keyword else name


class ColibriError(Exception):
    """Base class of errors caused by input, configuration or environment."""

    exit_code = 2


class ModelFormatError(ColibriError):
    """A model directory, config or weight file is malformed or inconsistent."""


class NonFiniteError(ModelFormatError):
    """The model computed NaN or infinity (damaged or absurd weights)."""


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

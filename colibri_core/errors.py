"""Errors colibri reports to users.

Every error a user can cause (bad model files, bad options, missing plugins) is a
ColibriError: the CLI prints its message on one line and exits non-zero, without a
traceback. Anything else escaping is a bug in colibri.
"""


class ColibriError(Exception):
    """Base class of errors caused by input, configuration or environment."""

    exit_code = 2


class ModelFormatError(ColibriError):
    """A model directory, config or weight file is malformed or inconsistent."""


class UnsupportedModelError(ColibriError):
    """The model is well formed, but no installed family (or feature) handles it."""


class PluginError(ColibriError):
    """A plugin failed, or two plugins claim the same name."""


class BudgetError(ColibriError):
    """The requested placement (RAM budget, cache caps) cannot hold the model."""


class UsageError(ColibriError):
    """Bad options or arguments from the caller."""

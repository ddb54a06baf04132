"""Warnings colibri gives while it keeps working (a mirror failing, a stale history).

They go through Python's ``warnings`` module with the category ``ColibriWarning``, so
library users can filter or capture them; the CLI prints each as one ``warning:`` line.
"""

import warnings


class ColibriWarning(UserWarning):
    pass


def warn(message: str) -> None:
    warnings.warn(message, ColibriWarning, stacklevel=2)

"""Cheap availability probes: they must not import the stacks they probe."""

import importlib.util


def cpu_unavailable_reason() -> str | None:
    if importlib.util.find_spec("numpy") is None:
        return "numpy is not installed"
    return None

"""colibri: run Mixture-of-Experts models larger than memory.

The package imports nothing heavy at import time; ``colibri_core.load`` and the model
API import numpy when first used.
"""

from colibri_core.plugins.hookspecs import hookimpl
from colibri_core.version import __version__

__all__ = ["hookimpl", "load", "__version__"]


def __getattr__(name):
    if name == "load":
        from colibri_core.engine.api import load

        return load
    raise AttributeError(f"module 'colibri_core' has no attribute {name!r}")

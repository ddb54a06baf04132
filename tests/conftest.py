import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_core.plugins.discovery import reset_manager

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_plugin_manager():
    """Each test sees plugins loaded anew (in-process registrations do not leak)."""
    reset_manager()
    yield
    reset_manager()


def run_colibri(*args, env=None, timeout=120, cwd=None):
    """Run the real command line in a subprocess; returns CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.pop("COLIBRI_DEBUG", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "colibri_core", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)

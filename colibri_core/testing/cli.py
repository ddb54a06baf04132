"""Running the real ``colibri`` command line from tests, in a child process.

Test suites import these from here rather than from a ``conftest.py``: several suites
are collected in one pytest session (core, families, backends, plugins) and each
directory's ``conftest`` module replaces the previous one in ``sys.modules``, so
``from conftest import ...`` reaches whichever was collected last.
"""

from __future__ import annotations

import os
import subprocess
import sys


def colibri_env(**extra) -> dict:
    """This process's environment without colibri's debug and API-key settings, plus ``extra``."""
    env = dict(os.environ)
    env.pop("COLIBRI_DEBUG", None)
    env.pop("COLIBRI_API_KEY", None)
    env.update(extra)
    return env


def run_colibri(*args, env=None, timeout=120, cwd=None, input=None) -> subprocess.CompletedProcess:
    """Run ``python -m colibri_core ARGS`` in a subprocess; returns the CompletedProcess (text).
    Its stdin is ``input``, else empty: never the test runner's, which ``colibri run``
    without a prompt would wait on."""
    return subprocess.run([sys.executable, "-m", "colibri_core", *map(str, args)], capture_output=True, text=True,
                          env=colibri_env(**(env or {})), timeout=timeout, cwd=cwd,
                          **({"input": input} if input is not None else {"stdin": subprocess.DEVNULL}))

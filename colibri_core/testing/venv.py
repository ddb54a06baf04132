"""A fresh virtual environment with distributions installed from a copy of this checkout,
for tests of what a user's ``pip install`` really gives (entry points, dependencies)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

IGNORED = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so")


@dataclass
class FreshVenv:
    root: Path

    @property
    def pip(self) -> Path:
        return self.root / "bin" / "pip"

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment without PYTHONPATH: the venv sees only what is
        installed in it (a development checkout on PYTHONPATH would add its plugins)."""
        return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def colibri(self, *args, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.root / "bin" / "colibri"), *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env=self.env)

    def families(self) -> list[dict]:
        out = self.colibri("list-families", "--json", timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def plugin_names(self) -> list[str]:
        return [p["name"] for p in json.loads(self.colibri("plugins", "--json", timeout=120).stdout)["plugins"]]

    def uninstall(self, distribution: str) -> None:
        subprocess.run([str(self.pip), "uninstall", "-q", "-y", distribution], check=True, timeout=300, env=self.env)


def fresh_venv(repo: Path, tmp_path: Path, *families: str) -> FreshVenv:
    """A new venv with colibri-core and the named ``families/`` distributions installed
    (non-editable, from a copy of ``repo``); fails the test with pip's error otherwise."""
    source = tmp_path / "src"
    shutil.copytree(repo, source, ignore=IGNORED)
    venv = FreshVenv(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv.root)], check=True)
    targets = [str(source)] + [str(source / "families" / name) for name in families]
    install = subprocess.run([str(venv.pip), "install", "-q", *targets], capture_output=True, text=True, timeout=1200,
                             env=venv.env)
    assert install.returncode == 0, install.stderr[-3000:]
    return venv

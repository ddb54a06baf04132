"""A fresh virtual environment with distributions installed from a copy of this checkout,
for tests of what a user's ``pip install`` really gives (entry points, dependencies)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

IGNORED = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so")
# the venv must see only what it installed, not the checkout the tests run from
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@dataclass
class FreshVenv:
    root: Path
    # set for the colibri commands beyond ENV, while a test needs it (no Vulkan driver, say)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pip(self) -> Path:
        return self.root / "bin" / "pip"

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def colibri(self, *args, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.root / "bin" / "colibri"), *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env={**ENV, **self.env})

    def imports(self, module: str) -> bool:
        """Whether ``import module`` succeeds in the venv."""
        run = subprocess.run([str(self.python), "-c", f"import {module}"], capture_output=True, text=True, env=ENV,
                             timeout=120)
        assert run.returncode == 0 or f"No module named {module!r}" in run.stderr, run.stderr[-3000:]
        return run.returncode == 0

    def greedy_tokens(self, model_dir: Path, prompt: list[int], count: int) -> list[int]:
        """The token ids ``colibri run`` generates greedily from ``prompt``, one cached
        expert per layer (on a copy of ``model_dir``: a run writes its routing history
        next to the model)."""
        copy = self.root.parent / f"{model_dir.name}-run"
        shutil.copytree(model_dir, copy)
        run = self.colibri("run", "--model", copy, "--token-ids", ",".join(map(str, prompt)), "--max-tokens", count,
                           "--ignore-eos", "--cap", "1", "--json")
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout)["token_ids"]

    def families(self) -> list[dict]:
        out = self.colibri("list-families", "--json", timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def backends(self) -> dict[str, dict]:
        out = self.colibri("list-backends", "--json", timeout=120)
        assert out.returncode == 0, out.stderr
        return {row["backend"]: row for row in json.loads(out.stdout)}

    def plugin_names(self) -> list[str]:
        return [p["name"] for p in json.loads(self.colibri("plugins", "--json", timeout=120).stdout)["plugins"]]

    def uninstall(self, distribution: str) -> None:
        subprocess.run([str(self.pip), "uninstall", "-q", "-y", distribution], check=True, timeout=300, env=ENV)


def fresh_venv(repo: Path, tmp_path: Path, *families: str, paths: tuple[str, ...] = ()) -> FreshVenv:
    """A new venv with colibri-core and the named ``families/`` distributions installed
    (non-editable, from a copy of ``repo``), plus ``paths``: other distributions of the
    repository as pip requirements relative to its root (``"backends/colibri-mlx[cpu]"``);
    fails the test with pip's error otherwise."""
    source = tmp_path / "src"
    shutil.copytree(repo, source, ignore=IGNORED)
    venv = FreshVenv(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv.root)], check=True)
    targets = [str(source)] + [str(source / "families" / name) for name in families] + [str(source / p) for p in paths]
    install = subprocess.run([str(venv.pip), "install", "-q", *targets], capture_output=True, text=True, timeout=1200,
                             env=ENV)
    assert install.returncode == 0, install.stderr[-3000:]
    return venv

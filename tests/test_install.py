"""A fresh virtual environment: install colibri-core and colibri-olmoe from this
checkout, find the family through its entry point, uninstall it, see it gone."""

import json
import shutil
import subprocess
import sys

from conftest import REPO


def test_fresh_venv_install_discovers_and_uninstall_removes_the_family(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip, colibri = venv / "bin" / "pip", venv / "bin" / "colibri"
    install = subprocess.run([str(pip), "install", "-q", str(source), str(source / "families" / "colibri-olmoe")],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-3000:]

    def families():
        out = subprocess.run([str(colibri), "list-families", "--json"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return {row["family"]: row for row in json.loads(out.stdout)}

    listed = families()
    assert listed["olmoe"]["distribution"] == "colibri-olmoe" and listed["olmoe"]["model_types"] == ["olmoe"]
    assert listed["olmoe"]["version"] == "0.1.0"

    subprocess.run([str(pip), "uninstall", "-q", "-y", "colibri-olmoe"], check=True, timeout=300)
    assert "olmoe" not in families()
    plugins = subprocess.run([str(colibri), "plugins", "--json"], capture_output=True, text=True, timeout=120)
    assert [p["name"] for p in json.loads(plugins.stdout)["plugins"]] == ["colibri-core"]

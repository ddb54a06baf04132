"""A fresh virtual environment: install colibri-core and colibri-qwen from this checkout,
see the four Qwen model types listed, uninstall colibri-qwen, see them gone."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MODEL_TYPES = {"qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe"}


def test_fresh_venv_lists_the_four_model_types_and_uninstall_removes_them(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip, colibri = venv / "bin" / "pip", venv / "bin" / "colibri"
    install = subprocess.run([str(pip), "install", "-q", str(source), str(source / "families" / "colibri-qwen")],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-3000:]

    def families():
        out = subprocess.run([str(colibri), "list-families", "--json"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    rows = families()
    assert {t for row in rows for t in row["model_types"]} == MODEL_TYPES
    assert {row["distribution"] for row in rows} == {"colibri-qwen"} and all(row["status"] == "ok" for row in rows)

    subprocess.run([str(pip), "uninstall", "-q", "-y", "colibri-qwen"], check=True, timeout=300)
    assert families() == []
    plugins = subprocess.run([str(colibri), "plugins", "--json"], capture_output=True, text=True, timeout=120)
    assert [p["name"] for p in json.loads(plugins.stdout)["plugins"]] == ["colibri-core"]

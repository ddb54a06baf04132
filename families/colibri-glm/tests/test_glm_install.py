"""A fresh virtual environment with colibri-core and colibri-glm only (no
colibri-deepseek): the three GLM model types are listed, and a tiny GLM-5 model (MLA,
DSA with a shared indexer layer) runs through the command line with transformers'
tokens, because the shared blocks live in the core."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from colibri_core.testing.oracle import oracle_fixture

import test_glm_moe_dsa_oracle as dsa_suite

REPO = Path(__file__).resolve().parents[3]


def test_root_plus_colibri_glm_alone_installs_and_runs_glm5(tmp_path, tmp_path_factory):
    suite, name = dsa_suite.TestGlmMoeDsaOracle, "shared_top4"
    root = tmp_path_factory.getbasetemp() / "oracles"
    root.mkdir(exist_ok=True)
    fx = oracle_fixture(suite.__name__, name, suite.cases[name], suite.model_class, root)

    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip, python, colibri = venv / "bin" / "pip", venv / "bin" / "python", venv / "bin" / "colibri"
    install = subprocess.run([str(pip), "install", "-q", str(source), str(source / "families" / "colibri-glm")],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-3000:]
    missing = subprocess.run([str(python), "-c", "import colibri_deepseek"], capture_output=True, text=True)
    assert missing.returncode != 0 and "No module named 'colibri_deepseek'" in missing.stderr

    out = subprocess.run([str(colibri), "list-families", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    listed = {row["family"]: row for row in json.loads(out.stdout)}
    assert {f: listed[f]["model_types"] for f in ("glm4-moe", "glm4-moe-lite", "glm-moe-dsa")} == {
        "glm4-moe": ["glm4_moe"], "glm4-moe-lite": ["glm4_moe_lite"], "glm-moe-dsa": ["glm_moe_dsa"]}
    assert all(listed[f]["distribution"] == "colibri-glm" for f in ("glm4-moe", "glm4-moe-lite", "glm-moe-dsa"))

    model_dir = tmp_path / "glm5"  # a copy: the run writes its routing history next to the model
    shutil.copytree(fx.path, model_dir)
    run = subprocess.run([str(colibri), "run", "--model", str(model_dir), "--token-ids", ",".join(map(str, fx.prompt)),
                          "--max-tokens", str(len(fx.tokens)), "--ignore-eos", "--cap", "1", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["token_ids"] == fx.tokens

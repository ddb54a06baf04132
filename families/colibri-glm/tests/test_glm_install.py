"""A fresh virtual environment with colibri-core and colibri-glm only (no
colibri-deepseek): the three GLM model types are listed, and a tiny GLM-5 model (MLA,
DSA with a shared indexer layer) runs through the command line with transformers'
tokens, because the shared blocks live in the core."""

import json
import shutil
import subprocess
from pathlib import Path

from colibri_core.testing.venv import fresh_venv

import test_glm_moe_dsa_oracle as dsa_suite

REPO = Path(__file__).resolve().parents[3]


def test_root_plus_colibri_glm_alone_installs_and_runs_glm5(tmp_path, tmp_path_factory):
    fx = dsa_suite.TestGlmMoeDsaOracle.oracle("shared_top4", tmp_path_factory)

    venv = fresh_venv(REPO, tmp_path, "colibri-glm")
    missing = subprocess.run([str(venv.python), "-c", "import colibri_deepseek"], capture_output=True, text=True, env=venv.env)
    assert missing.returncode != 0 and "No module named 'colibri_deepseek'" in missing.stderr

    listed = {row["family"]: row for row in venv.families()}
    assert {f: listed[f]["model_types"] for f in ("glm4-moe", "glm4-moe-lite", "glm-moe-dsa")} == {
        "glm4-moe": ["glm4_moe"], "glm4-moe-lite": ["glm4_moe_lite"], "glm-moe-dsa": ["glm_moe_dsa"]}
    assert all(listed[f]["distribution"] == "colibri-glm" for f in ("glm4-moe", "glm4-moe-lite", "glm-moe-dsa"))

    model_dir = tmp_path / "glm5"  # a copy: the run writes its routing history next to the model
    shutil.copytree(fx.path, model_dir)
    run = venv.colibri("run", "--model", model_dir, "--token-ids", ",".join(map(str, fx.prompt)),
                       "--max-tokens", len(fx.tokens), "--ignore-eos", "--cap", "1", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["token_ids"] == fx.tokens

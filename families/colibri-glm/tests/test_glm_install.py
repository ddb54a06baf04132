"""A fresh virtual environment with colibri-core and colibri-glm only (no
colibri-deepseek): the four GLM model types are listed, and a tiny GLM-5 model (MLA,
DSA with a shared indexer layer) runs through the command line with transformers'
tokens, because the shared blocks live in the core."""

from pathlib import Path

import pytest

from colibri_core.testing.venv import fresh_venv

import test_glm_moe_dsa_oracle as dsa_suite

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_root_plus_colibri_glm_alone_installs_and_runs_glm5(tmp_path, tmp_path_factory):
    fx = dsa_suite.TestGlmMoeDsaOracle.oracle("shared_top4", tmp_path_factory)

    venv = fresh_venv(REPO, tmp_path, "colibri-glm")
    assert not venv.imports("colibri_deepseek")

    listed = {row["family"]: row for row in venv.families()}
    families = ("glm4-moe", "glm4-moe-lite", "glm-moe-dsa", "glm5-next")
    assert {f: listed[f]["model_types"] for f in families} == {
        "glm4-moe": ["glm4_moe"], "glm4-moe-lite": ["glm4_moe_lite"], "glm-moe-dsa": ["glm_moe_dsa"],
        "glm5-next": ["glm5_next"]}
    assert all(listed[f]["distribution"] == "colibri-glm" for f in families)
    assert venv.greedy_tokens(fx.path, fx.prompt, len(fx.tokens)) == fx.tokens

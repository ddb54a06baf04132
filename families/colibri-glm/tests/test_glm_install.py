"""A fresh virtual environment with colibri-core and colibri-glm only (no
colibri-deepseek): the four GLM model types are listed, and a tiny GLM-5 model (MLA,
DSA with a shared indexer layer) runs through the command line with transformers'
tokens, because the shared blocks live in the core."""

from pathlib import Path

import pytest

from colibri_core.testing.install import check_family_install

import test_glm_moe_dsa_oracle as dsa_suite


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_root_plus_colibri_glm_alone_installs_and_runs_glm5(tmp_path, tmp_path_factory):
    fx = dsa_suite.TestGlmMoeDsaOracle.oracle("shared_top4", tmp_path_factory)
    families = {"glm-moe-dsa": ["glm_moe_dsa"], "glm4-moe": ["glm4_moe"], "glm4-moe-lite": ["glm4_moe_lite"],
                "glm5-next": ["glm5_next"]}
    check_family_install(Path(__file__).resolve().parents[1], tmp_path, families, fx, without=("colibri_deepseek",))

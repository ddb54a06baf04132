"""A fresh virtual environment with colibri-core and colibri-gpt-oss only: gpt_oss is
listed, and a tiny gpt-oss model runs through the command line with transformers' tokens."""

from pathlib import Path

import pytest

from colibri_core.testing.install import check_family_install

import test_gpt_oss_oracle as suites


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_root_plus_colibri_gpt_oss_alone_installs_and_runs(tmp_path, tmp_path_factory):
    fx = suites.TestGptOssOracle.oracle("yarn_gqa_clamped", tmp_path_factory)
    check_family_install(Path(__file__).resolve().parents[1], tmp_path, {"gpt_oss": ["gpt_oss"]}, fx,
                         without=("colibri_olmoe",))

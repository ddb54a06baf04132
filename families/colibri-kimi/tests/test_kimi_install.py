"""A fresh virtual environment with colibri-core and colibri-kimi only (no
colibri-deepseek): the Kimi model types (Kimi Linear's included) are listed, and a tiny Kimi K2.5 model runs
through the command line with transformers' tokens, because DeepSeek-V3's defaults and
blocks live in the core."""

from pathlib import Path

import pytest

from colibri_core.testing.install import check_family_install

import test_kimi_oracle as suites


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_root_plus_colibri_kimi_alone_installs_and_runs_k25(tmp_path, tmp_path_factory):
    fx = suites.TestKimiK25Oracle.oracle("tied", tmp_path_factory)
    families = {"kimi": ["kimi_k2", "kimi_k25"], "kimi_linear": ["kimi_linear"]}
    check_family_install(Path(__file__).resolve().parents[1], tmp_path, families, fx, without=("colibri_deepseek",))

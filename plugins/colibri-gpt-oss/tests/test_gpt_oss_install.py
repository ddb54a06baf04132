"""A fresh virtual environment with colibri-core and colibri-gpt-oss only: gpt_oss is
listed, and a tiny gpt-oss model runs through the command line with transformers' tokens."""

from pathlib import Path

import pytest

from colibri_core.testing.venv import fresh_venv

import test_gpt_oss_oracle as suites

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_root_plus_colibri_gpt_oss_alone_installs_and_runs(tmp_path, tmp_path_factory):
    fx = suites.TestGptOssOracle.oracle("yarn_gqa_clamped", tmp_path_factory)

    venv = fresh_venv(REPO, tmp_path, paths=("plugins/colibri-gpt-oss",))
    assert not venv.imports("colibri_olmoe")

    rows = venv.families()
    assert [(row["family"], row["model_types"], row["distribution"]) for row in rows] == [
        ("gpt_oss", ["gpt_oss"], "colibri-gpt-oss")]
    assert venv.greedy_tokens(fx.path, fx.prompt, len(fx.tokens)) == fx.tokens

"""A fresh virtual environment with colibri-core and colibri-kimi only (no
colibri-deepseek): the Kimi model types (Kimi Linear's included) are listed, and a tiny Kimi K2.5 model runs
through the command line with transformers' tokens, because DeepSeek-V3's defaults and
blocks live in the core."""

from pathlib import Path

import pytest

from colibri_core.testing.venv import fresh_venv

import test_kimi_oracle as suites

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_root_plus_colibri_kimi_alone_installs_and_runs_k25(tmp_path, tmp_path_factory):
    fx = suites.TestKimiK25Oracle.oracle("tied", tmp_path_factory)

    venv = fresh_venv(REPO, tmp_path, "colibri-kimi")
    assert not venv.imports("colibri_deepseek")

    rows = venv.families()
    assert [(row["family"], row["model_types"], row["distribution"]) for row in rows] == [
        ("kimi", ["kimi_k2", "kimi_k25"], "colibri-kimi"), ("kimi_linear", ["kimi_linear"], "colibri-kimi")]
    assert venv.greedy_tokens(fx.path, fx.prompt, len(fx.tokens)) == fx.tokens

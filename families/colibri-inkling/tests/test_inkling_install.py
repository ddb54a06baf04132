"""A fresh virtual environment with colibri-core and colibri-inkling only: the Inkling
model types are listed, and a tiny Inkling model runs through the command line with
transformers' tokens, because its blocks live in the core."""

from pathlib import Path

import pytest

from colibri_core.testing.venv import fresh_venv

import test_inkling_oracle as suites

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_root_plus_colibri_inkling_alone_installs_and_runs(tmp_path, tmp_path_factory):
    fx = suites.TestInklingOracle.oracle("hybrid", tmp_path_factory)

    venv = fresh_venv(REPO, tmp_path, "colibri-inkling")
    rows = venv.families()
    assert [(row["family"], row["model_types"], row["distribution"]) for row in rows] == [
        ("inkling", ["inkling_text", "inkling_mm_model"], "colibri-inkling")]
    assert venv.greedy_tokens(fx.path, fx.prompt, len(fx.tokens)) == fx.tokens

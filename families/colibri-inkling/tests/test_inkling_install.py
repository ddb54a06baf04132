"""A fresh virtual environment with colibri-core and colibri-inkling only: the Inkling
model types are listed, and a tiny Inkling model runs through the command line with
transformers' tokens, because its blocks live in the core."""

from pathlib import Path

import pytest

from colibri_core.testing.install import check_family_install

import test_inkling_oracle as suites


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_root_plus_colibri_inkling_alone_installs_and_runs(tmp_path, tmp_path_factory):
    fx = suites.TestInklingOracle.oracle("hybrid", tmp_path_factory)
    families = {"inkling": ["inkling_text", "inkling_mm_model"]}
    check_family_install(Path(__file__).resolve().parents[1], tmp_path, families, fx)

"""A fresh virtual environment: install colibri-core and colibri-olmoe from this
checkout, find the family through its entry point, uninstall it, see it gone."""

from pathlib import Path

import pytest

from colibri_core.testing.venv import fresh_venv

REPO = Path(__file__).resolve().parents[1]



@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_fresh_venv_install_discovers_and_uninstall_removes_the_family(tmp_path):
    venv = fresh_venv(REPO, tmp_path, "colibri-olmoe")
    listed = {row["family"]: row for row in venv.families()}
    assert listed["olmoe"]["distribution"] == "colibri-olmoe" and listed["olmoe"]["model_types"] == ["olmoe"]
    assert listed["olmoe"]["version"] == "0.1.0"

    venv.uninstall("colibri-olmoe")
    assert "olmoe" not in {row["family"] for row in venv.families()}
    assert venv.plugin_names() == ["colibri-core"]

"""A fresh virtual environment: install colibri-core and colibri-qwen from this checkout,
see the six Qwen model types listed, uninstall colibri-qwen, see them gone."""

from pathlib import Path

import pytest

from colibri_core.testing.venv import fresh_venv

REPO = Path(__file__).resolve().parents[3]
MODEL_TYPES = {"qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl_moe"}


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_fresh_venv_lists_the_model_types_and_uninstall_removes_them(tmp_path):
    venv = fresh_venv(REPO, tmp_path, "colibri-qwen")
    rows = venv.families()
    assert {t for row in rows for t in row["model_types"]} == MODEL_TYPES
    assert {row["distribution"] for row in rows} == {"colibri-qwen"} and all(row["status"] == "ok" for row in rows)

    venv.uninstall("colibri-qwen")
    assert venv.families() == []
    assert venv.plugin_names() == ["colibri-core"]

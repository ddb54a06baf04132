"""Installed (pip install -e '.[test]'), the distribution registers its families through the
``colibri`` entry point: ``colibri list-families`` lists them."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_minimax_m2_and_minimax():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "minimax_m2" in rows, f"minimax_m2 is not registered (is colibri-minimax installed?): {sorted(rows)}"
    assert rows["minimax_m2"]["model_types"] == ["minimax_m2"]
    assert rows["minimax_m2"]["distribution"] == "colibri-minimax"
    assert rows["minimax_m2"]["status"] == "ok"
    assert "minimax" in rows, f"minimax is not registered: {sorted(rows)}"
    assert rows["minimax"]["model_types"] == ["minimax"]
    assert rows["minimax"]["distribution"] == "colibri-minimax"
    assert rows["minimax"]["status"] == "ok"

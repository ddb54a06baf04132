"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_lfm2_moe():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "lfm2_moe" in rows, f"lfm2_moe is not registered (is colibri-liquid installed?): {sorted(rows)}"
    assert rows["lfm2_moe"]["model_types"] == ["lfm2_moe"]
    assert rows["lfm2_moe"]["distribution"] == "colibri-liquid"
    assert rows["lfm2_moe"]["status"] == "ok"

"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_hunyuan_v1_moe():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "hunyuan_v1_moe" in rows, f"hunyuan_v1_moe is not registered (is colibri-hunyuan installed?): {sorted(rows)}"
    assert rows["hunyuan_v1_moe"]["model_types"] == ["hunyuan_v1_moe"]
    assert rows["hunyuan_v1_moe"]["distribution"] == "colibri-hunyuan"
    assert rows["hunyuan_v1_moe"]["status"] == "ok"

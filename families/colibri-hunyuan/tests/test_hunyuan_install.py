"""Installed (pip install -e '.[test]'), the distribution registers its families through the
``colibri`` entry point: ``colibri list-families`` lists them."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_hunyuan_families():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    ours = {name for name, row in rows.items() if row["distribution"] == "colibri-hunyuan"}
    assert ours == {"hunyuan_v1_moe", "hy_v3"}, f"colibri-hunyuan registers {sorted(ours)} (is it installed?): {sorted(rows)}"
    for name in ours:
        assert rows[name]["model_types"] == [name]
        assert rows[name]["status"] == "ok"

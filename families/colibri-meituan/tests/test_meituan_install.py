"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_longcat_flash():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "longcat_flash" in rows, f"longcat_flash is not registered (is colibri-meituan installed?): {sorted(rows)}"
    assert rows["longcat_flash"]["model_types"] == ["longcat_flash"]
    assert rows["longcat_flash"]["distribution"] == "colibri-meituan"
    assert rows["longcat_flash"]["status"] == "ok"

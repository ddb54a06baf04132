"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_dots1():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "dots1" in rows, f"dots1 is not registered (is colibri-rednote installed?): {sorted(rows)}"
    assert rows["dots1"]["model_types"] == ["dots1"]
    assert rows["dots1"]["distribution"] == "colibri-rednote"
    assert rows["dots1"]["status"] == "ok"

"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_solar_open():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "solar_open" in rows, f"solar_open is not registered (is colibri-upstage installed?): {sorted(rows)}"
    assert rows["solar_open"]["model_types"] == ["solar_open"]
    assert rows["solar_open"]["distribution"] == "colibri-upstage"
    assert rows["solar_open"]["status"] == "ok"

"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_granitemoe():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "granitemoe" in rows and "granitemoeshared" in rows, f"granitemoe is not registered (is colibri-ibm installed?): {sorted(rows)}"
    assert rows["granitemoe"]["model_types"] == ["granitemoe"]
    assert rows["granitemoeshared"]["model_types"] == ["granitemoeshared"]
    assert rows["granitemoe"]["distribution"] == "colibri-ibm"
    assert rows["granitemoe"]["status"] == "ok"

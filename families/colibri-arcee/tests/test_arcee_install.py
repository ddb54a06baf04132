"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_afmoe():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "afmoe" in rows, f"afmoe is not registered (is colibri-arcee installed?): {sorted(rows)}"
    assert rows["afmoe"]["model_types"] == ["afmoe"]
    assert rows["afmoe"]["distribution"] == "colibri-arcee"
    assert rows["afmoe"]["status"] == "ok"

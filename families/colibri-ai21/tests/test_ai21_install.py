"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_jamba():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "jamba" in rows, f"jamba is not registered (is colibri-ai21 installed?): {sorted(rows)}"
    assert rows["jamba"]["model_types"] == ["jamba"]
    assert rows["jamba"]["distribution"] == "colibri-ai21"
    assert rows["jamba"]["status"] == "ok"

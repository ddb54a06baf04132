"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_mixtral():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "mixtral" in rows, f"mixtral is not registered (is colibri-mistral installed?): {sorted(rows)}"
    assert rows["mixtral"]["model_types"] == ["mixtral"]
    assert rows["mixtral"]["distribution"] == "colibri-mistral"
    assert rows["mixtral"]["status"] == "ok"

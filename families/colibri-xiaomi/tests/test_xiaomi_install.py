"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_mimo_v2_flash():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "mimo_v2_flash" in rows, f"mimo_v2_flash is not registered (is colibri-xiaomi installed?): {sorted(rows)}"
    assert rows["mimo_v2_flash"]["model_types"] == ["mimo_v2_flash"]
    assert rows["mimo_v2_flash"]["distribution"] == "colibri-xiaomi"
    assert rows["mimo_v2_flash"]["status"] == "ok"

"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_exaone_moe():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "exaone_moe" in rows, f"exaone_moe is not registered (is colibri-lg installed?): {sorted(rows)}"
    assert rows["exaone_moe"]["model_types"] == ["exaone_moe"]
    assert rows["exaone_moe"]["distribution"] == "colibri-lg"
    assert rows["exaone_moe"]["status"] == "ok"

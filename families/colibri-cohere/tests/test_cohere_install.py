"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_cohere2_moe():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "cohere2_moe" in rows, f"cohere2_moe is not registered (is colibri-cohere installed?): {sorted(rows)}"
    assert rows["cohere2_moe"]["model_types"] == ["cohere2_moe"]
    assert rows["cohere2_moe"]["distribution"] == "colibri-cohere"
    assert rows["cohere2_moe"]["status"] == "ok"

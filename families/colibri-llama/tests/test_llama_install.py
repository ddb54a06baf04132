"""Installed (pip install -e '.[test]'), the distribution registers its families through
the ``colibri`` entry point: ``colibri list-families`` lists them."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_llama4():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    for family in ("llama4_text", "llama4"):
        assert family in rows, f"{family} is not registered (is colibri-llama installed?): {sorted(rows)}"
        assert rows[family]["model_types"] == [family]
        assert rows[family]["distribution"] == "colibri-llama"
        assert rows[family]["status"] == "ok"

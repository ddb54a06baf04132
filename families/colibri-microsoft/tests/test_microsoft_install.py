"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_phimoe():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "phimoe" in rows, f"phimoe is not registered (is colibri-microsoft installed?): {sorted(rows)}"
    assert rows["phimoe"]["model_types"] == ["phimoe"]
    assert rows["phimoe"]["distribution"] == "colibri-microsoft"
    assert rows["phimoe"]["status"] == "ok"

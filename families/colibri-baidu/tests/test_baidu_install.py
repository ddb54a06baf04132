"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_ernie4_5_moe():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "ernie4_5_moe" in rows, f"ernie4_5_moe is not registered (is colibri-baidu installed?): {sorted(rows)}"
    assert rows["ernie4_5_moe"]["model_types"] == ["ernie4_5_moe"]
    assert rows["ernie4_5_moe"]["distribution"] == "colibri-baidu"
    assert rows["ernie4_5_moe"]["status"] == "ok"

"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows_nemotron_h():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "nemotron_h" in rows, f"nemotron_h is not registered (is colibri-nvidia installed?): {sorted(rows)}"
    assert rows["nemotron_h"]["model_types"] == ["nemotron_h"]
    assert rows["nemotron_h"]["distribution"] == "colibri-nvidia"
    assert rows["nemotron_h"]["status"] == "ok"

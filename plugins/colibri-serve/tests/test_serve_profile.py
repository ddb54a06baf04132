"""``colibri serve`` takes a tuned profile's ``slots`` when ``--slots`` is not given
(colibri_core.cli.profiles), and its placement options as run does."""

import httpx

from colibri_core.cli import profiles


def test_serve_takes_the_profiles_slots_unless_given(random_model, start_server, tmp_path, monkeypatch):
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    monkeypatch.setenv("XDG_CONFIG_HOME", env["XDG_CONFIG_HOME"])
    doc = profiles.new_document(random_model, {"slots": 2, "prefetch": True}, budget={}, table=[], facts={}, seconds=1.0)
    profiles.write(doc, "served")
    server = start_server(random_model, env=env)
    scheduler = httpx.get(server.url + "/dashboard.json", timeout=30).json()["scheduler"]
    assert scheduler["slots"] == 2
    log = server.stop()
    assert "profile served: --slots 2 --prefetch" in log and "2 slots" in log
    server = start_server(random_model, "--slots", "3", env=env)
    assert httpx.get(server.url + "/dashboard.json", timeout=30).json()["scheduler"]["slots"] == 3
    assert "--slots as given" in server.stop()

"""colibri-serve registers its commands through the commands hook, and only there."""

import json
import subprocess
import sys

from colibri_core.testing.cli import colibri_env


def colibri(*args, **env):
    return subprocess.run([sys.executable, "-m", "colibri_core", *args], capture_output=True, text=True,
                          env=colibri_env(**env), timeout=120)


def test_serve_and_chat_are_plugin_commands():
    help_text = colibri("--help").stdout
    assert "serve" in help_text and "chat" in help_text
    plugins = json.loads(colibri("plugins", "--json").stdout)["plugins"]
    [serve] = [p for p in plugins if p["name"] == "colibri-serve"]
    assert serve["status"] == "loaded" and serve["hooks"] == ["colibri_register_commands"]
    disabled = colibri("--help", COLIBRI_DISABLE_PLUGINS="colibri-serve").stdout
    assert " serve " not in disabled and " chat " not in disabled


def test_bad_options_fail_with_one_line(tmp_path):
    out = colibri("serve", "--model", str(tmp_path))
    assert out.returncode != 0 and "not a model directory" in out.stderr and "Traceback" not in out.stderr
    out = colibri("chat", "--model", str(tmp_path))
    assert out.returncode != 0 and "not a model directory" in out.stderr


def test_a_model_that_fails_to_load_stops_the_server(tmp_path):
    (tmp_path / "config.json").write_text("{")
    out = colibri("serve", "--model", str(tmp_path), "--port", "0")
    assert out.returncode not in (0, 70) and "config.json" in out.stderr and "Traceback" not in out.stderr

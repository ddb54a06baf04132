"""``colibri serve`` and ``colibri chat`` take a Hugging Face repo id found in the local
hub cache (``--model org/name``, ``--revision``), offline: the server names the model
by its repo id (a snapshot directory's own name is a commit hash), a repo that is not in
the cache is one error line before any port is bound, and nothing is written into the
hub cache."""

import subprocess
import sys

import httpx
import pytest

from colibri_core.testing.cli import colibri_env
from colibri_core.testing.hub_cache import hub_env, make_hub_repo


@pytest.fixture
def hub(random_model, tmp_path):
    repo, snapshot = make_hub_repo(random_model, tmp_path / "hf-hub")
    return repo, snapshot, hub_env(tmp_path / "hf-hub", XDG_CACHE_HOME=str(tmp_path / "xdg"),
                                   XDG_STATE_HOME=str(tmp_path / "state"))


def listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_serve_and_chat_run_a_repo_id_from_the_cache(hub, start_server):
    repo, snapshot, env = hub
    before = listing(repo)
    server = start_server("org/name", "--revision", "main", env=env)
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["org/name"]
    reply = httpx.post(server.url + "/v1/completions", json={"model": "org/name", "prompt": "Once", "max_tokens": 3},
                       timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3, reply.text
    server.stop()
    chat = subprocess.run([sys.executable, "-m", "colibri_core", "chat", "--model", "org/name", "--max-tokens", "2"],
                          input="hello\n/exit\n", capture_output=True, text=True, env=colibri_env(**env), timeout=300)
    assert chat.returncode == 0 and "model>" in chat.stdout, chat.stderr
    assert "colibri chat with org/name" in chat.stderr
    assert listing(repo) == before  # no routing history, lock or temporary file in the hub cache


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_a_repo_id_not_in_the_cache_is_one_line(hub, command):
    *_, env = hub
    port = ["--port", "0"] if command == "serve" else []
    out = subprocess.run([sys.executable, "-m", "colibri_core", command, "--model", "org/missing", *port],
                         capture_output=True, text=True, env=colibri_env(**env), stdin=subprocess.DEVNULL, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --model org/missing:") and "hf download" in lines[0]
    help_text = subprocess.run([sys.executable, "-m", "colibri_core", command, "--help"], capture_output=True,
                               text=True, env=colibri_env(COLUMNS="200"), timeout=120).stdout
    assert "--revision" in help_text and "repo id" in help_text

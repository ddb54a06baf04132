"""``colibri serve --kv-disk SIZE``: the prompts' caches spilled to disk when the server
stops are read back by the next server: a returning conversation skips its prefill, with
the reply it had; counted in /metrics and /dashboard.json."""

import httpx
import pytest

from colibri_core.cli.demo import trained_demo_path


@pytest.fixture(scope="module")
def trained_model():
    return trained_demo_path()


def ask(server, text):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": "olmoe-16x64", "messages": [{"role": "user", "content": text}], "temperature": 0,
                         "max_tokens": 16})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def metric(server, name):
    text = httpx.get(server.url + "/metrics", timeout=30).text
    line = next(line for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "_total "))
    return float(line.split()[-1])


def test_a_restarted_server_reads_the_prompt_back_from_disk(trained_model, start_server, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    source = (trained_model / "heldout" / "python.txt").read_text()[:1500]  # ~500 tokens: whole 256-token chunks
    first = start_server(trained_model, "--kv-disk", "256M", env=env)
    reply, usage = ask(first, source)
    assert usage["prompt_tokens"] > 300 and usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    first.stop()  # the retained prefix is spilled as the server stops
    spilled = list((tmp_path / "cache" / "colibri" / "kv").glob("*/*.kvstate"))
    assert len(spilled) == 1
    second = start_server(trained_model, "--kv-disk", "256M", env=env)
    again, usage2 = ask(second, source)
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 256 and cached % 256 == 0, usage2
    assert again == reply, "a prefix read back from disk: another reply than the cold prefill's"
    assert metric(second, "colibri_kv_disk_hit_tokens") == cached and metric(second, "colibri_kv_disk_files") == 1
    scheduler = httpx.get(second.url + "/dashboard.json", timeout=30).json()["scheduler"]
    assert scheduler["kv_disk_hit_tokens"] == cached and scheduler["kv_disk_files"] == 1
    # without --kv-disk nothing is read back
    second.stop()
    third = start_server(trained_model, env=env)
    _, usage3 = ask(third, source)
    assert usage3.get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0


def test_a_bad_kv_disk_size_is_one_line(trained_model):
    from colibri_core.testing.cli import run_colibri

    out = run_colibri("serve", "--model", trained_model, "--kv-disk", "lots")
    assert out.returncode == 2 and "--kv-disk" in out.stderr.strip().splitlines()[-1]

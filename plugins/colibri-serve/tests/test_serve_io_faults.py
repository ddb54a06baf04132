"""A weight file that stops reading while the server runs (a shard truncated under it):
requests that needed it get a 503 naming the file, in each API's shape, /health says
"degraded" while the file stays short, and once it is whole again (put back by renaming a
copy over it) the very next request reads it: no failure outlives the fault."""

import os
import shutil

import httpx
import pytest


@pytest.fixture
def model(random_model, tmp_path):
    d = tmp_path / "random-olmoe"
    shutil.copytree(random_model, d)
    return d


def complete(server, **extra):
    body = {"model": "random-olmoe", "prompt": "the cat", "max_tokens": 6, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_a_truncated_shard_is_a_503_naming_it_until_it_is_restored(start_server, model):
    # one expert cached per layer: every step reads experts from the shards
    server = start_server(model, "--cap", "1", "--slots", "1")
    before = complete(server)
    assert before.status_code == 200
    shards = sorted(model.glob("*.safetensors"))
    saved = {shard: shard.read_bytes() for shard in shards}
    for shard in shards:
        os.truncate(shard, 200)

    r = complete(server)
    assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    error = r.json()["error"]
    assert error["code"] == "weights_unreadable" and error["type"] == "server_error"
    named = [str(s) for s in shards if str(s) in error["message"]]
    assert named and "short read at offset" in error["message"]
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "random-olmoe", "max_tokens": 6, "messages": [{"role": "user", "content": "the dog"}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "api_error" and ".safetensors" in r.json()["error"]["message"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": "random-olmoe", "prompt": "a bird", "max_tokens": 6, "stream": True}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "weights_unreadable" in events[-2] and ".safetensors" in events[-2]

    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    assert any(named[0] in e for e in health.json()["errors"])
    metrics = httpx.get(server.url + "/metrics").text
    assert "colibri_weight_read_errors_total 3.0" in metrics

    for shard, data in saved.items():  # put back as a new file, the way a copy or a download does it
        copy = shard.with_name(shard.name + ".partial")
        copy.write_bytes(data)
        os.replace(copy, shard)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    after = complete(server)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]

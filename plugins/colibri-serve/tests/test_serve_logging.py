"""The server's log: at info (the default) a "model loaded" line with the model, backend,
budgets and address, and an access line per request (method, path, status, tokens,
time); --log-level or COLIBRI_LOG_LEVEL raise the level, and the lines go."""

import re

import httpx

from colibri_core.testing.cli import run_colibri

PROMPT = {"model": "random-olmoe", "prompt": "the cat", "max_tokens": 3, "temperature": 0}


def requests(server):
    r = httpx.post(server.url + "/v1/completions", json=PROMPT, timeout=60)
    assert r.status_code == 200
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": "random-olmoe", "max_tokens": 2, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}) as stream:
        assert stream.status_code == 200 and list(stream.iter_lines())
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    return r.json()["usage"]


def test_info_logs_the_loaded_model_and_each_request(start_server, random_model):
    server = start_server(random_model, "--slots", "2", "--ram", "64M")
    usage = requests(server)
    err = server.stop()
    loaded = [line for line in err.splitlines() if " INFO model loaded: " in line]
    assert len(loaded) == 1, err
    assert re.search(r"model loaded: 'random-olmoe' \(olmoe, .*random-olmoe\) on the cpu backend in [\d.]+ s; "
                     r"RAM for weights 64\.0 MiB \(--ram\), KV cache [\d.]+ \w+; 2 slots, 64 may wait; "
                     rf"serving http://127\.0\.0\.1:{server.port}$", loaded[0]), loaded[0]
    access = [line for line in err.splitlines() if '" ' in line and " INFO 127.0.0.1:" in line]
    assert re.search(rf'INFO 127\.0\.0\.1:\d+ "POST /v1/completions" 200 prompt_tokens={usage["prompt_tokens"]} '
                     r'completion_tokens=3 time=\d+\.\d{3}s$', "\n".join(access), re.M), access
    assert re.search(r'"POST /v1/chat/completions" 200 prompt_tokens=\d+ completion_tokens=\d+ time=', "\n".join(access))
    assert re.search(r'"GET /v1/nothing" 404 time=\d+\.\d{3}s$', "\n".join(access), re.M)
    assert any('"GET /health" 200' in line for line in access)


def test_a_higher_level_silences_them(start_server, random_model):
    for args, env in ((("--log-level", "WARNING"), None), ((), {"COLIBRI_LOG_LEVEL": "error"})):
        server = start_server(random_model, *args, env=env)
        requests(server)
        err = server.stop()
        assert " INFO " not in err and "model loaded" not in err and "/v1/completions" not in err, err


def test_an_unknown_level_is_a_usage_error(random_model):
    r = run_colibri("serve", "--model", random_model, "--log-level", "loud", timeout=60)
    assert r.returncode == 2 and "--log-level" in r.stderr and "'loud' is not one of" in r.stderr

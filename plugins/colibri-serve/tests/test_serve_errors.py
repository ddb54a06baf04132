"""Error statuses in each API's own shape, through the vendors' SDKs where they have an
exception for it: 400 (bad request, context_length_exceeded), 401, 404, 413, 429 with
Retry-After, 503 while loading; and a client that disconnects frees its slot."""

import asyncio
import threading
import time

import anthropic
import httpx
import openai
import pytest

from serve_scripted_model import LOOP

USER = [{"role": "user", "content": "hi"}]


def oai(server, key="sekret"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def ant(server, key="sekret"):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def test_401_without_a_valid_key(scripted_server):
    for key in ("wrong", "sekre", "sekrett"):
        with pytest.raises(openai.AuthenticationError) as e:
            oai(scripted_server, key).chat.completions.create(model="scripted", messages=USER)
        assert e.value.body["code"] == "invalid_api_key"
        with pytest.raises(anthropic.AuthenticationError) as e:
            ant(scripted_server, key).messages.create(model="scripted", max_tokens=5, messages=USER)
        assert e.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(scripted_server.url + "/v1/models").status_code == 401
    assert httpx.get(scripted_server.url + "/metrics").status_code == 401
    assert httpx.get(scripted_server.url + "/health").status_code == 200  # open: load balancers probe it


def test_404_for_an_unknown_model(scripted_server):
    with pytest.raises(openai.NotFoundError) as e:
        oai(scripted_server).chat.completions.create(model="gpt-9", messages=USER)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as e:
        ant(scripted_server).messages.create(model="claude-9", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_400_context_length_exceeded_and_bad_requests(scripted_server):
    long = [{"role": "user", "content": "bird " * 3000}]
    with pytest.raises(openai.BadRequestError) as e:
        oai(scripted_server).chat.completions.create(model="scripted", messages=long)
    assert e.value.body["code"] == "context_length_exceeded" and "context" in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ant(scripted_server).messages.create(model="scripted", max_tokens=5, messages=long)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "context" in e.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai(scripted_server).chat.completions.create(model="scripted", messages=USER, temperature=5)
    assert "temperature" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        oai(scripted_server).chat.completions.create(model="scripted", messages=[])
    with pytest.raises(openai.BadRequestError) as e:
        oai(scripted_server).chat.completions.create(model="scripted", messages=USER, n=2)
    assert "not supported" in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError):
        ant(scripted_server).messages.create(model="scripted", max_tokens=0, messages=USER)
    r = httpx.post(scripted_server.url + "/v1/chat/completions", content=b"{not json", headers={
        "authorization": "Bearer sekret", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_413_for_a_body_over_the_limit(scripted_server):
    body = {"model": "scripted", "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    r = httpx.post(scripted_server.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sekret"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def _metric(server, name: str, key="sekret") -> float:
    text = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {key}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{"))


def _hold_slot(server, key="sekret"):
    """A streaming request that generates until max_tokens: returns once its first token
    arrived, with the open response (close it to disconnect)."""
    client = httpx.Client(timeout=60)
    body = {"model": "scripted", "prompt": LOOP, "max_tokens": 1500, "temperature": 0, "stream": True}
    cm = client.stream("POST", server.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
    response = cm.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()  # dropping this generator would close the connection
    next(line for line in lines if line.startswith("data: "))
    return client, cm, lines


def test_disconnect_cancels_the_generation_and_frees_the_slot(start_server, scripted_model):
    server = start_server(scripted_model, "--slots", "1", "--api-key", "sekret")
    client, cm, lines = _hold_slot(server)
    assert _metric(server, "colibri_active") == 1
    cm.__exit__(None, None, None)
    client.close()
    del lines
    deadline = time.monotonic() + 10
    while _metric(server, "colibri_active") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "colibri_active") == 0
    assert _metric(server, "colibri_tokens") < 1500  # stopped early, not run to max_tokens
    r = oai(server).chat.completions.create(model="scripted", messages=USER, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    # a client waiting for a whole (non-streamed) reply that gives up is noticed too
    before = _metric(server, "colibri_tokens")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"model": "scripted", "prompt": LOOP, "max_tokens": 1500},
                   headers={"authorization": "Bearer sekret"}, timeout=0.25)  # well before 1500 tokens, on a fast machine too
    deadline = time.monotonic() + 10
    while _metric(server, "colibri_active") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "colibri_active") == 0 and _metric(server, "colibri_tokens") - before < 1500


def test_429_with_retry_after_when_the_queue_is_full(start_server, scripted_model):
    server = start_server(scripted_model, "--slots", "1", "--max-queue", "1", "--api-key", "sekret")
    held = [_hold_slot(server)]  # holds the slot
    waiting = threading.Thread(target=lambda: oai(server).chat.completions.create(model="scripted", messages=USER),
                               daemon=True)
    waiting.start()  # waits in the queue
    deadline = time.monotonic() + 10
    while _metric(server, "colibri_queue_depth") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(openai.RateLimitError) as e:
        oai(server).chat.completions.create(model="scripted", messages=USER)
    assert e.value.response.headers["retry-after"] == "1" and e.value.body["code"] == "rate_limit_exceeded"
    with pytest.raises(anthropic.RateLimitError) as e:
        ant(server).messages.create(model="scripted", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "rate_limit_error"
    for client, cm, _ in held:
        cm.__exit__(None, None, None)
        client.close()
    waiting.join(timeout=30)
    assert not waiting.is_alive()


def test_503_while_loading_then_ready(scripted_model):
    """The application answers 503 (with Retry-After) until the model has loaded."""
    from colibri_core.engine.api import load
    from colibri_serve.app import create_app
    from colibri_serve.service import Service

    release = threading.Event()

    def slow_load():
        release.wait(30)
        return load(scripted_model)

    service = Service(slow_load, model_name="scripted", slots=1, max_queue=4)
    app = create_app(service)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
            with pytest.raises(openai.InternalServerError) as e:
                await client.chat.completions.create(model="scripted", messages=USER)
            assert e.value.status_code == 503 and e.value.body["code"] == "model_loading"
            assert e.value.response.headers["retry-after"] == "5"
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "loading"
            r = await http.post("/v1/messages", json={"model": "scripted", "max_tokens": 5, "messages": USER})
            assert r.status_code == 503 and r.json()["type"] == "error"
            release.set()
            await asyncio.get_running_loop().run_in_executor(None, service.wait_loaded, 30)
            r = await client.chat.completions.create(model="scripted", messages=USER, temperature=0)
            assert r.choices[0].message.content == "Hello there."

    service.start_loading()
    try:
        asyncio.run(go())
    finally:
        release.set()
        service.wait_loaded(30)
        service.close()


def test_binding_elsewhere_without_a_key_warns(start_server, scripted_model):
    server = start_server(scripted_model, "--host", "0.0.0.0", ready=False)
    try:
        server.url = f"http://127.0.0.1:{server.port}"
        server.wait_ready()
    finally:
        err = server.stop()
    assert "without an API key" in err

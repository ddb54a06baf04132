"""Error statuses in each API's own shape, through the vendors' SDKs where they have an
exception for it: 400 (bad request, context_length_exceeded), 401, 404, 413, 429 with
Retry-After (with --max-queue 0, for a request that would wait only), 503 while loading;
and a client that disconnects frees its slot. Also what is wrong with a body (not JSON,
a lone surrogate, a text that is no string), unknown routes and methods, a connection
that never sends its headers, a port in use, and Ctrl-C with streams open."""

import asyncio
import json
import signal
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest

from colibri_core.testing.cli import run_colibri
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
        oai(scripted_server).chat.completions.create(model="scripted", messages=USER, n=2, stream=True)
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


def test_max_queue_0_serves_a_request_that_finds_a_free_slot_and_429s_one_that_would_wait(start_server, scripted_model):
    server = start_server(scripted_model, "--slots", "1", "--max-queue", "0", "--api-key", "sekret")
    r = oai(server).chat.completions.create(model="scripted", messages=USER, temperature=0)  # idle: the slot is free
    assert r.choices[0].finish_reason == "stop"
    client, cm, _ = _hold_slot(server)
    with pytest.raises(openai.RateLimitError) as e:
        oai(server).chat.completions.create(model="scripted", messages=USER)
    assert e.value.response.headers["retry-after"] == "1" and e.value.body["code"] == "rate_limit_exceeded"
    assert "every slot is busy and the queue is full (--max-queue 0)" in e.value.body["message"]
    cm.__exit__(None, None, None)
    client.close()
    deadline = time.monotonic() + 10
    while _metric(server, "colibri_active") and time.monotonic() < deadline:
        time.sleep(0.05)
    r = oai(server).chat.completions.create(model="scripted", messages=USER, temperature=0)  # free again
    assert r.choices[0].finish_reason == "stop"


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


def _post(server, path, content: bytes, content_type: str | None = "application/json"):
    headers = {"authorization": "Bearer sekret"}
    if content_type:
        headers["content-type"] = content_type
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


def test_a_lone_surrogate_is_a_400_naming_the_field(scripted_server):
    # JSON may escape one; it is no character: the tokenizer refused it with a plain-text 500
    chat = rb'"messages":[{"role":"user","content":"\ud800 x"}]'
    for path, body, field in (("/v1/chat/completions", b'{"model":"scripted",%s}' % chat, "messages[0].content"),
                              ("/v1/completions", rb'{"model":"scripted","prompt":"\ud800 x"}', "prompt"),
                              ("/v1/messages", b'{"model":"scripted","max_tokens":5,%s}' % chat, "messages[0].content"),
                              ("/v1/messages/count_tokens", b'{"model":"scripted",%s}' % chat, "messages[0].content")):
        r = _post(scripted_server, path, body)
        assert r.status_code == 400, (path, r.text)
        if path.startswith("/v1/messages"):
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
            assert r.json()["error"]["message"].startswith(field + ": a lone surrogate")
        else:
            assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == field
            assert r.json()["error"]["message"].startswith(field + ": a lone surrogate")
    # a surrogate pair is one character, and fine
    r = _post(scripted_server, "/v1/messages/count_tokens", rb'{"model":"scripted","messages":[{"role":"user","content":"\ud83d\ude00"}]}')
    assert r.status_code == 200


def test_an_unknown_route_is_not_found_not_a_missing_model(scripted_server):
    r = httpx.get(scripted_server.url + "/v1/nothing", headers={"authorization": "Bearer sekret"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert r.json()["error"]["message"] == "/v1/nothing: no such route"
    r = httpx.post(scripted_server.url + "/v1/messages/nothing", headers={"x-api-key": "sekret"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_a_wrong_method_says_which_are_allowed(scripted_server):
    r = httpx.get(scripted_server.url + "/v1/chat/completions", headers={"authorization": "Bearer sekret"})
    assert r.status_code == 405 and r.headers.get("allow") == "POST"
    assert r.json()["error"]["message"] == "/v1/chat/completions takes POST, not GET"


def test_a_body_without_a_content_type_is_json(scripted_server):
    body = json.dumps({"model": "scripted", "messages": USER, "max_tokens": 2, "temperature": 0}).encode()
    r = _post(scripted_server, "/v1/chat/completions", body, content_type=None)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_a_body_that_is_not_json_says_so(scripted_server):
    # curl -d sends a form's type: refused (a browser sends forms to any site unasked), saying what to send
    body = json.dumps({"model": "scripted", "messages": USER}).encode()
    r = _post(scripted_server, "/v1/chat/completions", body, content_type="application/x-www-form-urlencoded")
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "the body must be JSON sent with Content-Type: application/json, not application/x-www-form-urlencoded")
    r = _post(scripted_server, "/v1/messages", b"[1]")
    assert r.status_code == 400 and r.json()["error"]["message"] == "the body must be a JSON object"


def test_malformed_json_says_where(scripted_server):
    r = _post(scripted_server, "/v1/chat/completions", b'{"model": "scripted",\n "messages": }')
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert r.json()["error"]["message"] == "the body is not valid JSON: Expecting value (line 2, column 14)"


def test_a_text_part_needs_a_string(scripted_server):
    parts = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    r = httpx.post(scripted_server.url + "/v1/chat/completions", json={"model": "scripted", "messages": parts},
                   headers={"authorization": "Bearer sekret"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].text"
    assert r.json()["error"]["message"] == "messages[0].content[0].text: must be a string, not a number"
    for path, extra in (("/v1/messages", {"max_tokens": 5}), ("/v1/messages/count_tokens", {})):
        r = httpx.post(scripted_server.url + path, json={"model": "scripted", "messages": parts, **extra},
                       headers={"x-api-key": "sekret"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "messages[0].content[0].text: must be a string, not a number"


def test_refusals_are_counted_under_their_route(scripted_server):
    httpx.get(scripted_server.url + "/v1/models", headers={"authorization": "Bearer wrong"})
    text = httpx.get(scripted_server.url + "/metrics", headers={"authorization": "Bearer sekret"}).text
    assert 'colibri_http_requests_total{route="/v1/models",status="401"}' in text
    assert 'route="unmatched",status="401"' not in text


def test_a_connection_that_never_sends_its_headers_is_closed(start_server, scripted_model):
    server = start_server(scripted_model, "--header-timeout", "0.5")

    def closed_within(sock, seconds, trickle=b"") -> bool:
        """Whether the server closes ``sock`` within ``seconds`` (sending ``trickle`` a
        byte at a time meanwhile)."""
        sock.settimeout(0.2)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if trickle:
                    sock.send(trickle[:1])
                    trickle = trickle[1:]
                if sock.recv(4096) == b"":
                    return True
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return True
        return False

    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /hea")
        assert closed_within(sock, 5)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # bytes that trickle in do not extend it
        assert closed_within(sock, 5, trickle=b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # nor for the next request on a connection
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = b""
        while not reply.endswith(b"}"):
            reply += sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /hea")
        assert closed_within(sock, 5)


def test_a_port_in_use_is_one_error_line(scripted_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_colibri("serve", "--model", scripted_model, "--port", port, timeout=120)
    assert r.returncode == 3  # the machine refused, as for other ResourceErrors
    assert r.stderr.splitlines() == [f"error: could not listen on 127.0.0.1:{port}: address already in use"]


def test_ctrl_c_ends_open_streams_and_exits_cleanly(start_server, scripted_model):
    server = start_server(scripted_model, "--slots", "2", "--api-key", "sekret")
    held = [_hold_slot(server) for _ in range(2)]
    server.proc.send_signal(signal.SIGINT)
    for client, cm, lines in held:
        data = [line for line in lines if line.startswith("data: ")]  # to the end: a cut stream raises
        assert data[-1] == "data: [DONE]" and "shutting down" in json.loads(data[-2][6:])["error"]["message"]
        cm.__exit__(None, None, None)
        client.close()
    assert server.proc.wait(timeout=30) == 130
    err = server.proc.stderr.read()
    assert "Traceback" not in err and "Exception in ASGI application" not in err and "interrupted" in err

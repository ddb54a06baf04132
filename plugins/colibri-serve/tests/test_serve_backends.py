"""A request served on each installed backend (``colibri_core.testing.backends``; one that
cannot run here is skipped with its reason): the model loads on one thread and the
batched engine computes on another, and the reply carries tokens, not an error."""

import httpx
import pytest

from colibri_core.testing.backends import backend_params


@pytest.mark.parametrize("backend", backend_params())
def test_a_served_request_returns_tokens_on_each_backend(backend, random_model, start_server):
    server = start_server(random_model, "--backend", backend, "--slots", "2")
    body = {"model": "random-olmoe", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["choices"][0]["finish_reason"] == "length", reply
    assert reply["usage"]["completion_tokens"] == 6
    assert len(reply["choices"][0]["token_ids"]) == 6, reply

"""OpenAI's logprobs / top_logprobs, logit_bias and frequency / presence penalties through
a live ``colibri serve`` (random demo model): the numbers are the Python API's for the
same request, in OpenAI's shapes (chat ``choices[].logprobs.content[]``, the legacy
completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``),
streamed or not. Fields colibri cannot honour (Anthropic's thinking, a response_format
that is not a schema) are a 400 naming them."""

import json

import anthropic
import httpx
import openai
import pytest

import colibri_core

MESSAGES = [{"role": "user", "content": "Once upon a time"}]
PROMPT = "The small bird"


@pytest.fixture(scope="module")
def reference(random_model):
    """The Python API on the served model: what the server must answer."""
    with colibri_core.load(random_model, history=False) as model:
        def generate(**kwargs):
            return model.generate(temperature=0, **kwargs)

        yield model, generate


def post(server, path, body):
    return httpx.post(server.url + path, json={"model": "random-olmoe", **body}, timeout=120)


def stream(server, path, body):
    """The JSON data of each event of a streamed response."""
    with httpx.stream("POST", server.url + path, json={"model": "random-olmoe", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def check_chat_entries(content, expected, model, top):
    assert [e["logprob"] for e in content] == [t.logprob for t in expected.logprobs]
    # the random model writes broken UTF-8 too: replaced as the tokenizer replaces it
    assert b"".join(bytes(e["bytes"]) for e in content).decode(errors="replace") == expected.text
    for entry, want in zip(content, expected.logprobs):
        assert entry["token"] == bytes(entry["bytes"]).decode("utf-8", errors="backslashreplace")
        assert bytes(entry["bytes"]) == model.tokenizer.token_bytes(want.token_id)
        assert [a["logprob"] for a in entry["top_logprobs"]] == [lp for _, lp in want.top]
        assert [bytes(a["bytes"]) for a in entry["top_logprobs"]] == [model.tokenizer.token_bytes(i) for i, _ in want.top]
        assert len(entry["top_logprobs"]) == top and set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_chat_logprobs_are_the_python_apis_streamed_or_not(random_server, reference):
    model, generate = reference
    expected = generate(messages=MESSAGES, max_tokens=12, logprobs=3)
    r = post(random_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12, "temperature": 0,
                                                     "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == expected.text and choice["logprobs"]["refusal"] is None
    check_chat_entries(choice["logprobs"]["content"], expected, model, 3)
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [e["top_logprobs"][0]["logprob"]
                                                                      for e in choice["logprobs"]["content"]]  # greedy

    chunks = stream(random_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12, "temperature": 0,
                                                            "logprobs": True, "top_logprobs": 3})
    content = [e for c in chunks for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert content == choice["logprobs"]["content"]
    for c in chunks:  # a chunk with text carries the logprobs of the tokens that made it
        if c["choices"][0]["delta"].get("content"):
            assert c["choices"][0]["logprobs"]["content"]

    # the real SDK reads them; logprobs without top_logprobs: the chosen tokens only
    client = openai.OpenAI(base_url=random_server.url + "/v1", api_key="none", max_retries=0)
    sdk = client.chat.completions.create(model="random-olmoe", messages=MESSAGES, max_tokens=12, temperature=0,
                                         logprobs=True)
    assert [e.logprob for e in sdk.choices[0].logprobs.content] == [t.logprob for t in expected.logprobs]
    assert all(e.top_logprobs == [] for e in sdk.choices[0].logprobs.content)
    plain = post(random_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
    assert plain.json()["choices"][0]["logprobs"] is None


def test_legacy_completion_logprobs_are_the_python_apis_streamed_or_not(random_server, reference):
    model, generate = reference
    expected = generate(prompt=PROMPT, max_tokens=10, logprobs=2)
    r = post(random_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == expected.text and set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["token_logprobs"] == [t.logprob for t in expected.logprobs]
    assert lp["tokens"] == [model.tokenizer.token_bytes(t).decode("utf-8", errors="backslashreplace")
                            for t in expected.token_ids]
    for top, want, token in zip(lp["top_logprobs"], expected.logprobs, lp["tokens"]):
        assert sorted(top.values(), reverse=True) == [v for _, v in want.top] and top[token] == want.logprob
    # where each token's text starts in the completion
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(choice["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]) if "\\x" not in t)

    chunks = stream(random_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 2})
    joined = {k: [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][k]] for k in lp}
    assert joined == lp and "".join(c["choices"][0]["text"] for c in chunks) == expected.text


def test_logit_bias_and_penalties_change_the_tokens_as_the_python_api(random_server, reference):
    model, generate = reference
    forced = model.encode(" bird")[0]
    r = post(random_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                "logit_bias": {str(forced): 100}, "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == [forced] * 4
    for body, kwargs in (({"frequency_penalty": 2}, {"frequency_penalty": 2.0}),
                         ({"presence_penalty": 1.5, "logit_bias": {str(forced): -3.5}},
                          {"presence_penalty": 1.5, "logit_bias": {forced: -3.5}})):
        expected = generate(messages=MESSAGES, max_tokens=16, **kwargs)
        r = post(random_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "temperature": 0,
                                                         "return_token_ids": True, **body})
        assert r.json()["choices"][0]["token_ids"] == expected.token_ids
        assert expected.token_ids != generate(messages=MESSAGES, max_tokens=16).token_ids  # they did something


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"presence_penalty": -3}, "presence_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"1" * 40: 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": "1"}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 10**400}}, "logit_bias"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"min_p": 0.1}, "min_p"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"repetition_penalty": 1.1}, "repetition_penalty"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(random_server, path, body, param):
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    r = post(random_server, path, {**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error


def test_a_bias_outside_the_vocabulary_says_so_and_text_response_format_is_fine(random_server, reference):
    model, _ = reference
    vocab = model.lm.vocab_size
    r = post(random_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "logit_bias": {str(vocab): 1}})
    assert r.json()["error"]["message"] == f"logit_bias: token id {vocab} is outside the vocabulary (0..{vocab - 1})"
    r = post(random_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                     "response_format": {"type": "text"}, "logit_bias": {str(vocab - 1): -1}})
    assert r.status_code == 200, r.text


def test_anthropic_refuses_thinking_and_server_side_features(random_server):
    client = anthropic.Anthropic(base_url=random_server.url, api_key="none", max_retries=0)
    base = dict(model="random-olmoe", max_tokens=4, messages=MESSAGES)
    for extra, field in (({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
                         ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
                         ({"container": "container_1"}, "container")):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**base, extra_body=extra)
        assert e.value.body["error"]["type"] == "invalid_request_error" and field in e.value.body["error"]["message"]
    assert client.messages.create(**base, extra_body={"thinking": {"type": "disabled"}}).stop_reason

"""Structured output through a live ``colibri serve`` with the openai SDK (and Anthropic's
``output_config.format``): replies to
``response_format`` json_schema / json_object requests parse and fit their schema, on the
trained OLMoE-geometry model and on a random-weights one (whose unconstrained replies are
not JSON at all; its context holds 64 tokens, so its schema is small), streamed or not;
and ``n`` choices, each a sequence of its own."""

import json

import anthropic
import jsonschema
import openai
import pytest

from conftest import module_server

structured_server = module_server("random_model", "--slots", "4")
trained_server = module_server("trained_model", "--slots", "2")


@pytest.fixture(scope="module")
def trained_model():
    colibri_trained = pytest.importorskip("colibri_trained", reason="colibri-trained is not installed")
    return colibri_trained.path("olmoe")

SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["ok", "n"], "additionalProperties": False}

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "colour", "tags"],
    "additionalProperties": False,
}


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("server_fixture, schema, model", [("trained_server", SCHEMA, "olmoe-16x64"),
                                                           ("structured_server", SMALL, "random-olmoe")])
def test_json_schema_replies_fit_their_schema(request, server_fixture, schema, model):
    api = client(request.getfixturevalue(server_fixture))
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for seed in range(50):  # the 50 prompts, on each model
        reply = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Describe person {seed}."}],
            response_format=fmt, max_tokens=120, temperature=1.0, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_unconstrained_replies_of_the_random_model_are_not_json(structured_server):
    api = client(structured_server)
    unconstrained = api.chat.completions.create(model="random-olmoe", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=40, temperature=1.0, seed=0)
    with pytest.raises(ValueError):  # what the schema changed: a random model writes no JSON by itself
        json.loads(unconstrained.choices[0].message.content)


def test_json_object_streamed_is_an_object(structured_server):
    api = client(structured_server)
    chunks = api.chat.completions.create(
        model="random-olmoe", messages=[{"role": "user", "content": "Give me an object."}],
        response_format={"type": "json_object"}, max_tokens=40, temperature=0.7, seed=3, stream=True)
    text, finish = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # an object a random model never closes: still a prefix of one
        assert finish == "length" and text.lstrip().startswith("{")


def test_n_choices_are_sequences_of_their_own(structured_server):
    api = client(structured_server)
    messages = [{"role": "user", "content": "Once upon a time"}]
    reply = api.chat.completions.create(model="random-olmoe", messages=messages, n=3, max_tokens=6, temperature=1.0,
                                        seed=5)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1  # each choice its own draw
    # choice i is what a single request with seed + i writes; usage counts the prompt once
    singles = [api.chat.completions.create(model="random-olmoe", messages=messages, max_tokens=6, temperature=1.0,
                                           seed=5 + i) for i in range(3)]
    assert texts == [one.choices[0].message.content for one in singles]
    assert reply.usage.completion_tokens == sum(one.usage.completion_tokens for one in singles)
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    greedy = api.chat.completions.create(model="random-olmoe", messages=messages, n=2, max_tokens=6, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    for bad in ({"n": 9}, {"n": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError, match="n"):
            api.chat.completions.create(model="random-olmoe", messages=messages, max_tokens=2, **bad)


def test_anthropic_output_config_format_fits_its_schema(structured_server, trained_server):
    """The Messages API's structured outputs (``output_config.format``, as the anthropic
    SDK sends it): the reply is JSON fitting the schema, streamed or not; what colibri
    cannot give (an effort level) and malformed formats are refused naming the field."""
    fmt = {"format": {"type": "json_schema", "schema": SCHEMA}}
    claude = anthropic.Anthropic(base_url=trained_server.url, api_key="none", max_retries=0)
    for seed in range(4):
        m = claude.messages.create(model="olmoe-16x64", max_tokens=120, output_config=fmt,
                                   messages=[{"role": "user", "content": f"Describe person {seed}."}])
        assert m.stop_reason == "end_turn", m
        jsonschema.validate(json.loads(m.content[0].text), SCHEMA)
    small = anthropic.Anthropic(base_url=structured_server.url, api_key="none", max_retries=0)
    with small.messages.stream(model="random-olmoe", max_tokens=40, output_config={"format": {
            "type": "json_schema", "schema": SMALL}}, messages=[{"role": "user", "content": "Go."}]) as stream:
        final = stream.get_final_message()
    jsonschema.validate(json.loads(final.content[0].text), SMALL)
    for config, param in (({"effort": "high"}, "output_config.effort"),
                          ({"format": {"type": "json_object"}}, "output_config.format"),
                          ({"format": {"type": "json_schema", "schema": {"type": "objekt"}}}, "output_config.format"),
                          ({"verbosity": 1}, "output_config.verbosity")):
        with pytest.raises(anthropic.BadRequestError) as err:
            small.messages.create(model="random-olmoe", max_tokens=4, output_config=config,
                                  messages=[{"role": "user", "content": "Go."}])
        assert err.value.body["error"]["message"].startswith(param), err.value.body

"""The real ``anthropic`` SDK against a live ``colibri serve`` on 127.0.0.1 (the scripted
model of serve_scripted_model.py), and the raw event sequence of a streamed message."""

import json

import anthropic
import httpx
import pytest

from serve_scripted_model import PLAIN_REPLY, TOOL_ARGS, TOOL_REPLY, WEATHER_TOOL

USER = [{"role": "user", "content": "hi"}]
# newer SDKs dropped the sampling arguments from messages.create; the API still takes them
GREEDY = {"temperature": 0}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def client(scripted_server):
    return anthropic.Anthropic(base_url=scripted_server.url, api_key="sekret", max_retries=0)


def test_message_with_usage(client):
    m = client.messages.create(model="scripted", max_tokens=50, messages=USER, extra_body=GREEDY)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == PLAIN_REPLY
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and m.role == "assistant"
    assert m.usage.output_tokens == 7
    counted = client.messages.count_tokens(model="scripted", messages=USER)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == counted.input_tokens > 0


def test_system_prompt_counts(client):
    bare = client.messages.count_tokens(model="scripted", messages=USER).input_tokens
    with_system = client.messages.count_tokens(model="scripted", messages=USER, system="be brief").input_tokens
    blocks = client.messages.count_tokens(model="scripted", messages=USER, system=[{"type": "text", "text": "be brief"}]).input_tokens
    assert with_system == blocks > bare


def test_streaming_helper(client):
    with client.messages.stream(model="scripted", max_tokens=50, messages=USER, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == PLAIN_REPLY and final.content[0].text == PLAIN_REPLY and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 7


def test_raw_stream_event_sequence(scripted_server):
    body = {"model": "scripted", "max_tokens": 50, "messages": USER, "temperature": 0, "stream": True}
    with httpx.stream("POST", scripted_server.url + "/v1/messages", json=body, headers={"x-api-key": "sekret"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    deltas = names.count("content_block_delta")
    assert deltas > 1
    assert names == (["message_start", "ping", "content_block_start"] + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])


def test_tool_use_round_trip(client):
    m = client.messages.create(model="scripted", max_tokens=50, messages=USER, tools=[TOOL], extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == TOOL_ARGS
    messages = USER + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "21 degrees"}]}]
    m2 = client.messages.create(model="scripted", max_tokens=50, messages=messages, tools=[TOOL], extra_body=GREEDY)
    assert m2.content[0].text == TOOL_REPLY and m2.stop_reason == "end_turn"


def test_streamed_tool_use(client):
    with client.messages.stream(model="scripted", max_tokens=50, messages=USER, tools=[TOOL], extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", TOOL_ARGS)]


def test_stop_sequences_and_max_tokens(client):
    m = client.messages.create(model="scripted", max_tokens=50, messages=USER, extra_body=GREEDY, stop_sequences=["there"])
    assert m.content[0].text == "Hello " and m.stop_reason == "stop_sequence" and m.stop_sequence == "there"
    m = client.messages.create(model="scripted", max_tokens=3, messages=USER, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3 and m.content[0].text == "Hell"


def test_sampling_options_are_accepted(client):
    m = client.messages.create(model="scripted", max_tokens=5, messages=USER, extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 5})
    assert m.usage.output_tokens <= 5

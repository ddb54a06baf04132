"""The real ``openai`` SDK against a live ``colibri serve`` on 127.0.0.1.

The scripted model (serve_scripted_model.py) answers "Hello there." to a plain
conversation, calls get_weather(city=Paris) when given tools, and answers "Warm, 21C"
after the tool result: every token comes from the real engine."""

import json

import openai
import pytest

from colibri_core.model.tokenizer import Tokenizer
from serve_scripted_model import PLAIN_REPLY, TOOL_ARGS, TOOL_REPLY, WEATHER_TOOL

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(scripted_server):
    return openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="sekret", max_retries=0)


def prompt_tokens(model_dir, messages, tools=None):
    tok = Tokenizer.from_dir(model_dir)
    text = tok.chat_template.render(messages, True, **({"tools": tools} if tools else {}))
    return len(tok.encode(text, add_special_tokens=False))


def reply_tokens(model_dir, text):
    return len(Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False))


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["scripted"]
    assert client.models.retrieve("scripted").id == "scripted"


def test_chat_completion_with_usage(client, scripted_model):
    r = client.chat.completions.create(model="scripted", messages=USER, temperature=0)
    choice = r.choices[0]
    assert choice.message.content == PLAIN_REPLY and choice.finish_reason == "stop" and not choice.message.tool_calls
    assert r.usage.prompt_tokens == prompt_tokens(scripted_model, USER)
    assert r.usage.completion_tokens == reply_tokens(scripted_model, PLAIN_REPLY)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_with_include_usage(client, scripted_model):
    stream = client.chat.completions.create(model="scripted", messages=USER, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == PLAIN_REPLY and finishes == ["stop"]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # it streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply_tokens(scripted_model, PLAIN_REPLY)
    assert all(c.usage is None for c in chunks[:-1])


def test_tool_call_round_trip(client):
    r = client.chat.completions.create(model="scripted", messages=USER, tools=[WEATHER_TOOL], temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == TOOL_ARGS
    messages = USER + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"}]
    r2 = client.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER_TOOL], temperature=0)
    assert r2.choices[0].message.content == TOOL_REPLY and r2.choices[0].finish_reason == "stop"


def test_streamed_tool_call(client):
    chunks = list(client.chat.completions.create(model="scripted", messages=USER, tools=[WEATHER_TOOL], temperature=0,
                                                 stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == TOOL_ARGS
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_leaves_the_tools_out(client):
    r = client.chat.completions.create(model="scripted", messages=USER, tools=[WEATHER_TOOL], tool_choice="none", temperature=0)
    assert r.choices[0].message.content == PLAIN_REPLY


def test_stop_strings_and_max_tokens(client):
    r = client.chat.completions.create(model="scripted", messages=USER, temperature=0, stop=["there"])
    assert r.choices[0].message.content == "Hello " and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="scripted", messages=USER, temperature=0, stop="re.", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello the"
    r = client.chat.completions.create(model="scripted", messages=USER, temperature=0, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3 and r.choices[0].message.content == "Hell"


def test_system_and_assistant_history_reach_the_template(client, scripted_model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": [{"type": "text", "text": "c"}]}]
    r = client.chat.completions.create(model="scripted", messages=messages, temperature=0)
    as_strings = messages[:3] + [{"role": "user", "content": "c"}]
    assert r.usage.prompt_tokens == prompt_tokens(scripted_model, as_strings)
    assert r.choices[0].message.content == PLAIN_REPLY


def test_completions_plain_and_streamed(client):
    prompt = "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"
    r = client.completions.create(model="scripted", prompt=prompt, max_tokens=50, temperature=0)
    assert r.choices[0].text == PLAIN_REPLY and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 7
    text = "".join(c.choices[0].text for c in client.completions.create(model="scripted", prompt=prompt, max_tokens=50,
                                                                           temperature=0, stream=True) if c.choices)
    assert text == PLAIN_REPLY
    r = client.completions.create(model="scripted", prompt=prompt, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_sampling_with_a_seed_is_repeatable(client):
    kwargs = dict(model="scripted", prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.9, seed=5)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_next_turn_reuses_the_cached_prefix(client, scripted_server):
    first = [{"role": "user", "content": " ".join(["forest"] * 300)}]
    r1 = client.chat.completions.create(model="scripted", messages=first, temperature=0)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "more"}]
    r2 = client.chat.completions.create(model="scripted", messages=second, temperature=0)
    assert r2.choices[0].message.content == PLAIN_REPLY  # the same tokens as a cold prefill would give
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert 256 <= cached < r2.usage.prompt_tokens and cached % 256 == 0
    import anthropic

    ant = anthropic.Anthropic(base_url=scripted_server.url, api_key="sekret", max_retries=0)
    m = ant.messages.create(model="scripted", max_tokens=20, messages=second, extra_body={"temperature": 0})
    assert m.usage.cache_read_input_tokens >= 256 and m.usage.input_tokens + m.usage.cache_read_input_tokens == r2.usage.prompt_tokens


def test_metrics_count_requests_tokens_and_expert_lookups(client, scripted_server):
    import httpx

    client.chat.completions.create(model="scripted", messages=USER, temperature=0)
    text = httpx.get(scripted_server.url + "/metrics", headers={"authorization": "Bearer sekret"}).text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert values['colibri_http_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert values["colibri_time_to_first_token_seconds_count"] >= 1 and values["colibri_tokens_total"] >= 7
    assert values["colibri_slots"] == 2 and values["colibri_queue_depth"] == 0 and values["colibri_model_ready"] == 1
    lookups = sum(v for k, v in values.items() if k.startswith("colibri_expert_lookups_total{"))
    assert lookups > 0 and 'colibri_expert_lookups_total{tier="disk"}' in values
    assert any(k.startswith("colibri_expert_bytes_read_total{") for k in values)
    assert values["colibri_expert_read_wait_seconds_total"] >= 0

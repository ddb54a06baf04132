"""Forced and strict tool calls through a live ``colibri serve`` on a random-weights model
whose chat template writes Qwen3-Coder's calls (a ``<parameter=KEY>`` block per argument,
string values bare): the real openai and anthropic SDKs get calls that parse and whose
arguments validate against their tool's schema, which the garbage the model writes
unconstrained never does (the control in test_serve_tool_choice.py)."""

import json

import anthropic
import jsonschema
import openai
import pytest

from conftest import module_server
from serve_tool_model import CODER_TEMPLATE, build_tool_model, call_token

NOTE = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 10},
                                         "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                                         "done": {"type": "boolean"}, "kind": {"enum": ["todo", "idea"]}},
        "required": ["title", "priority", "kind"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "number", "minimum": -9, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"note": NOTE, "add": ADD}


@pytest.fixture(scope="module")
def coder_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("serve-tools") / "coder-random", CODER_TEMPLATE)


coder_server = module_server("coder_model", "--slots", "4")


def tools(strict=None):
    return [{"type": "function", "function": {"name": n, "parameters": s, **({} if strict is None else {"strict": strict})}}
            for n, s in SCHEMAS.items()]


def ask(seed):
    return [{"role": "user", "content": f"Question {seed}: what now?"}]


def test_forced_and_strict_calls_in_blocks_validate(coder_server, coder_model):
    oai = openai.OpenAI(base_url=coder_server.url + "/v1", api_key="none", max_retries=0)
    counts = []
    for seed in range(8):
        r = oai.chat.completions.create(model="coder-random", messages=ask(seed), tools=tools(), tool_choice="required",
                                        max_tokens=500, temperature=1.0, seed=seed)
        choice = r.choices[0]
        if choice.finish_reason == "length":  # parallel calls past max_tokens: cut, and said so
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        counts.append(len(choice.message.tool_calls))
    assert len(counts) >= 5 and max(counts) > 1, counts
    nudge = {str(call_token(coder_model)): 8}
    made = 0
    for seed in range(8):
        r = oai.chat.completions.create(model="coder-random", messages=ask(seed), tools=tools(strict=True),
                                        max_tokens=200, temperature=1.0, seed=seed, logit_bias=nudge,
                                        parallel_tool_calls=False)
        for call in r.choices[0].message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            made += 1
    assert made >= 5, made


def test_anthropic_forced_tool_in_blocks(coder_server):
    claude = anthropic.Anthropic(base_url=coder_server.url, api_key="none", max_retries=0)
    for _ in range(3):
        m = claude.messages.create(model="coder-random", max_tokens=300, messages=ask(0),
                                   tools=[{"name": n, "input_schema": s} for n, s in SCHEMAS.items()],
                                   tool_choice={"type": "tool", "name": "note", "disable_parallel_tool_use": True},
                                   extra_body={"temperature": 1.0})
        assert m.stop_reason == "tool_use", m
        [block] = m.content
        assert block.name == "note"
        jsonschema.validate(block.input, NOTE)


def test_a_call_cut_by_max_tokens_is_length_not_tool_calls(coder_server):
    # the block parser reads an unclosed call (models do stop without closing tags): cut
    # by max_tokens, its arguments may be missing, so the reply must say it was cut
    oai = openai.OpenAI(base_url=coder_server.url + "/v1", api_key="none", max_retries=0)
    r = oai.chat.completions.create(model="coder-random", messages=ask(3), tools=tools(), max_tokens=30,
                                    tool_choice={"type": "function", "function": {"name": "note"}}, seed=3)
    assert r.choices[0].finish_reason == "length", r.choices[0]

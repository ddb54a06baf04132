"""Forced and strict tool calls through a live ``colibri serve`` with the real openai and
anthropic SDKs, on a random-weights model whose chat template writes Hermes tool calls
(serve_tool_model.py): its replies are garbage, so calls that parse and whose arguments
validate against their tool's schema (jsonschema) are the grammar's doing. The control:
the same requests without the constraint (a tool not strict) give no valid call.
Refusals: a model without a tool-call convention, and fields that do not go together."""

import json

import anthropic
import jsonschema
import openai
import pytest

from conftest import module_server
from serve_tool_model import build_tool_model, call_token

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -9, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def openai_tools(strict=None):
    out = []
    for name, schema in SCHEMAS.items():
        fn = {"name": name, "description": f"the {name} tool", "parameters": schema}
        if strict is not None:
            fn["strict"] = strict
        out.append({"type": "function", "function": fn})
    return out


ANTHROPIC_TOOLS = [{"name": name, "description": f"the {name} tool", "input_schema": schema} for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("serve-tools") / "hermes-random")


tool_server = module_server("tool_model", "--slots", "4")
plain_server = module_server("random_model", "--slots", "2")  # the demo template: no tool-call convention


@pytest.fixture(scope="module")
def oai(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(tool_server):
    return anthropic.Anthropic(base_url=tool_server.url, api_key="none", max_retries=0)


def ask(seed):
    return [{"role": "user", "content": f"Question {seed}: what now?"}]


def valid_calls(calls, names=tuple(SCHEMAS)):
    """Each OpenAI tool call names one of ``names`` and its arguments fit that tool's schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_forces_valid_calls(oai):
    counts = []
    for seed in range(6):
        r = oai.chat.completions.create(model="hermes-random", messages=ask(seed), tools=openai_tools(),
                                        tool_choice="required", max_tokens=400, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        valid_calls(choice.message.tool_calls)
        counts.append(len(choice.message.tool_calls))
    assert max(counts) > 1  # parallel calls are allowed


def test_required_without_parallel_calls_is_one_call(oai):
    for seed in range(4):
        r = oai.chat.completions.create(model="hermes-random", messages=ask(seed), tools=openai_tools(),
                                        tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                        temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(r.choices[0].message.tool_calls) == 1
        valid_calls(r.choices[0].message.tool_calls)


def test_named_function_forces_that_call(oai):
    for seed in range(4):
        r = oai.chat.completions.create(model="hermes-random", messages=ask(seed), tools=openai_tools(),
                                        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=120,
                                        temperature=1.0, seed=seed)
        [call] = r.choices[0].message.tool_calls
        valid_calls([call], names=("add",))


def test_strict_tools_arguments_validate_and_without_strict_they_do_not(oai, tool_model):
    # the random model is nudged to open a call (<tool_call> is a token, biased up); what it
    # writes after that is random: strict makes every call valid, without it none is
    nudge = {str(call_token(tool_model)): 8}
    strict_calls = loose_calls = 0
    for seed in range(20):
        kwargs = dict(model="hermes-random", messages=ask(seed), max_tokens=120, temperature=1.0, seed=seed,
                      logit_bias=nudge, parallel_tool_calls=False)
        r = oai.chat.completions.create(tools=openai_tools(strict=True), **kwargs)
        if r.choices[0].message.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
            valid_calls(r.choices[0].message.tool_calls)
            strict_calls += 1
        loose = oai.chat.completions.create(tools=openai_tools(strict=False), **kwargs)
        for call in loose.choices[0].message.tool_calls or []:
            try:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
                loose_calls += 1
            except (KeyError, jsonschema.ValidationError):
                pass
    assert strict_calls >= 15, strict_calls
    assert loose_calls == 0  # the test can fail: unconstrained, the random model writes no valid call


def test_strict_tools_still_answer_in_text(oai):
    r = oai.chat.completions.create(model="hermes-random", messages=ask(0), tools=openai_tools(strict=True),
                                    max_tokens=12, temperature=1.0, seed=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_tool_choice_none_gives_text(oai):
    r = oai.chat.completions.create(model="hermes-random", messages=ask(1), tools=openai_tools(), tool_choice="none",
                                    max_tokens=12, temperature=1.0, seed=1)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_forced_call(oai):
    chunks = list(oai.chat.completions.create(model="hermes-random", messages=ask(2), tools=openai_tools(),
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              max_tokens=120, temperature=1.0, seed=2, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]
    jsonschema.validate(json.loads(deltas[0].function.arguments), WEATHER)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_anthropic_any_and_tool_force_valid_tool_use(claude):
    # no seed in the Messages API: one call per reply, whose bounded schema fits max_tokens whatever is drawn
    for _ in range(4):
        for choice, names in (({"type": "any", "disable_parallel_tool_use": True}, set(SCHEMAS)),
                              ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, {"get_weather"})):
            m = claude.messages.create(model="hermes-random", max_tokens=200, messages=ask(0), tools=ANTHROPIC_TOOLS,
                                       tool_choice=choice, extra_body={"temperature": 1.0})
            assert m.stop_reason == "tool_use", m
            [block] = m.content
            assert block.type == "tool_use" and block.name in names
            jsonschema.validate(block.input, SCHEMAS[block.name])


def test_anthropic_streamed_forced_tool_use(claude):
    with claude.messages.stream(model="hermes-random", max_tokens=200, messages=ask(5), tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].name == "add"
    jsonschema.validate(final.content[0].input, ADD)


def test_refusals(oai, claude, plain_server):
    bad = [(dict(tool_choice={"type": "function", "function": {"name": "mul"}}), "no tool named 'mul'"),
           (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
           (dict(tool_choice={"type": "allowed_tools"}), "tool_choice")]
    for kwargs, match in bad:
        with pytest.raises(openai.BadRequestError, match=match):
            oai.chat.completions.create(model="hermes-random", messages=ask(0), tools=openai_tools(), max_tokens=4, **kwargs)
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}}}]
    with pytest.raises(openai.BadRequestError, match="unsatisfiable") as err:  # a schema nothing fits: blamed on its tool
        oai.chat.completions.create(model="hermes-random", messages=ask(0), tools=openai_tools() + broken,
                                    tool_choice="required", max_tokens=4)
    assert err.value.body["param"] == "tools[2].function.parameters"
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        oai.chat.completions.create(model="hermes-random", messages=ask(0), tool_choice="required", max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match="no tool named 'mul'"):
        claude.messages.create(model="hermes-random", max_tokens=4, messages=ask(0), tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "mul"})
    # a model whose template writes no tool calls: forcing one or a strict tool is refused, naming the field
    plain = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="none", max_retries=0)
    for kwargs, param in ((dict(tools=openai_tools(), tool_choice="required"), "tool_choice"),
                          (dict(tools=openai_tools(strict=True)), "tools[0].function.strict")):
        with pytest.raises(openai.BadRequestError, match="no known tool-call convention") as err:
            plain.chat.completions.create(model="random-olmoe", messages=ask(0), max_tokens=4, **kwargs)
        assert err.value.body["param"] == param
    plain_claude = anthropic.Anthropic(base_url=plain_server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice: forcing a tool call is not supported"):
        plain_claude.messages.create(model="random-olmoe", max_tokens=4, messages=ask(0), tools=ANTHROPIC_TOOLS,
                                     tool_choice={"type": "any"})
    # not forced, not strict: unconstrained as before, on any model
    r = plain.chat.completions.create(model="random-olmoe", messages=ask(0), tools=openai_tools(), max_tokens=4)
    assert r.choices[0].message.content is not None

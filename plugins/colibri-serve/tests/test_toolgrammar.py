"""The grammars of forced and strict tool calls (colibri_serve.toolgrammar), without a
server: for each convention with a grammar (Hermes, Kimi, DeepSeek V3 and V3.1, and the
block-per-parameter ones of Qwen3-Coder and GLM), random
walks through the llguidance matcher (every step a token the mask allows, drawn at
random) write replies that toolcalls.py parses into calls of the given tools whose
arguments validate against the tools' schemas; markers that are special tokens are
written as those tokens; conventions without a grammar are refused."""

import json

import jsonschema
import llguidance
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer

from colibri_serve.service import ApiError
from colibri_serve.toolcalls import FORMATS
from colibri_serve.toolgrammar import (DEEPSEEK_V3, DEEPSEEK_V31, GLM, HERMES, KIMI, QWEN_XML, ToolChoice, convention,
                                       special_ids, tool_grammar)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}}, "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}

# convention, its toolcalls format, its markers, whether they are special tokens in the vocabulary
CASES = {
    "hermes": (HERMES, "qwen", ["<tool_call>", "</tool_call>"], False),
    "kimi": (KIMI, "kimi", ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                            "<|tool_call_argument_begin|>", "<|tool_call_end|>"], True),
    "deepseek-v3.1": (DEEPSEEK_V31, "deepseek", ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                                 "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"], True),
    "deepseek-v3": (DEEPSEEK_V3, "deepseek", ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                              "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"], True),
    "qwen3-coder": (QWEN_XML, "qwen", ["<tool_call>", "</tool_call>"], False),
    "glm": (GLM, "glm", ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"], True),
    # the same markers as text: a value's lexeme then takes its closing marker's text
    "glm-text": (GLM, "glm", ["<tool_call>", "</tool_call>"], False),
}


@pytest.fixture(scope="module")
def base_tokenizer(random_model):
    return (random_model / "tokenizer.json").read_text()


def vocabulary(base: str, markers: list[str], special: bool):
    """The random model's tokenizer with ``markers`` added, as HF's tokenizers and llguidance see it."""
    tok = Tokenizer.from_str(base)
    if special:
        tok.add_special_tokens(markers)
    else:
        tok.add_tokens([AddedToken(m, normalized=False) for m in markers])
    eos = tok.token_to_id("<|endoftext|>")
    n_vocab = -(-tok.get_vocab_size() // 64) * 64
    return tok, llguidance.LLTokenizer(tok.to_str(), n_vocab=n_vocab, eos_token=[eos]), n_vocab, eos


def walk(ll, grammar: str, n_vocab: int, eos: int, seed: int, prefix: list[int] = (), steps: int = 600) -> list[int]:
    """A reply the grammar allows: ``prefix``, then at each step a token drawn uniformly
    among those the mask allows, until the end of sequence token or the grammar's end."""
    matcher = llguidance.LLMatcher(ll, grammar)
    assert not matcher.is_error(), matcher.get_error()
    for t in prefix:
        assert matcher.consume_token(t), matcher.get_error()
    rng = np.random.default_rng(seed)
    bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    out = list(prefix)
    for _ in range(steps):
        if matcher.is_stopped():
            return out
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), count=n_vocab, bitorder="little"))
        token = int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        if token == eos:
            return out
        out.append(token)
    raise AssertionError(f"no end in {steps} steps: {ll.dbg_tokens(out)}")


def check_calls(parsed, names):
    assert parsed.tool_calls, parsed
    for call in parsed.tool_calls:
        assert call.name in names
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


def grammar(conv, ll, choice, strict=(True, True)):
    return llguidance.LLMatcher.grammar_from_lark(
        tool_grammar(conv, TOOLS, choice, list(strict), special_ids(ll), lambda i: f"tools[{i}].function.parameters"))


@pytest.mark.parametrize("case", list(CASES))
def test_forced_calls_parse_and_fit_their_schemas(base_tokenizer, case):
    conv, fmt, markers, special = CASES[case]
    tok, ll, n_vocab, eos = vocabulary(base_tokenizer, markers, special)
    lark = tool_grammar(conv, TOOLS, ToolChoice(forced=True), [False, False], special_ids(ll), str)
    if special:  # markers that are special tokens are those tokens in the grammar
        assert f"<[{tok.token_to_id(markers[0])}]>" in lark
    choices = {"any": (ToolChoice(forced=True), {"get_weather", "add"}),
               "one": (ToolChoice(forced=True, parallel=False), {"get_weather", "add"}),
               "named": (ToolChoice(forced=True, name="add", parallel=False), {"add"})}
    for what, (choice, names) in choices.items():
        g = grammar(conv, ll, choice, strict=(False, False))  # forced: every tool's arguments constrained all the same
        counts = []
        for seed in range(8):
            text = tok.decode(walk(ll, g, n_vocab, eos, seed, steps=2500), skip_special_tokens=False)
            parsed = FORMATS[fmt].parse(text, TOOLS)
            assert parsed.content == "", (what, text)
            check_calls(parsed, names)
            counts.append(len(parsed.tool_calls))
        if choice.parallel:
            assert max(counts) > 1, (what, counts)  # several calls in one reply
        else:
            assert counts == [1] * 8, (what, counts)


@pytest.mark.parametrize("case", list(CASES))
def test_strict_calls_in_free_text(base_tokenizer, case):
    conv, fmt, markers, special = CASES[case]
    tok, ll, n_vocab, eos = vocabulary(base_tokenizer, markers, special)
    g = grammar(conv, ll, ToolChoice(parallel=False))
    opening = markers[0]
    for seed in range(6):  # text, then a section the grammar writes from its opening marker on
        prefix = tok.encode("Let me see. " + opening, add_special_tokens=False).ids
        text = tok.decode(walk(ll, g, n_vocab, eos, seed, prefix), skip_special_tokens=False)
        parsed = FORMATS[fmt].parse(text, TOOLS)
        assert parsed.content == "Let me see.", text
        check_calls(parsed, {"get_weather", "add"})
        assert len(parsed.tool_calls) == 1
    # a text reply is one too: the grammar ends where the text does
    matcher = llguidance.LLMatcher(ll, g)
    assert matcher.consume_tokens(tok.encode("Sunny, 21 degrees.", add_special_tokens=False).ids)
    assert matcher.consume_token(eos)


def test_strict_arguments_are_refused_when_they_break_the_schema(base_tokenizer):
    tok, ll, _, _ = vocabulary(base_tokenizer, CASES["hermes"][2], False)
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": true}}\n</tool_call>'
    strict = grammar(HERMES, ll, ToolChoice(parallel=False))
    loose = grammar(HERMES, ll, ToolChoice(parallel=False), strict=(False, False))
    for bad in ('{"a": 700, "b": true}', '{"a": 7}', '{"a": 7, "b": true, "c": 1}'):
        text = good.replace('{"a": 7, "b": true}', bad)
        ids = tok.encode(text, add_special_tokens=False).ids
        assert llguidance.LLMatcher(ll, strict).validate_tokens(ids) < len(ids), bad
        assert llguidance.LLMatcher(ll, loose).validate_tokens(ids) == len(ids), bad  # a non-strict tool: any object
    ids = tok.encode(good, add_special_tokens=False).ids
    assert llguidance.LLMatcher(ll, strict).validate_tokens(ids) == len(ids)
    # an unknown tool's name is refused either way
    ids = tok.encode(good.replace('"add"', '"mul"'), add_special_tokens=False).ids
    assert llguidance.LLMatcher(ll, loose).validate_tokens(ids) < len(ids)


def test_conventions_of_the_chat_templates():
    assert convention("qwen", "... <tool_call>\n{{ tool_call | tojson }}</tool_call>")[0] is HERMES
    assert convention("kimi", "<|tool_calls_section_begin|>")[0] is KIMI
    assert convention("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name']")[0] is DEEPSEEK_V31
    assert convention("deepseek", "<｜tool▁calls▁begin｜>... '\\n```json\\n' ...")[0] is DEEPSEEK_V3
    assert convention("qwen", "<tool_call>\n<function={{ name }}>")[0] is QWEN_XML
    assert convention("glm", "<tool_call>{{ name }}<arg_key>")[0] is GLM
    for fmt, src, why in (("deepseek", "<｜DSML｜function_calls>", "DSML"),
                          ("glm", "<tool_call>{{ name }}", "writes no tool calls"),
                          (None, "", "no known tool-call convention"),
                          ("qwen", "no markers at all", "writes no tool calls")):
        conv, reason = convention(fmt, src)
        assert conv is None and why in reason


def test_parameters_must_be_an_object_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
    with pytest.raises(ApiError, match=r"tools\[0\].function.parameters: .*type object") as err:
        tool_grammar(HERMES, tools, ToolChoice(forced=True), [True], lambda m: None,
                     lambda i: f"tools[{i}].function.parameters")
    assert err.value.param == "tools[0].function.parameters"


def test_no_parameters_is_any_object(base_tokenizer):
    tok, ll, n_vocab, eos = vocabulary(base_tokenizer, CASES["hermes"][2], False)
    tools = [{"type": "function", "function": {"name": "now"}}]
    g = llguidance.LLMatcher.grammar_from_lark(tool_grammar(HERMES, tools, ToolChoice(forced=True, parallel=False),
                                                            [True], special_ids(ll), str))
    parsed = FORMATS["qwen"].parse(tok.decode(walk(ll, g, n_vocab, eos, 0), skip_special_tokens=False), tools)
    assert [c.name for c in parsed.tool_calls] == ["now"] and isinstance(parsed.tool_calls[0].arguments, dict)
    assert json.dumps(parsed.tool_calls[0].arguments)


def xml_call(name, params):
    """A Qwen3-Coder call as its chat template writes it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_block_arguments_are_refused_when_they_break_the_schema(base_tokenizer):
    tok, ll, _, _ = vocabulary(base_tokenizer, CASES["qwen3-coder"][2], False)
    tools = TOOLS + [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["text"]}}}]

    def accepts(g, text):
        ids = tok.encode(text, add_special_tokens=False).ids
        return llguidance.LLMatcher(ll, g).validate_tokens(ids) == len(ids)

    strict = llguidance.LLMatcher.grammar_from_lark(tool_grammar(
        QWEN_XML, tools, ToolChoice(forced=True, parallel=False), [True] * 3, special_ids(ll), str))
    loose = llguidance.LLMatcher.grammar_from_lark(tool_grammar(
        QWEN_XML, tools, ToolChoice(parallel=False), [True, True, False], special_ids(ll), str))
    good = xml_call("add", [("a", "7"), ("b", "true")])
    assert accepts(strict, good) and accepts(loose, good)
    for bad in ([("a", "700"), ("b", "true")], [("a", "7")], [("a", "7"), ("b", "true"), ("c", "1")],
                [("b", "true"), ("a", "7")], [("a", '"7"'), ("b", "true")]):
        assert not accepts(strict, xml_call("add", bad)), bad
    # bare text: anything but the texts that would end it early for the parser
    for text, ok in (("a < b && c </param", True), ("two\nlines\n", True), ("", True),
                     ("x</parameter>y", False), ("x</function>", False), ("</tool_call>", False)):
        call = xml_call("note", [("text", text), ("tags", '["a", "b"]')])
        assert accepts(strict, call) is ok, text
        if ok:
            parsed = FORMATS["qwen"].parse(call, tools)
            assert parsed.tool_calls[0].arguments == {"text": text, "tags": ["a", "b"]}
    assert not accepts(strict, xml_call("note", [("tags", '["a"]')]))  # text is required
    assert not accepts(strict, xml_call("note", [("text", "hi"), ("tags", "[1]")]))
    # a tool that is not strict among strict ones: any parameters, bare values
    assert accepts(loose, "Sure. " + xml_call("note", [("whatever", "x"), ("n", "[1]")]))
    assert not accepts(loose, "Sure. " + xml_call("note", [("bad name", "x")]))


@pytest.mark.parametrize("prop, why", [
    ({"type": "string", "pattern": "^[a-z]+$"}, "a string's pattern"),
    ({"type": "string", "format": "uri"}, "a string's format"),
    ({"type": "string", "maxLength": 5000}, "a maxLength above 512"),
])
def test_what_a_bare_value_cannot_enforce_is_refused(prop, why):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": prop}, "required": ["x"]}}}]
    with pytest.raises(ApiError, match=why) as err:
        tool_grammar(GLM, tools, ToolChoice(forced=True), [True], lambda m: None, lambda i: f"tools[{i}].function.parameters")
    assert err.value.param == "tools[0].function.parameters" and "cannot enforce" in str(err.value)
    tools[0]["function"]["parameters"] = {"type": "object", "anyOf": [{"required": ["x"]}], "properties": {"x": {}}}
    with pytest.raises(ApiError, match="'anyOf' in the parameters schema"):
        tool_grammar(QWEN_XML, tools, ToolChoice(forced=True), [True], lambda m: None, str)

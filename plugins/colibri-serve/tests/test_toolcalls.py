"""Tool calls read from scripted model outputs, one family convention at a time, and the
streaming view of a reply (stop strings, held-back markers)."""

import pytest

from colibri_serve.reply import ReplyStream
from colibri_serve.toolcalls import FORMATS, detect_format

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}]


def calls(parsed):
    return [(c.name, c.arguments) for c in parsed.tool_calls]


def test_qwen_hermes_json_calls_and_the_content_before_them():
    out = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    parsed = FORMATS["qwen"].parse(out, WEATHER)
    assert parsed.content == "Let me check."
    assert calls(parsed) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


def test_qwen_coder_xml_parameters_follow_the_schema_types():
    out = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n10001\n</parameter>\n</function>\n</tool_call>")
    parsed = FORMATS["qwen"].parse(out, WEATHER)
    assert parsed.content == ""
    assert calls(parsed) == [("get_weather", {"city": "New York", "days": 3, "zip": "10001"})]


def test_glm_arg_key_value_with_and_without_newlines():
    glm45 = "ok<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    glm47 = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call><tool_call>get_time</tool_call>"
    assert calls(FORMATS["glm"].parse(glm45, WEATHER)) == [("get_weather", {"city": "Paris", "days": 2})]
    assert FORMATS["glm"].parse(glm45, WEATHER).content == "ok"
    assert calls(FORMATS["glm"].parse(glm47, WEATHER)) == [("get_weather", {"city": "Rome"}), ("get_time", {})]


def test_deepseek_v3_v31_and_v32_dsml():
    v3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\"}\n```"
          "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    v31 = ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Lima\"}<｜tool▁call▁end｜>"
           "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    v32 = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
           '<｜DSML｜parameter name="city" string="true">Kyiv</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="days" string="false">4</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    fmt = FORMATS["deepseek"]
    assert calls(fmt.parse(v3)) == [("get_weather", {"city": "Oslo"})]
    parsed = fmt.parse(v31)
    assert parsed.content == "Sure." and calls(parsed) == [("get_weather", {"city": "Lima"}), ("get_time", {})]
    assert calls(fmt.parse(v32)) == [("get_weather", {"city": "Kyiv", "days": 4})]


def test_kimi_section_with_function_ids():
    out = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           "{\"city\": \"Tokyo\"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}"
           "<|tool_call_end|><|tool_calls_section_end|>")
    parsed = FORMATS["kimi"].parse(out)
    assert calls(parsed) == [("get_weather", {"city": "Tokyo"}), ("get_time", {})]
    assert [c.id for c in parsed.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]


@pytest.mark.parametrize("fmt,out", [
    ("qwen", "<tool_call>\n{not json}\n</tool_call>"),
    ("qwen", "<tool_call>{\"arguments\": {}}</tool_call>"),
    ("glm", "<tool_call>\n</tool_call>"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>"),
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops"),
])
def test_unreadable_calls_stay_content(fmt, out):
    parsed = FORMATS[fmt].parse(out, WEATHER)
    assert parsed.tool_calls == [] and parsed.content == out


def test_plain_text_has_no_calls():
    for fmt in FORMATS.values():
        parsed = fmt.parse("just words, no tools", WEATHER)
        assert parsed.content == "just words, no tools" and parsed.tool_calls == []


def test_format_detected_from_the_template_then_the_family():
    assert detect_format("{{ '<tool_call>' }}{{ tool_call.arguments | tojson }}", "olmoe").name == "qwen"
    assert detect_format("<tool_call>{{ name }}<arg_key>", None).name == "glm"
    assert detect_format("<｜tool▁calls▁begin｜>", None).name == "deepseek"
    assert detect_format("<|tool_calls_section_begin|>", None).name == "kimi"
    assert detect_format("{{ messages }}", "glm4-moe").name == "glm"
    assert detect_format("{{ messages }}", "olmoe") is None


def feed_all(stream, pieces):
    shown = [stream.feed(p) for p in pieces]
    tail, parsed = stream.finish()
    return "".join(shown) + tail, shown, parsed


def test_stop_strings_cut_the_reply_even_across_deltas():
    text, shown, _ = feed_all(s := ReplyStream(stops=["END", "\n\n"]), ["Hello E", "N", "D more"])
    assert text == "Hello " and s.stopped == "END"
    assert shown[0] == "Hello "  # "E" held back: it may begin "END"
    text, _, _ = feed_all(s := ReplyStream(stops=["END"]), ["Hello E", "nd"])
    assert text == "Hello End" and s.stopped is None


def test_tool_section_is_held_back_and_parsed_at_the_end():
    pieces = ["Checking", " <tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"]
    text, shown, parsed = feed_all(ReplyStream(tool_format=FORMATS["qwen"], tools=WEATHER), pieces)
    assert shown[:2] == ["Checking", " "] and shown[2:] == ["", ""]
    assert text.strip() == "Checking" and calls(parsed) == [("get_weather", {"city": "Paris"})]


def test_an_unreadable_tool_section_is_shown_as_text_at_the_end():
    text, _, parsed = feed_all(ReplyStream(tool_format=FORMATS["qwen"]), ["a <tool_call>", " nope"])
    assert text == "a <tool_call> nope" and parsed.tool_calls == []

"""Tool calls in a model's output, in the convention of its family's chat template.

Each format knows the marker that opens its tool-call section (text before it is the
reply's content) and how to read the calls after it:

- ``qwen``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5 / Qwen3,
  the Hermes convention) or ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  </function></tool_call>`` (Qwen3-Coder, Qwen3.5).
- ``glm``: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>``
  (GLM-4.5 to 4.7; newlines between the parts are optional).
- ``deepseek``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  ```json ARGS```<｜tool▁call▁end｜>...`` (V3), ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
  <｜tool▁call▁end｜>`` (V3.1), and the DSML blocks of V3.2 (``<｜DSML｜function_calls>``).
- ``kimi``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>ARGS<|tool_call_end|><|tool_calls_section_end|>``.

Model output is untrusted: a call that cannot be read is left in the content as text,
never an error of the server.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedReply:
    content: str
    tool_calls: list[ToolCall]


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _typed_value(raw: str, name: str, param_types: dict[str, str]) -> Any:
    """A parameter written as text (XML-style formats): kept as a string when the tool's
    schema says string (or the text is no JSON), else read as JSON."""
    if param_types.get(name) == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def param_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    """{tool name: {parameter: JSON schema type}} from OpenAI-style tool definitions."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") or {} if isinstance(fn, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict) and isinstance(v.get("type"), str)}
    return out


class ToolCallFormat:
    name = ""
    start = ""  # the marker that opens the tool-call section

    @property
    def markers(self) -> tuple[str, ...]:
        """Every text that opens a tool-call section in this convention."""
        return (self.start,)

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        """Split a finished reply into content and tool calls. With no readable call
        the whole text stays content."""
        at = text.find(self.start)
        if at < 0:
            return ParsedReply(text, [])
        calls = self._calls(text[at:], param_types(tools))
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(text[:at].rstrip(), calls)

    def _calls(self, section: str, types: dict[str, dict[str, str]]) -> list[ToolCall]:
        raise NotImplementedError


class TaggedCallFormat(ToolCallFormat):
    """Each call in a ``<tool_call>...</tool_call>`` block (Qwen, GLM): the formats
    differ in what a block holds (``_call``)."""

    start = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, section, types):
        calls = []
        for body in self._block.findall(section):
            call = self._call(body, types)
            if call is None:  # one unreadable call leaves the whole section as content
                return []
            calls.append(call)
        return calls

    def _call(self, body: str, types: dict[str, dict[str, str]]) -> ToolCall | None:
        raise NotImplementedError


class QwenFormat(TaggedCallFormat):
    name = "qwen"
    _function = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def _call(self, body, types):
        body = body.strip()
        if body.startswith("<function="):
            m = self._function.match(body)
            if not m:
                return None
            name = m.group(1).strip()
            args = {k.strip(): _typed_value(v, k.strip(), types.get(name, {})) for k, v in self._parameter.findall(m.group(2))}
            return ToolCall(name, args)
        obj = _json_object(body)
        if obj is None or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = _json_object(args)
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], args)


class GlmFormat(TaggedCallFormat):
    name = "glm"
    _arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _call(self, body, types):
        name, _, rest = body.partition("<arg_key>")
        name = name.strip()
        if not name or "<" in name or "\n" in name:
            return None
        args = {k.strip(): _typed_value(v.strip(), k.strip(), types.get(name, {}))
                for k, v in self._arg.findall("<arg_key>" + rest if rest else "")}
        return ToolCall(name, args)


class DeepSeekFormat(ToolCallFormat):
    name = "deepseek"
    start = "<｜tool▁calls▁begin｜>"
    dsml_start = "<｜DSML｜function_calls>"

    @property
    def markers(self):
        return (self.start, self.dsml_start)
    _call = re.compile(r"<｜tool▁call▁begin｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.DOTALL)
    _v3 = re.compile(r"^\s*(\w+)<｜tool▁sep｜>(.*?)\n```(?:json)?\n(.*?)\n```\s*$", re.DOTALL)
    _invoke = re.compile(r'<｜DSML｜invoke name="([^"]+)">(.*?)</｜DSML｜invoke>', re.DOTALL)
    _dsml_param = re.compile(r'<｜DSML｜parameter name="([^"]+)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.DOTALL)

    def parse(self, text, tools=None):
        if self.dsml_start in text and (self.start not in text or text.find(self.dsml_start) < text.find(self.start)):
            at = text.find(self.dsml_start)
            calls = self._dsml(text[at:])
            return ParsedReply(text[:at].rstrip(), calls) if calls else ParsedReply(text, [])
        return super().parse(text, tools)

    def _dsml(self, section):
        calls = []
        for name, body in self._invoke.findall(section):
            args = {}
            for key, is_string, value in self._dsml_param.findall(body):
                if is_string == "true":
                    args[key] = value
                else:
                    try:
                        args[key] = json.loads(value)
                    except ValueError:
                        return []
            calls.append(ToolCall(name.strip(), args))
        return calls

    def _calls(self, section, types):
        calls = []
        for body in self._call.findall(section):
            m = self._v3.match(body)
            if m:  # V3: type<sep>name ```json args```
                name, raw = m.group(2), m.group(3)
            else:  # V3.1: name<sep>args
                name, sep, raw = body.partition("<｜tool▁sep｜>")
                if not sep:
                    return []
            args = _json_object(raw.strip())
            if args is None or not name.strip():
                return []
            calls.append(ToolCall(name.strip(), args))
        return calls


class KimiFormat(ToolCallFormat):
    name = "kimi"
    start = "<|tool_calls_section_begin|>"
    _call = re.compile(r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>\s*(.*?)\s*(?:<\|tool_call_end\|>|$)", re.DOTALL)

    def _calls(self, section, types):
        calls = []
        for ident, raw in self._call.findall(section):
            name = ident.rsplit(":", 1)[0] if re.search(r":\d+$", ident) else ident
            name = name.removeprefix("functions.")
            args = _json_object(raw)
            if args is None or not name:
                return []
            calls.append(ToolCall(name, args, id=ident))
        return calls


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (QwenFormat(), GlmFormat(), DeepSeekFormat(), KimiFormat())}

# Family name prefixes (colibri list-families) and the convention their templates use.
FAMILY_FORMATS = {"qwen": "qwen", "glm": "glm", "deepseek": "deepseek", "kimi": "kimi"}


def detect_format(template_source: str | None, family: str | None) -> ToolCallFormat | None:
    """The tool-call convention of a model: read from the markers its chat template
    writes (a fine-tune may change the family's), else from its family; None when the
    model has no known convention (tool calls are then not parsed)."""
    src = template_source or ""
    if "<|tool_calls_section_begin|>" in src:
        return FORMATS["kimi"]
    if "tool▁calls▁begin" in src or "DSML" in src:
        return FORMATS["deepseek"]
    if "<arg_key>" in src:
        return FORMATS["glm"]
    if "<tool_call>" in src:
        return FORMATS["qwen"]
    for prefix, fmt in FAMILY_FORMATS.items():
        if family and family.startswith(prefix):
            return FORMATS[fmt]
    return None


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``:
    a streaming reply holds them back until the next token decides."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

"""Forced and strict tool calls: a grammar (llguidance Lark, with each tool's JSON Schema
inlined as ``%json``) that writes tool calls the way the model's family writes them
(toolcalls.py reads them back), so that the constrained decoding of
colibri_core.engine.constraints makes the calls parse and their arguments fit the tools'
schemas.

- forced (OpenAI ``tool_choice`` "required" or a named function, Anthropic ``any`` or
  ``tool``): the reply is a tool-call section and nothing else: one or more calls of the
  given tools (one call of the named tool; one call with ``parallel_tool_calls: false`` /
  ``disable_parallel_tool_use``), every call's arguments fitting its tool's schema;
- strict (a tool with ``"strict": true``, ``tool_choice`` auto): free text, in which a
  tool-call section may open: from its opening marker on, the calls are grammar-made,
  a strict tool's arguments fitting its schema, another tool's any JSON object, and the
  reply ends with the section.

Conventions with a grammar: with JSON arguments, Hermes (Qwen2.5 / Qwen3 ``<tool_call>
{"name": ..., "arguments": ...}</tool_call>``), Kimi (``<|tool_calls_section_begin|>``)
and DeepSeek V3 / V3.1 (``<｜tool▁calls▁begin｜>``); with a block per parameter (XML
style), Qwen3-Coder / Qwen3.5 (``<function=NAME><parameter=KEY>``) and GLM-4.5 to 4.7
(``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>``). In those a string parameter's
value is bare text (never one of the texts that would end it early for toolcalls.py) and
any other value is JSON fitting the parameter's schema; the parameters come in the
schema's order, the required ones always. DeepSeek V3.2's DSML has none yet: forcing a
call or a strict tool is refused there (400), never left unconstrained. A marker that is
a special token of the model's vocabulary is written as that token (``<[id]>``), else as
its text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

from colibri_serve.service import ApiError

# JSON written as json.dumps writes it (the engine's JSON_OPTIONS): no free whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

Piece = tuple[str, str]  # ("text" | "marker" | "regex", value)


def T(text: str) -> Piece:
    return ("text", text)


def M(marker: str) -> Piece:
    return ("marker", marker)


@dataclass(frozen=True)
class Convention:
    """How a family writes a tool-call section with JSON arguments: ``open`` the section,
    then each call (``call_open(name)``, the arguments, ``call_close``) with ``sep``
    between calls, then ``close``. The first piece of ``open + call_open`` is the same for
    every tool: the trigger that opens a section in free text."""

    name: str
    open: tuple[Piece, ...]
    call_open: Callable[[str], tuple[Piece, ...]]
    call_close: tuple[Piece, ...]
    sep: tuple[Piece, ...]
    close: tuple[Piece, ...]
    params: "ParamBlocks | None" = None  # arguments as a block per parameter; None: a JSON object


@dataclass(frozen=True)
class ParamBlocks:
    """Arguments written as one block per parameter (XML-style conventions): ``key_open``
    the pieces before a parameter's value (``key`` a piece: the name as text, or a regex of
    any name), ``value_close`` those after it; ``ends`` the texts a bare string value must
    not hold (toolcalls.py would end the value, the call or the section there)."""

    key_open: Callable[[Piece], tuple[Piece, ...]]
    value_close: tuple[Piece, ...]
    ends: tuple[str, ...]
    any_key: str  # the regex of a parameter name when the arguments are not constrained


HERMES = Convention(
    "hermes", (), lambda name: (M("<tool_call>"), T('\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')),
    (T("}\n"), M("</tool_call>")), (T("\n"),), ())
KIMI = Convention(
    "kimi", (M("<|tool_calls_section_begin|>"),),
    lambda name: (M("<|tool_call_begin|>"), T(f"functions.{name}:"), ("regex", "0|[1-9][0-9]{0,3}"), M("<|tool_call_argument_begin|>")),
    (M("<|tool_call_end|>"),), (), (M("<|tool_calls_section_end|>"),))
DEEPSEEK_V31 = Convention(
    "deepseek-v3.1", (M("<｜tool▁calls▁begin｜>"),), lambda name: (M("<｜tool▁call▁begin｜>"), T(name), M("<｜tool▁sep｜>")),
    (M("<｜tool▁call▁end｜>"),), (), (M("<｜tool▁calls▁end｜>"),))
DEEPSEEK_V3 = Convention(
    "deepseek-v3", (M("<｜tool▁calls▁begin｜>"),),
    lambda name: (M("<｜tool▁call▁begin｜>"), T("function"), M("<｜tool▁sep｜>"), T(name + "\n```json\n")),
    (T("\n```"), M("<｜tool▁call▁end｜>")), (T("\n"),), (M("<｜tool▁calls▁end｜>"),))

QWEN_XML = Convention(
    "qwen3-coder", (), lambda name: (M("<tool_call>"), T(f"\n<function={name}>\n")),
    (T("</function>\n"), M("</tool_call>")), (T("\n"),), (),
    ParamBlocks(lambda key: (T("<parameter="), key, T(">\n")), (T("\n</parameter>\n"),),
                ("</parameter>", "</function>", "</tool_call>"), r"[A-Za-z0-9_.\-]{1,64}"))
GLM = Convention(
    "glm", (), lambda name: (M("<tool_call>"), T(name + "\n")), (M("</tool_call>"),), (T("\n"),), (),
    ParamBlocks(lambda key: (M("<arg_key>"), key, M("</arg_key>"), T("\n"), M("<arg_value>")),
                (M("</arg_value>"), T("\n")), ("</arg_value>", "</tool_call>"), r"[A-Za-z0-9_.\-]{1,64}"))

# a bare string value with a maxLength above this is refused: llguidance's lexer gives up
# on longer counted repetitions intersected with the value's forbidden texts (measured:
# values of 2 characters refused under {0,1000}; every case right up to {0,900})
MAX_BARE_LENGTH = 512
# what a parameters schema may hold for its parameters to be written as blocks
BLOCK_SCHEMA_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$defs",
                     "definitions", "$schema", "x-guidance"}


def convention(format_name: str | None, template_source: str | None) -> tuple[Convention | None, str]:
    """The grammar convention of a model (its toolcalls format and chat template), or None
    and why there is none."""
    src = template_source or ""
    if format_name is None:
        return None, "this model has no known tool-call convention"
    if format_name == "qwen":
        if "<function=" in src:
            return QWEN_XML, ""
        if "<tool_call>" in src:
            return HERMES, ""
    elif format_name == "kimi":
        if "<|tool_calls_section_begin|>" in src:
            return KIMI, ""
    elif format_name == "deepseek":
        if "DSML" in src:
            return None, "its tool-call convention (DeepSeek V3.2 DSML) has no grammar in colibri yet"
        if "tool▁calls▁begin" in src:
            return (DEEPSEEK_V3 if "```json" in src else DEEPSEEK_V31), ""
    elif format_name == "glm":
        if "<arg_key>" in src:
            return GLM, ""
    return None, "its chat template writes no tool calls in a convention colibri has a grammar for"


@dataclass(frozen=True)
class ToolChoice:
    """What a request asks of tool calls: ``forced`` (a call must come: of ``name`` if
    given, else of any tool; False: text or calls, as the model chooses) and ``parallel``
    (several calls in one reply allowed)."""

    forced: bool = False
    name: str | None = None
    parallel: bool = True
    param: str = "tool_choice"  # the request field a refusal names


def _schema(tool: dict, strict: bool, where: str) -> dict:
    """The JSON Schema a call's arguments must fit (``strict``: the tool's parameters; else
    any JSON object), with the engine's JSON layout."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") if strict else None
    if params is None:
        params = {"type": "object"}
    if not isinstance(params, dict):
        raise ApiError("bad_request", f"{where}: the parameters must be a JSON Schema object", param=where)
    params = dict(params)
    params.setdefault("type", "object")
    if params["type"] != "object":
        raise ApiError("bad_request", f"{where}: a tool's parameters must be a schema of type object, got "
                       f"{params['type']!r}", param=where)
    given = params.get("x-guidance")
    params["x-guidance"] = {**JSON_OPTIONS, **(given if isinstance(given, dict) else {})}
    return params


def _lark_piece(piece: Piece, special_id: Callable[[str], int | None]) -> str:
    kind, value = piece
    if kind == "regex":
        return f"/{value}/"
    if kind == "marker":
        token = special_id(value)
        if token is not None:
            return f"<[{token}]>"
    return json.dumps(value, ensure_ascii=False)


def tool_grammar(conv: Convention, tools: list[dict], choice: ToolChoice, strict: list[bool],
                 special_id: Callable[[str], int | None], where: Callable[[int], str]) -> str:
    """The Lark grammar of a reply to ``tools`` (OpenAI-style definitions) under
    ``choice``: ``strict[i]`` says whether tool i's arguments are constrained (forced
    calls constrain every tool's); ``special_id(marker)`` the token id of a marker that is
    a special token (None: text); ``where(i)`` names tool i's schema in errors."""

    def seq(pieces) -> str:
        return " ".join(_lark_piece(p, special_id) for p in pieces)

    names = [t.get("function", t)["name"] for t in tools]
    picked = [i for i, n in enumerate(names) if choice.name is None or n == choice.name]
    lines = ["%llguidance {}"]
    for i in picked:
        schema = _schema(tools[i], choice.forced or strict[i], where(i))
        if conv.params is None:
            lines.append(f"args{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        else:
            lines += _param_blocks(conv.params, i, schema, where(i), special_id)
        opened = conv.call_open(names[i])
        lines.append(f"call{i}: {seq(opened)} args{i} {seq(conv.call_close)}")
        if not choice.forced and not conv.open:  # a call after the trigger that opened the section
            lines.append(f"rest{i}: {seq(opened[1:])} args{i} {seq(conv.call_close)}")
    lines.append("call: " + " | ".join(f"call{i}" for i in picked))
    more = f"({seq(conv.sep)} call)*" if choice.parallel else ""
    if choice.forced:
        lines.append(f"start: {seq(conv.open)} call {more} {seq(conv.close)}")
        return "\n".join(lines) + "\n"
    # free text, or text in which a section opens at the trigger (a lazy lexeme: the text
    # up to its first occurrence), or at the trigger's special token; the reply ends with
    # the section (toolcalls.py would drop text after it)
    trigger = (conv.open + conv.call_open(names[0]))[0]
    if conv.open:
        after = f"{seq(conv.open[1:])} call {more} {seq(conv.close)}"
    else:
        after = "(" + " | ".join(f"rest{i}" for i in picked) + f") {more} {seq(conv.close)}"
    token = special_id(trigger[1]) if trigger[0] == "marker" else None
    if token is not None:
        lines.append(f"section: TEXT <[{token}]> {after}")
    else:
        lines.append(f"opening[lazy]: TEXT {json.dumps(trigger[1], ensure_ascii=False)}")
        lines.append(f"section: opening {after}")
    lines += ["start: TEXT | section", r"TEXT: /(.|\n)*/"]
    return "\n".join(lines) + "\n"


def _regex_text(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` regex."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$/-" else c for c in text)


def _param_blocks(blocks: ParamBlocks, i: int, schema: dict, where: str,
                  special_id: Callable[[str], int | None]) -> list[str]:
    """The Lark rules of tool i's arguments as parameter blocks (``args{i}``): its
    schema's properties in order, each required one always there; a string property's
    value bare text, any other JSON fitting its schema. A schema that names no
    properties takes any parameters with bare values. What a block cannot enforce is
    refused (400 naming ``where``)."""

    def seq(pieces) -> str:
        return " ".join(_lark_piece(p, special_id) for p in pieces)

    def refuse(why: str):
        raise ApiError("bad_request", f"{where}: {why}, which this model's tool-call format (a block per parameter, "
                       "string values bare) cannot enforce", param=where)

    # the value's lexeme takes the text that closes it (a greedy value would swallow it
    # otherwise): the close's leading pieces written as text, up to a special token
    close = list(blocks.value_close)
    closing_text = ""
    while close and (close[0][0] == "text" or special_id(close[0][1]) is None):
        closing_text += close.pop(0)[1]
    after = seq(close)
    closing = json.dumps(closing_text, ensure_ascii=False) if closing_text else ""
    ends = "|".join(_regex_text(e) for e in blocks.ends)
    outside = f"~/(.|\\n)*({ends})(.|\\n)*/"

    def bare(name: str, low: int = 0, high: int | None = None) -> str:
        """A terminal: bare text of low..high characters holding none of the ends, then the closing text."""
        count = "*" if not low and high is None else f"{{{low},{'' if high is None else high}}}"
        lines.append(f"{name}: (/(.|\\n){count}/ & {outside}) {closing}")
        return f"{name} {after}"

    lines: list[str] = []
    props = schema.get("properties")
    if not props:  # any parameters, values bare
        lines.append(f"pany{i}: {seq(blocks.key_open(('regex', blocks.any_key)))} {bare(f'PANY{i}')}")
        lines.append(f"args{i}: pany{i}*")
        return lines
    if not isinstance(props, dict):
        refuse("properties that are not an object")
    extra = sorted(set(schema) - BLOCK_SCHEMA_KEYS)
    if extra:
        refuse(f"{extra[0]!r} in the parameters schema")
    required = schema.get("required") or []
    if not isinstance(required, list) or any(r not in props for r in required):
        refuse("a required parameter that is not among its properties")
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts = []
    for k, (key, sub) in enumerate(props.items()):
        if not re.fullmatch(blocks.any_key, key):
            refuse(f"the parameter name {key!r}")
        opened = seq(blocks.key_open(T(key)))
        if isinstance(sub, dict) and sub.get("type") == "string":
            for keyword in ("pattern", "format", "contentEncoding", "contentMediaType"):
                if keyword in sub:
                    refuse(f"parameter {key!r}: a string's {keyword}")
            values = sub["enum"] if "enum" in sub else [sub["const"]] if "const" in sub else None
            if values is not None:
                texts = [v for v in values if isinstance(v, str)]
                if not texts:
                    refuse(f"parameter {key!r}: a string enum without strings")
                choices = " | ".join(json.dumps(t + closing_text, ensure_ascii=False) for t in texts)
                lines.append(f"p{i}_{k}: {opened} ({choices}) {after}")
            else:
                low, high = sub.get("minLength", 0), sub.get("maxLength")
                if not isinstance(low, int) or (high is not None and not isinstance(high, int)):
                    refuse(f"parameter {key!r}: a length that is not an integer")
                if high is not None and high > MAX_BARE_LENGTH:
                    refuse(f"parameter {key!r}: a maxLength above {MAX_BARE_LENGTH}")
                lines.append(f"p{i}_{k}: {opened} {bare(f'PV{i}_{k}', low, high)}")
        else:
            value = {**sub, **defs, "x-guidance": JSON_OPTIONS} if isinstance(sub, dict) else {}
            lines.append(f"p{i}_{k}: {opened} %json {json.dumps(value, ensure_ascii=False)} {closing} {after}")
        parts.append(f"p{i}_{k}" if key in required else f"p{i}_{k}?")
    lines.append(f"args{i}: {' '.join(parts)}")
    return lines


def special_ids(tokenizer) -> Callable[[str], int | None]:
    """``special_id`` for tool_grammar from a model's llguidance tokenizer: the id of the
    special token whose text is ``marker``, None when the marker is not one."""

    def special_id(marker: str) -> int | None:
        ids = tokenizer.tokenize_str(marker, parse_special=True)
        if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
            return int(ids[0])
        return None

    return special_id


def check_choice(tools: list[dict] | None, choice: ToolChoice, param: str) -> None:
    """A forced call needs tools, and a named one a tool of that name (400 naming ``param``)."""
    if not tools:
        raise ApiError("bad_request", f"{param}: forcing a tool call needs tools", param=param)
    if choice.name is not None and choice.name not in [t.get("function", t).get("name") for t in tools]:
        raise ApiError("bad_request", f"{param}: no tool named {choice.name!r} among the request's tools", param=param)


def tool_constraint(service, tools: list[dict] | None, choice: ToolChoice, strict: list[bool],
                    schema_param: Callable[[int], str], strict_param: Callable[[int], str]):
    """What a reply with ``tools`` must fit under ``choice`` (a ConstraintSpec), or None
    when nothing is forced and no tool is strict. A model whose convention has no grammar
    is refused with a 400 naming the field that asked (never left unconstrained)."""
    from colibri_core.engine.constraints import ConstraintSpec, model_grammar_tokenizer
    from colibri_core.errors import UsageError

    if choice.forced:
        check_choice(tools, choice, choice.param)
    if not tools or not (choice.forced or any(strict)):
        return None
    param = choice.param if choice.forced else strict_param(strict.index(True))
    what = "forcing a tool call" if choice.forced else "a strict tool"
    fmt = service.tool_format
    conv, why = convention(fmt.name if fmt is not None else None, service.template_source)
    if conv is None:
        raise ApiError("bad_request", f"{param}: {what} is not supported for this model: {why}", param=param)
    try:
        special_id = special_ids(model_grammar_tokenizer(service.model, param))
    except UsageError as exc:
        raise ApiError("bad_request", str(exc), param=param) from None
    text = tool_grammar(conv, tools, choice, strict, special_id, schema_param)
    spec = ConstraintSpec.grammar(text, "lark", name=f"tools ({conv.name} tool-call grammar)")
    try:
        service.compiled(spec, "tools")  # compiled now (and kept) so that a bad schema is blamed on its tool
    except ApiError:
        for i, tool in enumerate(tools):
            if choice.name not in (None, tool.get("function", tool).get("name")):
                continue
            one = ConstraintSpec.json_schema(_schema(tool, choice.forced or strict[i], schema_param(i)), name=schema_param(i))
            try:
                service.compiled(one, schema_param(i))
            except ApiError as err:
                raise err from None
        raise
    return spec

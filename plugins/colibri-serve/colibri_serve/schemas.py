"""Request bodies of the OpenAI and Anthropic APIs, as far as colibri serves them.

Fields the APIs define but colibri cannot honour are refused with a 400 naming them
(see ``unsupported``), never silently ignored; unknown fields are ignored, as the
vendors' servers do."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOPS = 16
MAX_STOP_CHARS = 256
JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object",
              type(None): "null"}


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- OpenAI ----------------------------------------------------------------------------
class FunctionDef(_Loose):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: a call's arguments are constrained to ``parameters``


class ToolDef(_Loose):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCallOut(_Loose):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Loose):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessage(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Loose):
    include_usage: bool = False


class ChatCompletionRequest(_Loose):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # not OpenAI's, accepted as vLLM does
    seed: int | None = None
    stop: str | list[str] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (held where a grammar writes the calls)
    n: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Any] | None = None  # token id (a string) -> bias from -100 to 100, checked by the route
    response_format: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM's extension: the generated token ids in the reply


class CompletionRequest(_Loose):
    model: str
    prompt: str | list[str] | list[int]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Any] | None = None
    suffix: str | None = None
    return_token_ids: bool = False


# -- Anthropic -------------------------------------------------------------------------
class AnthropicTool(_Loose):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None  # true: a call's input is constrained to ``input_schema``


class AnthropicMessage(_Loose):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Loose):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # structured outputs: {"format": {"type": "json_schema", ...}}
    # features run on Anthropic's side: refused by the route, not ignored
    mcp_servers: list[dict[str, Any]] | None = None
    container: str | dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None


class CountTokensRequest(_Loose):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None


def stop_list(stop: str | list[str] | None, param: str) -> list[str]:
    from colibri_serve.service import ApiError

    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError("bad_request", f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters", param=param)
    return [s for s in stops if s]


def text_field(part: dict, where: str) -> str:
    """The ``text`` of a text content part or block, which must be a string."""
    from colibri_serve.service import ApiError

    if "text" not in part:
        raise ApiError("bad_request", f"{where}: a text part needs a text string", param=f"{where}.text")
    text = part["text"]
    if not isinstance(text, str):
        raise ApiError("bad_request", f"{where}.text: must be a string, not {JSON_TYPES.get(type(text), type(text).__name__)}",
                       param=f"{where}.text")
    return text


def unsupported(param: str, why: str):
    from colibri_serve.service import ApiError

    return ApiError("bad_request", f"{param}: {why} is not supported by colibri serve", param=param)

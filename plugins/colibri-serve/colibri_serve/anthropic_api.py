"""The Anthropic Messages API: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from colibri_serve.jsonbody import JsonRoute
from colibri_serve.schemas import CountTokensRequest, MessagesRequest, stop_list, text_field, unsupported
from colibri_serve.service import ApiError, Job, Service, started
from colibri_serve.toolgrammar import ToolChoice, tool_constraint

STOP_REASON = {"stop": "end_turn", "cancelled": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens",
               "tool_calls": "tool_use"}


def error_body(err: ApiError) -> dict:
    kinds = {"bad_request": "invalid_request_error", "context_length_exceeded": "invalid_request_error",
             "unauthorized": "authentication_error", "not_found": "not_found_error", "no_route": "not_found_error",
             "method_not_allowed": "invalid_request_error", "too_large": "request_too_large", "queue_full": "rate_limit_error",
             "loading": "overloaded_error", "shutting_down": "overloaded_error", "engine_error": "api_error",
             "weights_unreadable": "api_error", "misdirected": "invalid_request_error"}
    return {"type": "error", "error": {"type": kinds[err.kind], "message": err.message}}


def _block_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content or []):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise unsupported(f"{where}[{i}]", f"a block of type {block.get('type') if isinstance(block, dict) else None!r}")
        texts.append(text_field(block, f"{where}[{i}]"))
    return "".join(texts)


def template_messages(body) -> list[dict[str, Any]]:
    """Anthropic messages as chat templates take them: tool_use blocks become the
    assistant's tool calls, tool_result blocks messages of role "tool"."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _block_text(body.system, "system")})
    names: dict[str, str] = {}
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results = [], [], []
        for j, block in enumerate(m.content):
            kind = block.get("type")
            if kind == "text":
                texts.append(text_field(block, f"{where}[{j}]"))
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning: templates drop it from past turns too
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise ApiError("bad_request", f"{where}[{j}]: tool_use needs a name and an input object", param=where)
                cid = str(block.get("id") or f"toolu_{i}_{j}")
                names[cid] = block["name"]
                calls.append({"id": cid, "type": "function", "function": {"name": block["name"], "arguments": block.get("input", {})}})
            elif kind == "tool_result" and m.role == "user":
                cid = str(block.get("tool_use_id", ""))
                text = _block_text(block.get("content", ""), f"{where}[{j}].content")
                result = {"role": "tool", "tool_call_id": cid, "content": ("Error: " + text) if block.get("is_error") else text}
                if cid in names:
                    result["name"] = names[cid]
                results.append(result)
            else:
                raise unsupported(f"{where}[{j}]", f"a {m.role} block of type {kind!r}")
        out.extend(results)
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_choice(body) -> ToolChoice | None:
    """``tool_choice`` as a ToolChoice; None: "none"."""
    raw = body.tool_choice or {}
    choice = raw.get("type", "auto")
    parallel = not raw.get("disable_parallel_tool_use", False)
    if choice == "any":
        return ToolChoice(forced=True, parallel=parallel)
    if choice == "tool":
        if not isinstance(raw.get("name"), str):
            raise ApiError("bad_request", "tool_choice: type tool needs the tool's name", param="tool_choice.name")
        return ToolChoice(forced=True, name=raw["name"], parallel=parallel)
    if choice == "none":
        return None
    if choice != "auto":
        raise ApiError("bad_request", f"tool_choice.type must be auto, any, tool or none, got {choice!r}", param="tool_choice")
    return ToolChoice(parallel=parallel)


def _tools(body, service: Service | None = None):
    """The tools as templates take them, and the constraint that forced or strict calls
    put on the reply (None: none; ``service`` None: no constraint, for count_tokens)."""
    choice = _tool_choice(body)
    if choice is None or not body.tools:
        if choice is not None and choice.forced:
            raise ApiError("bad_request", "tool_choice: forcing a tool call needs tools", param="tool_choice")
        return None, None
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
             for t in body.tools]
    if service is None:
        return tools, None
    strict = [bool(getattr(t, "strict", None)) for t in body.tools]
    constraint = tool_constraint(service, tools, choice, strict, lambda i: f"tools[{i}].input_schema",
                                 lambda i: f"tools[{i}].strict")
    return tools, constraint


def output_constraint(body: MessagesRequest):
    """The ConstraintSpec of ``output_config.format`` (structured outputs: the reply is
    JSON fitting ``schema``), or None; ``effort`` (a thinking budget) is refused."""
    from colibri_core.engine.constraints import ConstraintSpec

    config = body.output_config
    if not config:
        return None
    unknown = sorted(set(config) - {"format", "effort"})
    if unknown:
        raise ApiError("bad_request", f"output_config.{unknown[0]}: not a field of output_config (format, effort)",
                       param=f"output_config.{unknown[0]}")
    if config.get("effort") is not None:
        raise unsupported("output_config.effort", "an effort level (no thinking budget)")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError("bad_request", 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                       param="output_config.format")
    return ConstraintSpec.json_schema(fmt["schema"], name="output_config.format")


def check_unsupported(body: MessagesRequest) -> None:
    """Fields whose effect colibri cannot give are refused, not ignored: extended
    thinking (colibri returns no thinking blocks and cannot hold a thinking budget) and
    what runs on Anthropic's side (MCP servers, code-execution containers, context editing)."""
    thinking = (body.thinking or {}).get("type", "disabled")
    if thinking != "disabled":
        raise unsupported("thinking", f"thinking of type {thinking!r} (no thinking blocks)")
    for field in ("mcp_servers", "container", "context_management"):
        if getattr(body, field):
            raise unsupported(field, f"{field} (a feature of Anthropic's servers)")


def _usage(job: Job) -> dict:
    prompt = job.usage.get("prompt_tokens", len(job.prompt_ids))
    cached = job.usage.get("cached_tokens", 0)
    return {"input_tokens": prompt - cached, "output_tokens": job.usage.get("completion_tokens", len(job.token_ids)),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def router(service: Service) -> APIRouter:
    api = APIRouter(route_class=JsonRoute)

    async def prompt_ids(body, constrain: bool = True) -> tuple[list[int], list[dict] | None, Any, float]:
        service.check_model(body.model)
        service.require_ready()
        tools, constraint = _tools(body, service if constrain else None)
        ids, took = await service.tokenize(service.chat_ids, template_messages(body), tools)
        return ids, tools, constraint, took

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        ids, _, _, _ = await prompt_ids(body, constrain=False)
        return {"input_tokens": len(ids)}

    @api.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        check_unsupported(body)
        output = output_constraint(body)
        ids, tools, constraint, took = await prompt_ids(body)
        if output is not None and constraint is not None:
            raise unsupported("output_config.format", "a structured output together with a forced or strict tool")
        service.check_prompt(ids, "messages")
        job = Job(ids, service.max_tokens(body.max_tokens, len(ids)), stops=stop_list(body.stop_sequences, "stop_sequences"),
                  tools=tools, constraint=constraint or output,
                  constraint_param="tools" if constraint is not None else "output_config.format", tokenize_s=took,
                  **service.sampling(body.temperature, body.top_p, body.top_k))
        mid = f"msg_{uuid.uuid4().hex}"
        head = {"id": mid, "type": "message", "role": "assistant", "model": service.model_name}
        if not body.stream:
            content = await service.run(job, request.is_disconnected)
            blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
            blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in job.parsed.tool_calls]
            return {**head, "content": blocks, "stop_reason": STOP_REASON[job.finish_reason], "stop_sequence": job.stop_sequence,
                    "usage": _usage(job)}

        gen = service.stream(job, request.is_disconnected)
        await started(gen)

        async def events():
            yield _event("message_start", {"type": "message_start", "message": {
                **head, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
            yield _event("ping", {"type": "ping"})
            index, text_open = 0, False
            try:
                async for piece in gen:
                    if not piece:
                        continue
                    if not text_open:
                        yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                             "content_block": {"type": "text", "text": ""}})
                        text_open = True
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": {"type": "text_delta", "text": piece}})
                if text_open:
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                for call in job.parsed.tool_calls:
                    yield _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                        "type": "tool_use", "id": call.id, "name": call.name, "input": {}}})
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": {"type": "input_json_delta", "partial_json": call.arguments_json}})
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                usage = _usage(job)
                yield _event("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": STOP_REASON[job.finish_reason], "stop_sequence": job.stop_sequence},
                    "usage": {"output_tokens": usage["output_tokens"]}})
                yield _event("message_stop", {"type": "message_stop"})
            except ApiError as err:
                yield _event("error", error_body(err))
            finally:
                await gen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return api

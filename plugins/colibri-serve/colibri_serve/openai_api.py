"""The OpenAI API: /v1/models, /v1/chat/completions and /v1/completions."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from colibri_serve.jsonbody import JsonRoute
from colibri_serve.logprobs import LogprobWriter, chat_logprobs, logit_bias, response_constraint
from colibri_serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, stop_list, text_field, unsupported
from colibri_serve.service import ApiError, Job, Service, started
from colibri_serve.toolgrammar import ToolChoice, tool_constraint

FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


def error_body(err: ApiError) -> dict:
    kinds = {"bad_request": ("invalid_request_error", None), "context_length_exceeded": ("invalid_request_error", "context_length_exceeded"),
             "unauthorized": ("invalid_request_error", "invalid_api_key"), "not_found": ("invalid_request_error", "model_not_found"),
             "no_route": ("invalid_request_error", "not_found"), "method_not_allowed": ("invalid_request_error", None),
             "too_large": ("invalid_request_error", "request_too_large"), "queue_full": ("rate_limit_error", "rate_limit_exceeded"),
             "loading": ("server_error", "model_loading"), "shutting_down": ("server_error", None),
             "engine_error": ("server_error", None), "weights_unreadable": ("server_error", "weights_unreadable"),
             "misdirected": ("invalid_request_error", "misdirected_request")}
    type_, code = kinds[err.kind]
    return {"error": {"message": err.message, "type": type_, "param": err.param, "code": code}}


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.get("type") != "text":
            raise unsupported(f"{where}[{i}]", f"a content part of type {part.get('type')!r}")
        parts.append(text_field(part, f"{where}[{i}]"))
    return "".join(parts)


def _arguments(raw, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        raise ApiError("bad_request", f"{where}: arguments are not JSON", param=where) from None
    if not isinstance(value, dict):
        raise ApiError("bad_request", f"{where}: arguments must be a JSON object", param=where)
    return value


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them (Hugging Face's conventions: tool
    call arguments as objects, tool results as role "tool")."""
    out = []
    names = {}  # tool_call_id -> function name, for templates that print the tool's name
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": _text(m.content, f"{where}.content")}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                cid = c.id or f"call_{i}_{j}"
                names[cid] = c.function.name
                calls.append({"id": cid, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments, f"{where}.tool_calls[{j}].function")}})
            msg["tool_calls"] = calls
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
            if m.tool_call_id in names:
                msg["name"] = names[m.tool_call_id]
        elif m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def _tool_choice(req: ChatCompletionRequest) -> ToolChoice | None:
    """``tool_choice`` (and ``parallel_tool_calls``) as a ToolChoice; None: "none"."""
    choice, parallel = req.tool_choice, req.parallel_tool_calls is not False
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError("bad_request", "tool_choice: an object must be {\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", param="tool_choice")
        return ToolChoice(forced=True, name=fn["name"], parallel=False)
    if choice == "required":
        return ToolChoice(forced=True, parallel=parallel)
    if choice == "none":
        return None
    if choice not in (None, "auto"):
        raise ApiError("bad_request", f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}",
                       param="tool_choice")
    return ToolChoice(parallel=parallel)


def _tools(req: ChatCompletionRequest, service: Service):
    """The tools as templates take them, and the constraint that forced or strict calls
    put on the reply (None: none)."""
    choice = _tool_choice(req)
    if choice is None:
        return None, None
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    strict = [bool(t.function.strict) for t in req.tools or []]
    constraint = tool_constraint(service, tools, choice, strict, lambda i: f"tools[{i}].function.parameters",
                                 lambda i: f"tools[{i}].function.strict")
    return tools, constraint


def _penalties(body, service: Service) -> dict:
    """A request's logit bias and frequency / presence penalties, as Job takes them."""
    return dict(frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
                logit_bias=logit_bias(body.logit_bias, service.vocab_size))


def _usage(job: Job, *more: Job) -> dict:
    """OpenAI's usage of a reply; of several choices (``more``), the prompt once and every
    choice's completion tokens."""
    prompt = job.usage.get("prompt_tokens", len(job.prompt_ids))
    completion = sum(j.usage.get("completion_tokens", len(j.token_ids)) for j in (job, *more))
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": job.usage.get("cached_tokens", 0)}}
    if "accepted_prediction_tokens" in job.usage:  # drafted tokens (serve --draft), in OpenAI's fields for them
        out["completion_tokens_details"] = {k: sum(j.usage.get(k, 0) for j in (job, *more))
                                            for k in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
    return out


def _event_stream(gen, events) -> StreamingResponse:
    """The server-sent events of a streamed reply: ``events`` (an async iterator of
    ``_sse`` lines) followed by [DONE]; an ApiError in the middle becomes an error event,
    and the generation ``gen`` is closed however the stream ends (the client gone too)."""

    async def stream():
        try:
            async for event in events:
                yield event
        except ApiError as err:
            yield _sse(error_body(err))
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


MAX_CHOICES = 8  # choices (n) of one chat completion: each a sequence of the batched engine

# sampling fields other servers take (vLLM, llama.cpp) that colibri does not implement:
# refused by name rather than accepted and ignored
UNSUPPORTED_SAMPLING = ("min_p", "repetition_penalty", "typical_p", "top_a", "tfs_z", "mirostat", "min_tokens",
                        "guided_json", "guided_regex", "guided_grammar", "guided_choice", "grammar", "json_schema")


def refuse_unknown_sampling(body) -> None:
    for name in UNSUPPORTED_SAMPLING:
        if (body.model_extra or {}).get(name) is not None:
            raise unsupported(name, f"{name}" + (" (use response_format)" if "guided" in name or "json" in name
                                                 or name == "grammar" else ""))


def router(service: Service) -> APIRouter:
    api = APIRouter(route_class=JsonRoute)

    @api.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                            "owned_by": "colibri"}]}

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        service.check_model(model_id)
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "colibri"}

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        service.check_model(body.model)
        refuse_unknown_sampling(body)
        n = body.n if body.n is not None else 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise ApiError("bad_request", f"n must be an integer from 1 to {MAX_CHOICES}, got {n!r}", param="n")
        if n > 1 and body.stream:
            raise unsupported("n", "more than one choice in a streamed reply")
        constraint = response_constraint(body.response_format)
        top_logprobs = chat_logprobs(body.logprobs, body.top_logprobs)
        service.require_ready()
        tools, calls_constraint = _tools(body, service)
        if calls_constraint is not None:
            if constraint is not None:
                raise unsupported("response_format", "response_format together with a forced call or a strict tool")
            constraint = calls_constraint
        penalties = _penalties(body, service)
        # rendering and tokenising a large prompt takes a while: off the event loop
        ids, took = await service.tokenize(service.chat_ids, template_messages(body.messages), tools)
        service.check_prompt(ids, "messages")
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        def new_job(i: int) -> Job:  # choice i: its own sequence; with a seed, seed + i (each choice its own draw)
            seed = body.seed + i if body.seed is not None and i else body.seed
            return Job(ids, service.max_tokens(asked, len(ids)), stops=stop_list(body.stop, "stop"), tools=tools,
                       logprobs=top_logprobs, constraint=constraint, tokenize_s=took if i == 0 else 0.0, **penalties,
                       constraint_param="tools" if calls_constraint is not None else "response_format",
                       **service.sampling(body.temperature, body.top_p, body.top_k, seed))

        job = new_job(0)
        writer = LogprobWriter(service.token_bytes) if top_logprobs is not None else None
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": service.model_name}
        if not body.stream:
            jobs = [job] + [new_job(i) for i in range(1, n)]  # the batched engine runs them side by side
            if n == 1:
                contents = [await service.run(job, request.is_disconnected)]
            else:
                try:
                    async with asyncio.TaskGroup() as group:  # one choice failing cancels the others
                        tasks = [group.create_task(service.run(j, request.is_disconnected)) for j in jobs]
                except* Exception as failed:  # the first failure, as a single request raises it
                    raise failed.exceptions[0] from None
                contents = [t.result() for t in tasks]
            choices = []
            for i, (j, content) in enumerate(zip(jobs, contents)):
                message: dict[str, Any] = {"role": "assistant", "content": content if content or not j.parsed.tool_calls else None}
                if j.parsed.tool_calls:
                    message["tool_calls"] = [{"id": c.id, "type": "function",
                                              "function": {"name": c.name, "arguments": c.arguments_json}}
                                             for c in j.parsed.tool_calls]
                choice = {"index": i, "message": message,
                          "logprobs": writer.chat(j.token_logprobs) if writer is not None else None,
                          "finish_reason": FINISH[j.finish_reason]}
                if body.return_token_ids:
                    choice["token_ids"] = j.token_ids
                choices.append(choice)
            return {**head, "object": "chat.completion", "choices": choices, "usage": _usage(*jobs)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = service.stream(job, request.is_disconnected)
        first = await started(gen)  # errors before the first token are HTTP errors, not stream events

        sent = 0  # tokens whose logprobs a chunk carried

        def new_logprobs():
            """The logprobs of the tokens since the last chunk that carried some."""
            nonlocal sent
            if writer is None:
                return None
            entries, sent = job.token_logprobs[sent:], len(job.token_logprobs)
            return writer.chat(entries)

        def chunk(delta, finish=None, logprobs=None):
            data = {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                                            "finish_reason": finish}]}
            if include_usage:
                data["usage"] = None
            return _sse(data)

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            if first:
                yield chunk({"content": first}, logprobs=new_logprobs())
            async for piece in gen:
                yield chunk({"content": piece}, logprobs=new_logprobs())
            if job.parsed.tool_calls:
                yield chunk({"tool_calls": [{"index": k, "id": c.id, "type": "function",
                                             "function": {"name": c.name, "arguments": c.arguments_json}}
                                            for k, c in enumerate(job.parsed.tool_calls)]})
            # tokens whose text no chunk showed (held back, cut at a stop string, tool calls)
            rest = new_logprobs() if writer is not None and sent < len(job.token_logprobs) else None
            last = {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {}, "logprobs": rest, "finish_reason": FINISH[job.finish_reason]}]}
            if body.return_token_ids:
                last["choices"][0]["token_ids"] = job.token_ids
            if include_usage:
                last["usage"] = None
            yield _sse(last)
            if include_usage:
                yield _sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(job)})

        return _event_stream(gen, events())

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service.check_model(body.model)
        refuse_unknown_sampling(body)
        for param, bad in (("n", body.n not in (None, 1)), ("best_of", body.best_of not in (None, 1)), ("echo", body.echo),
                           ("suffix", body.suffix is not None)):
            if bad:
                raise unsupported(param, f"{param}={getattr(body, param)!r}")
        service.require_ready()
        penalties = _penalties(body, service)
        prompt = body.prompt
        took = 0.0
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            ids = list(prompt)
        else:
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise unsupported("prompt", "a batch of prompts")
                prompt = prompt[0]
            ids, took = await service.tokenize(service.text_ids, prompt)
        service.check_prompt(ids, "prompt")
        job = Job(ids, service.max_tokens(body.max_tokens, len(ids)), stops=stop_list(body.stop, "stop"),
                  logprobs=body.logprobs, tokenize_s=took, **penalties, **service.sampling(body.temperature, body.top_p, body.top_k, body.seed))
        writer = LogprobWriter(service.token_bytes) if body.logprobs is not None else None
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": service.model_name}
        if not body.stream:
            text = await service.run(job, request.is_disconnected)
            logprobs = writer.completion(job.token_logprobs) if writer is not None else None
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": FINISH[job.finish_reason]}
            if body.return_token_ids:
                choice["token_ids"] = job.token_ids
            return {**head, "choices": [choice], "usage": _usage(job)}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = service.stream(job, request.is_disconnected)
        first = await started(gen)

        sent = 0  # tokens whose logprobs a chunk carried

        def new_logprobs(last=False):
            nonlocal sent
            if writer is None or (last and sent == len(job.token_logprobs)):
                return None
            entries, sent = job.token_logprobs[sent:], len(job.token_logprobs)
            return writer.completion(entries)

        def text_chunk(piece):
            return _sse({**head, "choices": [{"index": 0, "text": piece, "logprobs": new_logprobs(), "finish_reason": None}]})

        async def events():
            if first:
                yield text_chunk(first)
            async for piece in gen:
                yield text_chunk(piece)
            yield _sse({**head, "choices": [{"index": 0, "text": "", "logprobs": new_logprobs(last=True),
                                             "finish_reason": FINISH[job.finish_reason]}]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(job)})

        return _event_stream(gen, events())

    return api

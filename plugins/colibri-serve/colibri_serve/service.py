"""The model behind the server: loaded in the background (the APIs answer 503 until it
is ready), then every request is a job submitted to the core's scheduler, whose token
events are carried over to asyncio. A job whose client goes away is cancelled, which
frees its slot."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from colibri_serve.reply import ReplyStream
from colibri_serve.toolcalls import ParsedReply, ToolCallFormat, detect_format


SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # the APIs' documented defaults


def sampling_defaults(model_dir) -> dict:
    """What a request that does not say gets: the model's generation_config.json
    (temperature, top_p, top_k) where it has them, else the APIs' defaults."""
    import json
    from pathlib import Path

    out = dict(SAMPLING_DEFAULTS)
    try:
        config = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return out
    if not isinstance(config, dict):
        return out
    for key, kind, ok in (("temperature", float, lambda v: v >= 0), ("top_p", float, lambda v: 0 < v <= 1),
                          ("top_k", int, lambda v: v >= 0)):
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and ok(value):
            out[key] = kind(value)
    if config.get("do_sample") is False:  # the model's authors ask for greedy decoding
        out["temperature"] = 0.0
    return out


def new_scheduler(model, slots: int, max_queue: int):
    """The core scheduler with a KV budget of one more full context than ``slots``
    requests can reserve: room to keep the last finished prompt for prefix reuse. (With
    the default budget a request that may fill the context evicts every retained prefix
    before it could reuse one, so a chat's next turn would prefill everything again.)"""
    from colibri_core.engine.scheduler import Scheduler

    sized = Scheduler(model, slots=slots, max_queue=max_queue)
    return Scheduler(model, slots=slots, max_queue=max_queue, kv_budget=sized.kv.budget * (slots + 1) // slots)


class ApiError(Exception):
    """A request the server refuses: rendered in the calling API's own error shape.
    kind: bad_request | context_length_exceeded | unauthorized | not_found (a model) |
    no_route | method_not_allowed | too_large | queue_full | loading | shutting_down |
    engine_error."""

    STATUS = {"bad_request": 400, "context_length_exceeded": 400, "unauthorized": 401, "not_found": 404, "no_route": 404,
              "method_not_allowed": 405, "too_large": 413, "queue_full": 429, "loading": 503, "shutting_down": 503,
              "engine_error": 500}

    def __init__(self, kind: str, message: str, *, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.kind, self.message, self.param, self.retry_after = kind, message, param, retry_after

    @property
    def status(self) -> int:
        return self.STATUS[self.kind]


@dataclass
class Job:
    """One generation: what to run, and what came of it once ``stream`` has ended."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    tools: list[dict] | None = None  # OpenAI-style definitions; None: tool calls are not parsed
    # results
    finish_reason: str | None = None  # stop | length | stop_sequence | tool_calls | cancelled
    stop_sequence: str | None = None
    parsed: ParsedReply | None = None
    token_ids: list[int] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)


class _KeepSpecial:
    """A tokenizer view that keeps special tokens when decoding: tool-call markers are
    special tokens in some vocabularies."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class Service:
    def __init__(self, load: Callable[[], Any], *, model_name: str, slots: int, max_queue: int, metrics=None):
        self._load = load
        self.model_name = model_name
        self.slots, self.max_queue = slots, max_queue
        self.metrics = metrics
        self.status = "loading"  # loading | ready | failed | stopped
        self.error: BaseException | None = None
        self.model = None
        self.scheduler = None
        self.tool_format: ToolCallFormat | None = None
        self.defaults = dict(SAMPLING_DEFAULTS)
        self.created = int(time.time())
        self.closing = False  # the server is shutting down: no new generations, open ones end
        self._live: set = set()  # handles of the generations running now
        self._ready = threading.Event()

    # -- life ------------------------------------------------------------------------
    def start_loading(self, on_failure: Callable[[BaseException], None] | None = None) -> threading.Thread:
        def run():
            try:
                self.load_now()
            except BaseException as exc:  # reported by on_failure; the server then stops
                self.status, self.error = "failed", exc
                if on_failure is not None:
                    on_failure(exc)
            finally:
                self._ready.set()

        thread = threading.Thread(target=run, name="colibri-serve-load", daemon=True)
        thread.start()
        return thread

    def load_now(self) -> None:
        model = self._load()
        try:
            scheduler = new_scheduler(model, self.slots, self.max_queue)
            scheduler.start()
        except BaseException:
            model.close()
            raise
        template = model.tokenizer.chat_template if model.tokenizer is not None else None
        source = template.source if template is not None else None
        self.model, self.scheduler = model, scheduler
        self.tool_format = detect_format(source, model.family.spec.name)
        self.defaults = sampling_defaults(model.model_dir)
        self.status = "ready"

    def sampling(self, temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None = None) -> dict:
        """A request's sampling settings, the defaults filling what it leaves out."""
        d = self.defaults
        return dict(temperature=d["temperature"] if temperature is None else temperature,
                    top_p=d["top_p"] if top_p is None else top_p, top_k=d["top_k"] if top_k is None else top_k,
                    seed=None if seed is None else seed % 2**64)  # the APIs allow negative seeds; numpy does not

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def end_generations(self) -> None:
        """Refuse new generations and cancel the running ones, which then end with a
        "shutting down" error: their responses complete, so the server can stop without
        cancelling a request mid-stream (uvicorn would log each as a traceback)."""
        self.closing = True
        for handle in list(self._live):
            handle.cancel()

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.model is not None:
            self.model.close()
        self.status = "stopped"

    def require_ready(self) -> None:
        if self.status == "loading":
            raise ApiError("loading", "the model is still loading; retry shortly", retry_after=5)
        if self.status != "ready":
            raise ApiError("engine_error", f"the model is not available ({self.status})")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError("not_found", f"model {name!r} is not served here (this server serves {self.model_name!r})", param="model")

    @property
    def max_context(self) -> int:
        return self.model.lm.max_context

    # -- prompts ---------------------------------------------------------------------
    def chat_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The prompt of a conversation, rendered by the model's chat template the way
        ``colibri run --chat`` renders it (tools, when given, go to the template)."""
        from colibri_core.errors import UsageError

        tok = self.model.tokenizer
        if tok is None or tok.chat_template is None:
            raise ApiError("bad_request", "this model has no chat template: use /v1/completions")
        try:
            text = tok.chat_template.render(messages, True, **({"tools": tools} if tools else {}))
            return tok.encode(text, add_special_tokens=False)
        except UsageError as exc:
            raise ApiError("bad_request", str(exc), param="messages") from None

    def text_ids(self, text: str) -> list[int]:
        from colibri_core.errors import UsageError

        if self.model.tokenizer is None:
            raise ApiError("bad_request", "this model has no tokenizer: give the prompt as token ids")
        try:
            return self.model.tokenizer.encode(text)
        except UsageError as exc:  # text the tokenizer refuses (not valid Unicode)
            raise ApiError("bad_request", str(exc), param="prompt") from None

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError("bad_request", "the prompt is empty", param=param)
        if len(ids) >= self.max_context:
            raise ApiError("context_length_exceeded", f"the prompt has {len(ids)} tokens; the model's context holds "
                                                      f"{self.max_context} (and at least one for the reply)", param=param)
        from colibri_core.errors import UsageError

        try:
            self.model.lm.check_prompt(ids)
        except UsageError as exc:
            raise ApiError("bad_request", str(exc), param=param) from None

    def max_tokens(self, asked: int | None, prompt_len: int) -> int:
        room = self.max_context - prompt_len
        return room if asked is None else min(asked, room)

    # -- generation ------------------------------------------------------------------
    async def stream(self, job: Job, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
        """Run ``job``; yields "" once it is queued, then the reply's content as it
        comes. Afterwards the job holds its finish reason, parsed tool calls and usage.
        Raises ApiError before the first yield when the request cannot be queued."""
        from colibri_core.engine.sampling import SamplingParams
        from colibri_core.engine.scheduler import QueueFull, Request
        from colibri_core.errors import UsageError

        self.require_ready()
        if self.closing:
            raise ApiError("shutting_down", "the server is shutting down")
        self.check_prompt(job.prompt_ids, "prompt")
        model = self.model
        try:
            sampling = SamplingParams(temperature=job.temperature, top_p=job.top_p, top_k=job.top_k, seed=job.seed)
        except UsageError as exc:
            raise ApiError("bad_request", str(exc)) from None
        reply = ReplyStream(job.stops, self.tool_format if job.tools else None, job.tools)
        decoder = None
        if job.tools and self.tool_format is not None and model.tokenizer is not None:
            from colibri_core.model.tokenizer import StreamDecoder

            decoder = StreamDecoder(_KeepSpecial(model.tokenizer))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request = Request(prompt_ids=list(job.prompt_ids), max_tokens=job.max_tokens, sampling=sampling,
                          stop_ids=frozenset(model.eos_ids))
        started = time.perf_counter()
        try:
            handle = self.scheduler.submit(request, on_event=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        except QueueFull:
            raise ApiError("queue_full", f"every slot is busy and the queue is full (--max-queue {self.max_queue}); "
                           "retry shortly", retry_after=1) from None
        except UsageError as exc:
            kind = "context_length_exceeded" if "context" in str(exc) else "bad_request"
            raise ApiError(kind, str(exc), param="prompt") from None
        self._live.add(handle)
        watcher = asyncio.create_task(_cancel_on_disconnect(handle, disconnected))
        first = True
        try:
            yield ""  # queued: a streaming response may send its headers now
            while True:
                ev = await events.get()
                if ev is None:
                    break
                if first and ev.token_id >= 0:
                    first = False
                    if self.metrics is not None:
                        self.metrics.ttft.observe(time.perf_counter() - started)
                if decoder is not None:
                    text = decoder.add(ev.token_id) if ev.token_id >= 0 else ""
                else:
                    text = ev.text
                shown = reply.feed(text)
                if reply.stopped is not None:
                    handle.cancel()
                if shown:
                    yield shown
            if decoder is not None:
                shown = reply.feed(decoder.flush())
                if shown:
                    yield shown
            tail, job.parsed = reply.finish()
            if tail:
                yield tail
            job.token_ids = list(handle.token_ids)
            job.usage = dict(handle.usage)
            engine_reason = handle.finish_reason
            if engine_reason == "error":
                raise ApiError("engine_error", f"generation failed: {handle.error}")
            if engine_reason == "cancelled" and self.closing and reply.stopped is None:
                raise ApiError("shutting_down", "the server is shutting down: the reply was cut short")
            if reply.stopped is not None:
                job.finish_reason, job.stop_sequence = "stop_sequence", reply.stopped
            elif job.parsed.tool_calls:
                job.finish_reason = "tool_calls"
            elif engine_reason in ("length", "context"):
                job.finish_reason = "length"
            else:
                job.finish_reason = engine_reason  # stop | cancelled
        finally:
            self._live.discard(handle)
            watcher.cancel()
            if not handle.done:
                handle.cancel()

    async def run(self, job: Job, disconnected: Callable[[], Awaitable[bool]]) -> str:
        """Run ``job`` to its end; returns the content (tool calls are in job.parsed)."""
        async for _ in self.stream(job, disconnected):
            pass
        return job.parsed.content


async def _cancel_on_disconnect(handle, disconnected, period: float = 0.2) -> None:
    while not handle.done:
        if await disconnected():
            handle.cancel()
            return
        await asyncio.sleep(period)


async def started(gen) -> str:
    """Queue a generation (Service.stream yields "" once queued). Refusals (queue full,
    context) surface here, while an HTTP status can still say so."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return ""

"""The model behind the server: loaded in the background (the APIs answer 503 until it
is ready), then every request is a job submitted to the core's scheduler, whose token
events are carried over to asyncio. A job whose client goes away is cancelled, which
frees its slot. Prompts are rendered and tokenized on their own threads, at most one per
slot at once, after a check of their length that refuses one far over the context without
tokenizing it. A weight file that fails to read fails the requests that needed it with a
503 naming it, and makes /health say "degraded" until the file reads again."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from colibri_serve.logs import log, note_tokens
from colibri_serve.reply import ReplyStream
from colibri_serve.toolcalls import ParsedReply, ToolCallFormat, detect_format


SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # the APIs' documented defaults


def sampling_defaults(model_dir) -> dict:
    """What a request that does not say gets: the model's generation_config.json
    (temperature, top_p, top_k) where it has them, else the APIs' defaults."""
    from pathlib import Path

    from colibri_core.errors import ColibriError
    from colibri_core.io import smallfile

    out = dict(SAMPLING_DEFAULTS)
    try:
        config = smallfile.read_json(Path(model_dir) / "generation_config.json", smallfile.CONFIG_BYTES,
                                     "generation config")
    except ColibriError:  # absent or unreadable: the APIs' defaults (loading the model reported a damaged one)
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


def new_scheduler(model, slots: int, max_queue: int, kv_disk: int = 0):
    """The core scheduler with a KV budget of one more full context than ``slots``
    requests can reserve: room to keep the last finished prompt for prefix reuse. (With
    the default budget a request that may fill the context evicts every retained prefix
    before it could reuse one, so a chat's next turn would prefill everything again.)
    ``kv_disk``: bytes of prefixes to keep on disk (colibri_core.engine.prefix_disk), 0: none."""
    from colibri_core.engine.prefix_disk import PrefixDisk
    from colibri_core.engine.scheduler import Scheduler

    sized = Scheduler(model, slots=slots, max_queue=max_queue)
    disk = PrefixDisk(model, kv_disk, sized.prefill_chunk) if kv_disk and sized.prefix_reuse else None
    return Scheduler(model, slots=slots, max_queue=max_queue, kv_budget=sized.kv.budget * (slots + 1) // slots,
                     prefix_disk=disk)


class ApiError(Exception):
    """A request the server refuses: rendered in the calling API's own error shape.
    kind: bad_request | context_length_exceeded | unauthorized | not_found (a model) |
    no_route | method_not_allowed | too_large | misdirected (a Host header naming another
    server) | queue_full | loading | shutting_down | weights_unreadable | engine_error."""

    STATUS = {"bad_request": 400, "context_length_exceeded": 400, "unauthorized": 401, "not_found": 404, "no_route": 404,
              "method_not_allowed": 405, "too_large": 413, "misdirected": 421, "queue_full": 429, "loading": 503,
              "shutting_down": 503, "weights_unreadable": 503, "engine_error": 500}

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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: none; N: each token's logprob and the N most likely tokens'
    stops: list[str] = field(default_factory=list)
    tools: list[dict] | None = None  # OpenAI-style definitions; None: tool calls are not parsed
    constraint: Any = None  # what the reply must fit (colibri_core.engine.constraints.ConstraintSpec); None: anything
    constraint_param: str = "response_format"  # the request field a constraint that does not compile is blamed on
    tokenize_s: float = 0.0  # rendering and tokenizing the prompt took this long (the profiling page shows it)
    # results
    finish_reason: str | None = None  # stop | length | stop_sequence | tool_calls | cancelled
    stop_sequence: str | None = None
    parsed: ParsedReply | None = None
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)  # TokenLogprobs as they come, with logprobs
    usage: dict[str, int] = field(default_factory=dict)


class _KeepSpecial:
    """A tokenizer view that keeps special tokens when decoding: tool-call markers are
    special tokens in some vocabularies."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class Service:
    def __init__(self, load: Callable[[], Any], *, model_name: str, slots: int, max_queue: int, metrics=None,
                 draft: str | None = None, draft_depth: int = 4, kv_disk: int = 0):
        self._load = load
        self.kv_disk = kv_disk  # bytes of prefixes kept on disk (serve --kv-disk)
        self.draft, self.draft_depth = draft, draft_depth  # every request's speculative decoding (serve --draft)
        self.model_name = model_name
        self.slots, self.max_queue = slots, max_queue
        self.metrics = metrics
        self.status = "loading"  # loading | ready | failed | stopped
        self.error: BaseException | None = None
        self.model = None
        self.scheduler = None
        self.tool_format: ToolCallFormat | None = None
        self.template_source: str | None = None  # the chat template's text (which tool-call convention, toolgrammar)
        self.defaults = dict(SAMPLING_DEFAULTS)
        self.created = int(time.time())
        self.closing = False  # the server is shutting down: no new generations, open ones end
        self.address: str | None = None  # where the server listens, for the log
        self.max_prompt_chars: int | None = None  # a longer prompt cannot fit the context (None: no such bound)
        self._live: set = set()  # handles of the generations running now
        self._ready = threading.Event()
        # rendering and tokenizing prompts: a thread per slot, so that long prompts neither
        # stall the event loop nor take every thread; requests waiting for one count against max_queue
        self._tokenizer = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="colibri-tokenize")
        self._tokenizing = 0  # requests whose prompt is being tokenized or waits for a thread
        self._lock = threading.Lock()
        self._constraints: dict = {}  # compiled constraints, oldest first (Service.compiled)
        self._faults: dict[str, str] = {}  # weight file -> why its last read failed
        self._file_sizes: dict[str, int] = {}  # weight file -> its size when loaded

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
            scheduler = new_scheduler(model, self.slots, self.max_queue, self.kv_disk)
            scheduler.start()
        except BaseException:
            model.close()
            raise
        template = model.tokenizer.chat_template if model.tokenizer is not None else None
        source = template.source if template is not None else None
        self.model, self.scheduler = model, scheduler
        self.tool_format = detect_format(source, model.family.spec.name)
        self.template_source = source
        self.defaults = sampling_defaults(model.model_dir)
        self._file_sizes = {sf.path: sf.file_size for sf in model.checkpoint.files.values()}
        per_token = model.tokenizer.max_chars_per_token() if model.tokenizer is not None else None
        self.max_prompt_chars = per_token * (model.lm.max_context - 1) if per_token else None
        self.status = "ready"
        log.info("model loaded: %s", self.describe())

    def describe(self) -> str:
        """The loaded model, its backend and budgets, and where it is served: the log's "model loaded" line."""
        from colibri_core.units import format_bytes

        model, placement = self.model, self.model.placement
        budgets = f"RAM for weights {format_bytes(placement.budget)} ({placement.budget_source})"
        if placement.device is not None:
            budgets += f", device tier {format_bytes(placement.device.budget)} ({placement.device.budget_source})"
        budgets += f", KV cache {format_bytes(self.scheduler.kv.budget)}"
        disk = self.scheduler.prefix_disk
        if disk is not None:
            budgets += f" + {format_bytes(disk.budget)} on disk ({disk.dir})"
        budgets += f"; {self.slots} slots, {self.max_queue} may wait"
        where = f"; serving http://{self.address}" if self.address else ""
        return (f"{self.model_name!r} ({model.model_type}, {model.model_dir}) on the {model.backend.name} backend "
                f"in {model.load_seconds:.1f} s; {budgets}{where}")

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
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        if self.scheduler is not None:
            self.scheduler.stop()  # spills the retained prefixes, with --kv-disk
            if self.scheduler.prefix_disk is not None:
                self.scheduler.prefix_disk.close()
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

    @property
    def vocab_size(self) -> int:
        return self.model.lm.vocab_size

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes of one token (None for a model without a tokenizer)."""
        tok = self.model.tokenizer
        return tok.token_bytes(token_id) if tok is not None else None

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
            self.check_length(text, "messages")
            return tok.encode(text, add_special_tokens=False)
        except UsageError as exc:
            raise ApiError("bad_request", str(exc), param="messages") from None

    def text_ids(self, text: str) -> list[int]:
        from colibri_core.errors import UsageError

        if self.model.tokenizer is None:
            raise ApiError("bad_request", "this model has no tokenizer: give the prompt as token ids")
        self.check_length(text, "prompt")
        try:
            return self.model.tokenizer.encode(text)
        except UsageError as exc:  # text the tokenizer refuses (not valid Unicode)
            raise ApiError("bad_request", str(exc), param="prompt") from None

    def check_length(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a text with more characters than the context's
        tokens can cover (a bound of the tokenizer's: it never refuses a text that fits)."""
        limit = self.max_prompt_chars
        if limit is not None and isinstance(text, str) and len(text) > limit:
            raise ApiError("context_length_exceeded", f"the prompt has {len(text)} characters, more than the model's "
                           f"context of {self.max_context} tokens can hold ({limit} characters at most with this "
                           "tokenizer)", param=param)

    async def tokenize(self, work: Callable[..., list[int]], *args) -> tuple[list[int], float]:
        """``work(*args)`` (rendering and tokenizing a prompt) on the tokenizing threads,
        one per slot, and the seconds it took there; a request that finds them all busy
        waits, and counts against max_queue as a request waiting for a slot does (429
        beyond it)."""
        with self._lock:
            if self._tokenizing >= self.slots + self.max_queue:
                raise ApiError("queue_full", f"every slot is busy and the queue is full (--max-queue {self.max_queue}); "
                               "retry shortly", retry_after=1)
            self._tokenizing += 1
        def timed():
            began = time.perf_counter()
            return work(*args), time.perf_counter() - began

        try:
            future = self._tokenizer.submit(timed)
        except BaseException:
            self._tokenized(None)
            raise
        # counted until the work ends, also when the client has gone (a running tokenizer cannot be stopped)
        future.add_done_callback(self._tokenized)
        return await asyncio.wrap_future(future)

    def _tokenized(self, _future) -> None:
        with self._lock:
            self._tokenizing -= 1

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

    def compiled(self, spec, param: str = "response_format"):
        """A constraint compiled for the model, the last few kept (a schema takes milliseconds
        to compile, and clients repeat theirs); a bad one is a 400 naming it (``param``: the
        request field it came from)."""
        import json as _json

        from colibri_core.engine.constraints import for_model
        from colibri_core.errors import UsageError

        key = (spec.kind, _json.dumps(spec.source, sort_keys=True))
        with self._lock:
            hit = self._constraints.pop(key, None)
            if hit is not None:
                self._constraints[key] = hit
                return hit
        try:
            compiled = for_model(self.model, spec)
        except UsageError as exc:
            raise ApiError("bad_request", str(exc), param=param) from None
        with self._lock:
            self._constraints[key] = compiled
            while len(self._constraints) > 32:
                self._constraints.pop(next(iter(self._constraints)))
        return compiled

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
            sampling = SamplingParams(temperature=job.temperature, top_p=job.top_p, top_k=job.top_k, seed=job.seed,
                                      frequency_penalty=job.frequency_penalty, presence_penalty=job.presence_penalty,
                                      logit_bias=job.logit_bias, logprobs=job.logprobs)
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
                          stop_ids=frozenset(model.eos_ids), draft=self.draft, draft_depth=self.draft_depth,
                          constraint=self.compiled(job.constraint, job.constraint_param) if job.constraint is not None else None,
                          tokenize_s=job.tokenize_s)
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
                if ev.logprob is not None:  # before the text: a chunk carries its tokens' logprobs
                    job.token_logprobs.append(ev.logprob)
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
                raise self._failure(handle.error)
            if engine_reason == "cancelled" and self.closing and reply.stopped is None:
                raise ApiError("shutting_down", "the server is shutting down: the reply was cut short")
            if reply.stopped is not None:
                job.finish_reason, job.stop_sequence = "stop_sequence", reply.stopped
            elif engine_reason in ("length", "context"):
                # cut short, even inside a tool call: a call the parser could still read may
                # lack arguments (block formats read an unclosed call), so it is not "tool_calls"
                job.finish_reason = "length"
            elif job.parsed.tool_calls:
                job.finish_reason = "tool_calls"
            else:
                job.finish_reason = engine_reason  # stop | cancelled
        finally:
            note_tokens(len(job.prompt_ids), len(handle.token_ids))
            self._live.discard(handle)
            watcher.cancel()
            if not handle.done:
                handle.cancel()

    def _failure(self, error: BaseException | None) -> ApiError:
        """What a client is told of a generation the engine failed."""
        from colibri_core.io.drives import ReadFailed

        if isinstance(error, ReadFailed):  # the disk, not the request: the next request reads the file again
            log.warning("reading the model's weights failed: %s", error)
            if error.path is not None:
                with self._lock:
                    self._faults[error.path] = str(error)
            if self.metrics is not None:
                self.metrics.read_errors.inc()
            return ApiError("weights_unreadable", f"reading the model's weights failed: {error}; retry once the file "
                            "is whole again", retry_after=5)
        return ApiError("engine_error", f"generation failed: {error}")

    @property
    def faulted(self) -> bool:
        """Whether a weight file failed to read and has not been seen whole since."""
        return bool(self._faults)

    def read_faults(self) -> list[str]:
        """Why weight files failed to read, for those that still do not read: each is
        looked at again (a file whole again, at its size when loaded, clears its fault)."""
        with self._lock:
            faults = dict(self._faults)
        healed = [path for path in faults if _reads_again(path, self._file_sizes.get(path))]
        with self._lock:
            for path in healed:
                if self._faults.get(path) == faults[path]:
                    del self._faults[path]
        return [message for path, message in faults.items() if path not in healed]

    async def run(self, job: Job, disconnected: Callable[[], Awaitable[bool]]) -> str:
        """Run ``job`` to its end; returns the content (tool calls are in job.parsed)."""
        async for _ in self.stream(job, disconnected):
            pass
        return job.parsed.content


def _reads_again(path: str, size: int | None) -> bool:
    """Whether ``path`` is a regular file of ``size`` bytes whose last byte reads."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or size is None or st.st_size != size:
            return False
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            return len(os.pread(fd, 1, size - 1)) == 1
        finally:
            os.close(fd)
    except OSError:
        return False


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

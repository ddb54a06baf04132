"""The batched engine: continuous batching of many requests over one ``Model``.

    sched = Scheduler(model, slots=8, max_queue=64)
    sched.start()                                   # steps run on the engine's own thread
    h = sched.submit(Request(prompt_ids=ids, max_tokens=64, stop_ids=frozenset(model.eos_ids)))
    for event in h:                                 # TokenEvents as they are generated
        print(event.text, end="")
    h.finish_reason, h.usage
    sched.stop()

Each step of the engine thread:

1. admits queued requests while a slot is free and the KV allocator can reserve the
   request's worst case (prompt + max_tokens, capped at the context) within the KV
   budget; otherwise they wait in the queue (first come, first served);
2. retires cancelled requests (their slot and KV reservation are free before the step);
3. runs one prefill chunk (``prefill_chunk`` tokens) of the oldest request still
   prefilling, on its own: a long prompt is thus cut into chunks between decode steps;
4. runs one batched decode step over every request that has a token to feed: each
   sequence's attention / MLA / DeltaNet on its own state, the dense linears, router and
   routed experts on all rows at once (the step's experts are fetched once for all).

The promise: a request's tokens never depend on what else is in the batch. Prefill
chunks run exactly as ``Model.generate`` runs them (same chunk boundaries, alone), and
decode rows go through ``RowInvariantOps`` (colibri_core.engine.batching), which keeps
every row bit-identical to a one-row step. Greedy tokens therefore equal
``Model.generate``'s for the same request (with ``prefill_chunk`` = PREFILL_CHUNK).

Prefix reuse: after a prompt is prefilled, its cache stays indexed by its tokens (also
after the request ends, until its bytes are needed). A new request whose prompt starts
with the same tokens copies that prefix's cached positions and prefills only the rest.
Only positions computed by whole prefill chunks are reused, and the reuse length is a
multiple of the chunk: the copied rows are then bit for bit what a cold prefill of the
new prompt computes (a partial chunk, or a decoded token, is computed with another number
of rows, so other roundings). Recurrent layers (Gated DeltaNet) replace their state at
every step, so a snapshot of it is kept at the last ``snapshots`` chunk boundaries of
each prompt; a prefix resumes from the latest boundary at or before the match.

Continuation: a request with ``keep_cache`` hands its cache back when it ends
(``Handle.kept``, a KeptSequence); a later request passes it as ``start_cache`` with the
ids it holds at the start of its prompt, and only the rest is fed. That is how a chat's
next turn, or a saved session bound again, goes on where the conversation stopped: the
same numbers as an uninterrupted sequence, not a cold prefill's (its decoded positions
were computed one row at a time). ``call`` runs a function on the engine's thread, where
a kept cache's arrays belong.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri_core.engine import generation
from colibri_core.engine.batching import RowInvariantOps
from colibri_core.engine.generation import TokenEvent, check_logits
from colibri_core.engine.profiling import Profiler, TurnProfile
from colibri_core.engine.sampling import Sampler, SamplingParams
from colibri_core.engine.speculative import DEFAULT_DRAFT_DEPTH, Speculation
from colibri_core.errors import ColibriError, UsageError
from colibri_core.nn.cache import Cache


class QueueFull(ColibriError):
    """``max_queue`` requests are already waiting: try again later."""


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()  # token ids that end the request (not emitted)
    draft: Any = None  # a draft source for speculative decoding, by name or object (None / "off": none)
    draft_depth: int = DEFAULT_DRAFT_DEPTH
    # what the output must fit (colibri_core.engine.constraints: a CompiledConstraint); None: anything
    constraint: Any = None
    # a cache of this model holding the first start_cache.length ids of prompt_ids (a KeptSequence's,
    # or one bound from a saved state): the sequence continues it instead of prefilling those ids
    start_cache: Cache | None = None
    # hand the sequence's cache back when the request ends (Handle.kept), to continue it later
    keep_cache: bool = False
    # seconds the caller took to render and tokenize the prompt: the turn's profile shows it
    tokenize_s: float = 0.0


@dataclass
class KeptSequence:
    """A finished request's cache, handed back for ``Request(keep_cache=True)``: ``cache``
    holds every id of ``token_ids`` but the last, the id a continuation feeds first (the
    stop token or the last sampled one). Continuing it computes what an uninterrupted
    sequence computes; a fresh prefill of the same ids would round differently."""

    cache: Cache
    token_ids: list[int]
    # position -> Cache.snapshot() there (the prompt's end), for states that cannot rewind
    snapshots: dict = field(default_factory=dict)

    @property
    def fed(self) -> list[int]:
        return self.token_ids[:-1]

    def start(self, ids: list[int]) -> Cache | None:
        """The cache made to hold the longest prefix of ``ids`` it can (leaving at least
        one id to feed): all it holds when ``ids`` go on from there; else back to where
        they part (KV caches forget rows) or to a snapshot before it; None when neither.
        Run it on the engine's thread (``Scheduler.call``): it may compute."""
        fed, n = self.fed, 0
        limit = min(len(fed), len(ids) - 1)
        while n < limit and fed[n] == ids[n]:
            n += 1
        cache = self.cache
        if n == len(fed):
            return cache
        if n > 0 and cache.rewindable():
            try:
                cache.rewind(n)
                return cache
            except ValueError:  # a recurrent state keeps no earlier position
                pass
        at = max((p for p in self.snapshots if p <= n), default=0)
        if at > 0:
            cache.restore(at, self.snapshots[at])
            return cache
        return None


class Handle:
    """A submitted request: iterate it for ``TokenEvent``s (blocking); ``cancel()``."""

    def __init__(self, request: Request, on_event):
        self.request = request
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.usage = {"prompt_tokens": len(request.prompt_ids), "completion_tokens": 0, "cached_tokens": 0}
        # one TokenLogprob per token id, when the request's sampling parameters ask for them
        self.logprobs: list | None = [] if request.sampling.logprobs is not None else None
        self.submitted = time.perf_counter()
        self.ttft_s: float | None = None
        self.stop_id: int | None = None  # the stop token that ended it, if one did
        self.kept: KeptSequence | None = None  # with Request.keep_cache, once done (not after an error)
        self.profile = TurnProfile(request.tokenize_s)  # where its time goes (colibri_core.engine.profiling)
        self._on_event = on_event
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._cancelled = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating (idempotent); the slot is freed before the next step."""
        self._cancelled = True

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def __iter__(self):
        while True:
            event = self._events.get()
            if event is None:
                return
            yield event

    # -- engine side ------------------------------------------------------------------
    def _emit(self, event: TokenEvent) -> None:
        self._events.put(event)
        if self._on_event is not None:
            self._on_event(event)

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self.finish_reason, self.error = reason, error
        self.usage["completion_tokens"] = len(self.token_ids)
        self._done.set()
        self._events.put(None)
        if self._on_event is not None:
            try:
                self._on_event(None)
            except Exception:  # the request is over either way; the engine keeps serving
                pass


class KVAllocator:
    """Bytes of sequence state (KV, MLA latents, recurrent states and their snapshots)
    the engine may hold: requests reserve their worst case before they are admitted."""

    def __init__(self, budget: int):
        self.budget = budget
        self.reserved = 0

    def fits(self, nbytes: int) -> bool:
        return self.reserved + nbytes <= self.budget

    def reserve(self, nbytes: int) -> None:
        self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes


@dataclass
class _Prefix:
    """A prompt's cache kept for reuse: positions below ``exact`` were computed by whole
    prefill chunks; ``snapshots`` (position -> Cache.snapshot()) resume recurrent layers."""

    tokens: list[int]
    cache: Cache
    exact: int = 0
    snapshots: dict = field(default_factory=dict)
    nbytes: int = 0  # reservation held while retired (0 while its request runs)
    live: bool = True  # its request still runs (it owns the reservation)
    used: float = 0.0


@dataclass
class _Seq:
    handle: Handle
    cache: Cache
    reserved: int
    sampler: Sampler
    decoder: object
    prompt: list[int]
    prefilled: int = 0
    cached: int = 0
    next_token: int | None = None  # sampled and emitted, to be fed at the next decode step
    prefix: _Prefix | None = None
    speculation: Speculation | None = None  # drafting, when the request asks for it
    constraint: Any = None  # the request's constraint's matcher for this sequence
    snapshots: dict = field(default_factory=dict)  # with keep_cache: KeptSequence.snapshots
    setup_ns: int = 0  # setting it up (a prefix reused included), counted in its prefill's time

    @property
    def request(self) -> Request:
        return self.handle.request


class Scheduler:
    """Continuous batching over one model; see the module docstring."""

    def __init__(self, model, slots: int = 8, max_queue: int = 64, *, kv_budget: int | None = None,
                 prefill_chunk: int | None = None, prefix_reuse: bool = True, snapshots: int = 2, prefix_disk=None):
        if slots < 1:
            raise UsageError(f"slots must be >= 1, got {slots}")
        if max_queue < 0:
            raise UsageError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.lm = model.lm
        self.ops = model.backend
        self.batch_ops = RowInvariantOps(model.backend)
        self.slots, self.max_queue = slots, max_queue
        self.prefill_chunk = prefill_chunk or generation.PREFILL_CHUNK
        probe = self.lm.new_cache(self.ops)  # what one sequence's state costs
        self.bytes_per_token = probe.bytes_per_token()
        self.fixed_bytes = probe.nbytes  # recurrent states: allocated whole at the start
        self.prefix_reuse = prefix_reuse and probe.reusable()
        # prefixes leaving memory go to disk (colibri_core.engine.prefix_disk.PrefixDisk), and come back
        self.prefix_disk = prefix_disk if self.prefix_reuse else None
        if self.prefix_disk is not None and self.prefix_disk.chunk != self.prefill_chunk:
            raise UsageError(f"prefix_disk keeps prefixes of {self.prefix_disk.chunk}-token chunks; the scheduler "
                             f"prefills {self.prefill_chunk} at a time")
        # states whose earlier positions are not kept (recurrent, sliding windows) resume a
        # prefix only from a snapshot taken at its length
        self.snapshot_bytes = probe.snapshot_bytes()
        self.snapshots = max(1, snapshots) if self.snapshot_bytes else 0
        if kv_budget is None:  # every slot may fill the whole context
            kv_budget = slots * self._reservation(self.lm.max_context)
        self.kv = KVAllocator(int(kv_budget))
        self._lock = threading.Condition()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._active: list[_Seq] = []
        self._admitting = 0  # requests out of the queue whose sequence is being set up: their slot is taken
        self._prefixes: list[_Prefix] = []
        self._calls: list = []  # (fn, result box, done event): ``call``'s, run by the engine thread
        self._spilling: list[_Prefix] = []  # prefixes leaving memory, for prefix_disk (``_spill``)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.requests_total = 0
        self.tokens_total = 0
        self.steps = 0
        self.prefix_hits_tokens = 0
        self.continued_tokens = 0  # positions of start caches (continued sequences), not prefilled
        self.prefill_tokens = 0
        self.drafted_tokens = 0  # speculative decoding: drafts verified, and those accepted
        self.accepted_tokens = 0
        self._decoded = collections.deque(maxlen=64)  # (time, tokens) of recent decode steps
        self._ttft = collections.deque(maxlen=64)
        self.profiler = Profiler(model)  # the last turns' phases, for the profiling page

    # -- sizes ------------------------------------------------------------------------
    def _reservation(self, tokens: int) -> int:
        return tokens * self.bytes_per_token + self.fixed_bytes + self.snapshot_bytes * self.snapshots

    def _request_tokens(self, request: Request) -> int:
        return min(len(request.prompt_ids) + request.max_tokens, self.lm.max_context)

    # -- client side ------------------------------------------------------------------
    def submit(self, request: Request, on_event=None) -> Handle:
        """Queue a request; raises QueueFull when it finds no free slot and ``max_queue``
        requests already wait for one, UsageError for a request that can never run (empty,
        not fitting the context or the KV budget)."""
        prompt = [int(t) for t in request.prompt_ids]
        if not prompt:
            raise UsageError("the prompt is empty: give text or at least one token id")
        self.lm.check_prompt(prompt)
        if len(prompt) >= self.lm.max_context:
            raise UsageError(f"the prompt has {len(prompt)} tokens; the context holds {self.lm.max_context}")
        if request.max_tokens < 0:
            raise UsageError(f"max_tokens must be >= 0, got {request.max_tokens}")
        request.sampling.check_vocab(self.lm.vocab_size)
        drafting = request.draft is not None and request.draft != "off"
        if drafting:
            self.model.speculation(request.draft, request.draft_depth)  # a bad source or depth fails here, not later
        if request.keep_cache and drafting:
            raise UsageError("keep_cache cannot be combined with drafts: a sequence can end inside a verification, "
                             "with drafted positions in its cache")
        start = request.start_cache
        if start is not None and not 0 < start.length < len(prompt):
            raise UsageError(f"start_cache holds {start.length} positions: it must hold fewer than the prompt's "
                             f"{len(prompt)} ids, and some")
        need = self._reservation(self._request_tokens(request))
        if need > self.kv.budget:
            raise UsageError(f"the request needs {need} bytes of KV cache (prompt {len(prompt)} + max_tokens "
                             f"{request.max_tokens} tokens); the KV budget is {self.kv.budget}")
        request.prompt_ids = prompt
        handle = Handle(request, on_event)
        with self._lock:
            if self._stopping:
                raise UsageError("the scheduler is stopped")
            # the first requests in the queue take the free slots at the next step: only the
            # rest wait, and max_queue bounds those (0: a request runs at once or is refused)
            free = self.slots - len(self._active) - self._admitting
            if len(self._waiting) >= free + self.max_queue:
                raise QueueFull(f"every slot is taken and {max(0, len(self._waiting) - free)} requests wait for one "
                                f"(max_queue {self.max_queue})")
            self._waiting.append(handle)
            self.requests_total += 1
            self._lock.notify_all()
        return handle

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="colibri-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Cancel everything, finish the current step, join the engine thread."""
        with self._lock:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            for seq in self._active:
                seq.handle.cancel()
            self._lock.notify_all()
        for handle in waiting:
            handle._finish("cancelled")
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        else:
            self._retire_cancelled()
            self._spill_retired()
        if self.prefix_disk is not None:
            self.prefix_disk.flush()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def stats(self) -> dict:
        now = time.perf_counter()
        recent = [(t, n) for t, n in self._decoded if now - t <= 10.0]
        decode_tok_s = 0.0
        if len(recent) >= 2:
            span = recent[-1][0] - recent[0][0]
            decode_tok_s = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        ttft = sorted(self._ttft)
        with self._lock:
            queue_depth, active = len(self._waiting), len(self._active)
            kv_bytes = sum(s.cache.nbytes for s in self._active) + sum(p.cache.nbytes for p in self._prefixes if not p.live)
            retained = sum(1 for p in self._prefixes if not p.live)
        out = {
            "queue_depth": queue_depth, "active": active, "slots": self.slots, "max_queue": self.max_queue,
            "requests_total": self.requests_total, "tokens_total": self.tokens_total, "steps": self.steps,
            "decode_tok_s": decode_tok_s, "ttft_s": ttft[len(ttft) // 2] if ttft else 0.0, "ttft_recent_s": list(self._ttft),
            "prefix_hits_tokens": self.prefix_hits_tokens, "continued_tokens": self.continued_tokens,
            "prefill_tokens": self.prefill_tokens,
            "kv_budget_bytes": self.kv.budget, "kv_reserved_bytes": self.kv.reserved, "kv_bytes": kv_bytes,
            "kv_bytes_per_token": self.bytes_per_token, "prefixes_retained": retained,
            "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
        }
        out.update(self.model.store_counters())
        if self.prefix_disk is not None:
            out.update(self.prefix_disk.stats())
        return out

    # -- engine thread ----------------------------------------------------------------
    def call(self, fn):
        """Run ``fn()`` on the engine's thread, between two steps, and return what it returns
        (or raise what it raises). A backend whose arrays belong to the thread that made
        them (MLX) needs a kept cache saved, or a saved one bound, where sequences run."""
        thread = self._thread
        if thread is None or threading.current_thread() is thread:
            return fn()
        done, box = threading.Event(), {}
        with self._lock:
            if self._stopping:
                raise UsageError("the scheduler is stopped")
            self._calls.append((fn, box, done))
            self._lock.notify_all()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, box, done in calls:
            try:
                box["value"] = fn()
            except BaseException as exc:  # the caller's to handle
                box["error"] = exc
            done.set()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._waiting and not self._active and not self._calls:
                    self._lock.wait()
                if self._stopping and not self._active:
                    break
            self._run_calls()
            try:
                self.step()
            except Exception as exc:  # a bug: fail what runs, keep serving
                for seq in list(self._active):
                    self._retire(seq, "error", exc)
        self._run_calls()  # what was asked before the stop
        self._spill_retired()

    def step(self) -> bool:
        """One engine step (admit, retire, one prefill chunk, one decode step). Returns
        whether there was anything to do."""
        self._retire_cancelled()
        self._admit()
        self._spill_queued()  # what admitting evicted, copied out after the lock
        worked = False
        prefilling = next((s for s in self._active if s.prefilled < len(s.prompt)), None)
        if prefilling is not None:
            self._prefill_chunk(prefilling)
            worked = True
        decoding = [s for s in self._active if s.next_token is not None and not s.handle._cancelled]
        if decoding:
            self._decode(decoding)
            worked = True
        if worked:
            self.steps += 1
        return worked

    def _admit(self) -> None:
        with self._lock:  # a cancelled request leaves the queue at once (it held a queue place)
            gone = [h for h in self._waiting if h._cancelled]
            if gone:
                self._waiting = collections.deque(h for h in self._waiting if not h._cancelled)
        for handle in gone:
            handle._finish("cancelled")
        while True:
            with self._lock:
                if not self._waiting or len(self._active) >= self.slots:
                    return
                handle = self._waiting[0]
                if handle._cancelled:
                    self._waiting.popleft()
                    handle._finish("cancelled")
                    continue
                need = self._reservation(self._request_tokens(handle.request))
                while not self.kv.fits(need) and self._evict_one():
                    pass
                if not self.kv.fits(need):
                    return  # wait for a running request to end
                self._waiting.popleft()
                self.kv.reserve(need)
                self._admitting += 1
            began = time.perf_counter_ns()
            handle.profile.admitted = began / 1e9
            try:
                seq = self._new_seq(handle, need)
                seq.setup_ns = time.perf_counter_ns() - began
            except Exception as exc:
                self.kv.release(need)
                handle._finish("error", exc)
                seq = None
            with self._lock:
                self._admitting -= 1
                if seq is not None:
                    self._active.append(seq)
                    if self._stopping:  # stop() cancelled the running requests while this one was set up
                        handle.cancel()

    def _evict_one(self) -> bool:
        """Drop the least recently used retired prefix; False when there is none."""
        retired = [p for p in self._prefixes if not p.live]
        if not retired:
            return False
        victim = min(retired, key=lambda p: p.used)
        self._prefixes.remove(victim)
        self.kv.release(victim.nbytes)
        self._spill(victim)
        return True

    def _spill(self, p: _Prefix) -> None:
        """Queue a prefix leaving memory for the disk, when the scheduler keeps some there
        (``_spill_queued`` copies it out, after the lock: clients' submits and stats do not
        wait on the copy; nothing writes a retired prefix's cache meanwhile)."""
        if self.prefix_disk is not None and p.exact > 0:
            self._spilling.append(p)

    def _spill_queued(self) -> None:
        """The queued prefixes' whole-chunk positions as host copies to the disk's writer
        thread (the engine's thread: a backend's arrays belong to it)."""
        from colibri_core.engine.state import export_layers

        while self._spilling:
            p = self._spilling.pop(0)
            n = p.exact
            if self.snapshots and n not in p.snapshots:
                continue
            cache = Cache([layer.new_state(self.ops, n) for layer in self.lm.layers])
            p.cache.copy_prefix(cache, n, p.snapshots.get(n) if self.snapshots else None)
            self.prefix_disk.spill(p.tokens[:n], export_layers(self.ops, cache))

    def _spill_retired(self) -> None:
        """Every retained prefix to disk (the scheduler stops: they would be lost)."""
        if self.prefix_disk is not None:
            for p in [p for p in self._prefixes if not p.live]:
                self._spill(p)
            self._spill_queued()

    def _new_seq(self, handle: Handle, reserved: int) -> _Seq:
        request = handle.request
        limit = self._request_tokens(request)
        cache = request.start_cache or Cache([layer.new_state(self.ops, limit) for layer in self.lm.layers])
        cache.reserve(limit)  # the KV budget holds it already: no cache grows (and copies itself) mid-decode
        model = self.model
        decoder = model.tokenizer.stream_decoder() if model.tokenizer is not None else None
        seq = _Seq(handle, cache, reserved, Sampler(request.sampling), decoder, list(request.prompt_ids),
                   speculation=model.speculation(request.draft, request.draft_depth))
        if request.constraint is not None:
            seq.constraint = request.constraint.new()
        if seq.speculation is not None:  # counted as OpenAI counts a prediction's tokens
            handle.usage.update(accepted_prediction_tokens=0, rejected_prediction_tokens=0)
        if request.start_cache is not None:
            seq.prefilled = seq.cached = cache.length
            handle.usage["cached_tokens"] = cache.length
            self.continued_tokens += cache.length
        elif self.prefix_reuse:
            self._reuse_prefix(seq)
        return seq

    def _reuse_prefix(self, seq: _Seq) -> None:
        """Copy the longest reusable cached prefix of the prompt into the new cache."""
        prompt, chunk = seq.prompt, self.prefill_chunk
        best, best_n, best_snap = None, 0, None
        for p in self._prefixes:
            limit = min(p.exact, len(prompt) - 1)  # at least one token left to prefill
            common = 0
            while common < limit and p.tokens[common] == prompt[common]:
                common += 1
            n = common // chunk * chunk
            snap = None
            if self.snapshots:  # recurrent or sliding layers: only where a snapshot was kept
                n = max((b for b in p.snapshots if b <= n), default=0)
                snap = p.snapshots.get(n)
            if n > best_n:
                best, best_n, best_snap = p, n, snap
        if self.prefix_disk is not None and self._reuse_from_disk(seq, best_n):
            return
        if best is None:
            return
        best.cache.copy_prefix(seq.cache, best_n, best_snap)
        best.used = time.perf_counter()
        seq.prefilled = seq.cached = best_n
        seq.handle.usage["cached_tokens"] = best_n
        self.prefix_hits_tokens += best_n

    def _reuse_from_disk(self, seq: _Seq, longer_than: int) -> bool:
        """A spilled prefix of the prompt longer than memory's, read back into the new
        cache and kept in memory again; whether there was one."""
        from colibri_core.engine.state import bind_layers

        found = self.prefix_disk.lookup(seq.prompt, longer_than)
        if found is None:
            return False
        n, layers = found
        loaded = bind_layers(layers, n, self.model, "a spilled prefix")
        loaded.copy_prefix(seq.cache, n, None)  # it holds exactly n positions
        seq.prefilled = seq.cached = n
        seq.handle.usage["cached_tokens"] = n
        self.prefix_hits_tokens += n
        if not seq.request.keep_cache:  # a kept cache changes hands: it indexes nothing
            self._remember(seq, n)
        return True

    def _prefill_chunk(self, seq: _Seq) -> None:
        """The next chunk of a prompt, alone, exactly as Model.generate runs it."""
        begin = seq.prefilled
        end = min(len(seq.prompt), begin + self.prefill_chunk)
        spec = seq.speculation
        hidden = [] if spec is not None and spec.wants_hidden else None
        clock, counted = self.profiler.begin()
        try:
            logits = self.lm.forward(np.asarray(seq.prompt[begin:end]), seq.cache, self.ops, hidden=hidden, clock=clock)
        except Exception as exc:
            self._retire(seq, "error", exc)
            return
        self.profiler.prefilled(seq.handle.profile, clock, counted, seq.setup_ns)
        seq.setup_ns = 0
        if hidden:
            began = time.perf_counter()
            spec.observe(hidden[0])
            seq.handle.profile.add("drafting", time.perf_counter() - began)
        seq.prefilled = end
        self.prefill_tokens += end - begin
        if self.model.store is not None:
            self.model.store.after_tokens(end - begin)
        # a continued cache's positions are not a cold prefill's, and a kept one changes hands
        request = seq.request
        if (self.prefix_reuse and end - begin == self.prefill_chunk and request.start_cache is None
                and not request.keep_cache):
            self._remember(seq, end)
        if end == len(seq.prompt):
            if request.keep_cache and self.snapshot_bytes:  # where a later turn may go back to
                seq.snapshots = {end: seq.cache.snapshot()}
            self._sampled(seq, logits)

    def _remember(self, seq: _Seq, end: int) -> None:
        """The prompt's positions up to ``end`` are whole-chunk exact: index them."""
        p = seq.prefix
        if p is None:
            p = seq.prefix = _Prefix(seq.prompt, seq.cache)
            with self._lock:
                self._prefixes.append(p)
        p.exact, p.used = end, time.perf_counter()
        if self.snapshots:
            p.snapshots[end] = seq.cache.snapshot()
            for old in sorted(p.snapshots)[: -self.snapshots]:
                del p.snapshots[old]

    def _decode(self, seqs: list[_Seq]) -> None:
        """One batched step: each sequence's next token, and its drafts when it drafts
        (each drafted position a segment of its own: colibri_core.engine.speculative)."""
        feed, drafts = [], []
        for s in seqs:
            spec = s.speculation
            if spec is None:
                feed.append((np.asarray([s.next_token]), s.cache))
                drafts.append([])
                continue
            began = time.perf_counter()
            room = min(s.request.max_tokens - len(s.handle.token_ids) - 1, self.lm.max_context - s.cache.length - 1)
            forced = s.constraint.forced() if s.constraint is not None else None
            d = spec.drafts(s.prompt + s.handle.token_ids, room, forced)
            feed += spec.feed(s.cache, s.next_token, d) if d else [(np.asarray([s.next_token]), s.cache)]
            drafts.append(d)
            s.handle.profile.add("drafting", time.perf_counter() - began)
        keep = [] if any(s.speculation is not None and s.speculation.wants_hidden for s in seqs) else None
        clock, counted = self.profiler.begin()
        try:
            if len(feed) == 1:
                rows = self.lm.forward(feed[0][0], feed[0][1], self.ops, hidden=keep, clock=clock)[None]
            else:
                rows = self.lm.forward_batch(feed, self.batch_ops, all_logits=True, hidden=keep, clock=clock)
        except Exception as exc:
            for s in seqs:
                self._retire(s, "error", exc)
            return
        self.profiler.decoded([(s.handle.profile, 1 + len(d)) for s, d in zip(seqs, drafts)], clock, counted)
        if keep:  # each drafter reading hidden states gets its sequence's rows
            begin = 0
            for s, d in zip(seqs, drafts):
                spec, end = s.speculation, begin + 1 + len(d)
                if spec is not None and spec.wants_hidden:
                    began = time.perf_counter()
                    spec.verified(keep[0][begin:end]) if d else spec.observe(keep[0][begin:end])
                    s.handle.profile.add("drafting", time.perf_counter() - began)
                begin = end
        if self.model.store is not None:
            self.model.store.after_tokens(len(feed))
        emitted, begin = 0, 0
        for s, d in zip(seqs, drafts):
            mine, begin = rows[begin : begin + 1 + len(d)], begin + 1 + len(d)
            before = len(s.handle.token_ids)
            s.next_token = None
            self._sampled_rows(s, mine, d)
            emitted += len(s.handle.token_ids) - before
            if s.speculation is not None:
                s.speculation.step_done(len(s.handle.token_ids) - before)  # the gate of --draft auto times the step
        self._decoded.append((time.perf_counter(), emitted))

    def _sampled_rows(self, seq: _Seq, rows, drafts: list[int]) -> None:
        """Sample ``rows`` in order while each sampled token equals the draft fed after
        it; then forget the rejected drafts' positions."""
        length = seq.cache.length - len(drafts)  # where the cache stands after the first row
        accepted = 0
        for i, logits in enumerate(rows):
            self._sampled(seq, logits, length + i)
            if seq.next_token is None:  # retired
                break
            if i < len(drafts) and seq.next_token == drafts[i]:
                accepted += 1
                if i + 1 < len(rows):
                    seq.next_token = None
            else:
                break
        if drafts:
            self.drafted_tokens += len(drafts)
            self.accepted_tokens += accepted
            usage = seq.handle.usage
            usage["accepted_prediction_tokens"] += accepted
            usage["rejected_prediction_tokens"] += len(drafts) - accepted
            if seq.next_token is None:
                seq.speculation.abandon(seq.cache, accepted)
            else:
                seq.speculation.settle(seq.cache, accepted)

    def _sampled(self, seq: _Seq, logits, length: int | None = None) -> None:
        """Choose the next token from ``logits``, emit it, decide whether to go on;
        ``length``: the sequence's positions so far, if not its cache's (drafts fed)."""
        began = time.perf_counter()
        try:
            ended = self._choose(seq, logits, length)
        except Exception as exc:
            ended = ("error", exc)
        seq.handle.profile.add("sampling", time.perf_counter() - began)
        if ended is not None:
            self._retire(seq, *ended)

    def _choose(self, seq: _Seq, logits, length: int | None) -> tuple | None:
        """``_sampled``'s work: (reason,) when the sequence ends here, else None."""
        handle, request = seq.handle, seq.request
        if len(handle.token_ids) >= request.max_tokens:
            return ("length",)
        # NaN or degenerate logits end this sequence with an error naming the faulty layer
        check_logits(logits, self.lm, self.ops, seq.prompt + handle.token_ids, self.model)
        constraint = seq.constraint
        token, logprob = seq.sampler.sample(logits) if constraint is None else constraint.choose(seq.sampler, logits)
        if handle.ttft_s is None:
            handle.ttft_s = time.perf_counter() - handle.submitted
            self._ttft.append(handle.ttft_s)
        if token in request.stop_ids:
            handle.stop_id = token
            return ("stop",)
        handle.token_ids.append(token)
        if logprob is not None:
            handle.logprobs.append(logprob)
        self.tokens_total += 1
        began = time.perf_counter()
        text = seq.decoder.add(token) if seq.decoder is not None else ""
        took = time.perf_counter() - began  # detokenizing: apart from the sampling it sits in
        handle.profile.add("detokenize", took)
        handle.profile.add("sampling", -took)
        handle._emit(TokenEvent(token, text, logprob=logprob))
        if constraint is not None and constraint.finished:  # the output is complete
            return ("stop",)
        if len(handle.token_ids) >= request.max_tokens:
            return ("length",)
        if (seq.cache.length if length is None else length) >= self.lm.max_context:
            return ("context",)
        seq.next_token = token
        return None

    def _kept(self, seq: _Seq) -> KeptSequence | None:
        """The sequence's cache and the ids it holds, plus the id to feed next; None when
        nothing is in the cache yet."""
        ids = seq.prompt + seq.handle.token_ids + ([seq.handle.stop_id] if seq.handle.stop_id is not None else [])
        n = seq.cache.length
        if n == 0 or n >= len(ids):
            return None
        return KeptSequence(seq.cache, ids[: n + 1], seq.snapshots)

    def _retire_cancelled(self) -> None:
        for seq in [s for s in self._active if s.handle._cancelled]:
            self._retire(seq, "cancelled")

    def _retire(self, seq: _Seq, reason: str, error: BaseException | None = None) -> None:
        if seq not in self._active:
            return
        with self._lock:
            self._active.remove(seq)
            self.kv.release(seq.reserved)
            p = seq.prefix
            if p is not None:  # keep the prompt's cache for reuse, if its bytes fit
                p.live, p.nbytes = False, p.cache.nbytes + self.snapshot_bytes * len(p.snapshots)
                if reason == "error" or not self.kv.fits(p.nbytes):
                    self._prefixes.remove(p)
                    if reason != "error":
                        self._spill(p)
                else:
                    self.kv.reserve(p.nbytes)
            self._lock.notify_all()
        self._spill_queued()
        handle = seq.handle
        if seq.request.keep_cache and reason != "error":
            handle.kept = self._kept(seq)
        if reason != "error" and seq.decoder is not None:
            try:
                began = time.perf_counter()
                tail = seq.decoder.flush()
                handle.profile.add("detokenize", time.perf_counter() - began)
                if tail:
                    handle._emit(TokenEvent(-1, tail))
            except Exception as exc:
                reason, error = "error", exc
        self.profiler.finished(handle, reason)  # before the client hears of the end: its turn is there
        handle._finish(reason, error)

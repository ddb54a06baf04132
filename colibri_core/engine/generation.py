"""The generation loop: prefill, sample, decode, stop; with statistics.

Statistics keys are a contract read by other tools (``colibri run --json``):
decode_tok_s, prefill_tok_s, ttft_s, hit_rate, bytes_read, resident_bytes,
hits_device, hits_ram, misses, host_syncs_per_token, device_resident_bytes.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from colibri_core import interrupts
from colibri_core.errors import ColibriError, NonFiniteError, UsageError
from colibri_core.engine.sampling import Sampler, SamplingParams, TokenLogprob, check_max_tokens
from colibri_core.engine.speculative import Speculation
from colibri_core.engine.state import capture

PREFILL_CHUNK = 256  # prompt tokens per forward pass; bounds activation memory
RESERVE_AHEAD = 1024  # decode positions a sequence's caches are sized for before it starts


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float | None = 0.0  # None when no token was sampled
    decode_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    hit_rate: float = 0.0  # expert lookups served by a resident tier (device, RAM) / all lookups
    expert_hits: int = 0  # hits_device + hits_ram
    hits_device: int = 0  # served by the device tier (prepared experts in the backend's memory)
    hits_ram: int = 0  # served by the RAM tier: hits_pinned + hits_lru
    hits_pinned: int = 0  # of those, by the RAM tier's pinned set
    hits_lru: int = 0  # of those, by the RAM tier's LRU
    hits_prefetched: int = 0  # lookups served by an expert read ahead: misses prefetch saved
    misses: int = 0  # lookups that waited for a disk read
    expert_misses: int = 0  # the same as misses (the older name)
    bytes_read: int = 0  # expert bytes read from disk during this generation, all drives
    bytes_read_by_drive: dict = field(default_factory=dict)
    decode_bytes_read: int = 0  # of those, read after the first token (decode only)
    decode_bytes_per_token: float = 0.0  # decode_bytes_read per forward pass after the first token
    disk_reads: int = 0
    prefetch_issued: int = 0
    prefetch_unused: int = 0
    prefetch_skipped: int = 0  # predicted reads not issued: recent ones did not pay, or the step ran without
    prefetch_steps_off: int = 0  # forward passes the measured gate ran without reading ahead (it found them faster, or timed them)
    prefetch_precision: float = 0.0  # predicted experts that were used / predicted
    prefetch_recall: float = 0.0  # used experts that were predicted / used
    repins: int = 0
    read_wait_s: float = 0.0  # time the computation waited for expert reads
    decode_read_wait_s: float = 0.0  # of that, after the first token (a share of decode_s: what the disk cost decode)
    host_syncs: int = 0  # backend -> host synchronisations (Backend.to_host) during this generation
    host_syncs_per_token: float = 0.0  # of those, per decoded token (after the first)
    resident_bytes: int = 0  # dense weights + experts held in the RAM and device tiers, at the end
    device_resident_bytes: int = 0  # of those, in the backend's own memory (dense weights + device tier)
    pinned_experts: int = 0  # pinned in RAM and on the device
    kv_bytes: int = 0
    kv_bytes_per_token: int = 0
    cache_slots: int = 0  # RAM LRU slots per MoE layer
    device_cache_slots: int = 0  # device LRU slots per MoE layer (0: no device tier)
    # a compute tier's counters during this generation (ComputeTier.counters; {} without one)
    compute: dict = field(default_factory=dict)
    # speculative decoding (colibri_core.engine.speculative): the draft source ("" without one)
    draft_source: str = ""
    drafted_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # of those, equal to the token sampled at their position
    draft_acceptance: float = 0.0  # accepted_tokens / drafted_tokens
    draft_verifications: int = 0  # forward passes that carried drafts
    draft_replayed_tokens: int = 0  # tokens fed again where a state could not rewind
    draft_gated_steps: int = 0  # steps whose drafts --draft auto kept from verification (not expected to pay)
    draft_forced_tokens: int = 0  # of the drafted, tokens a constraint allowed alone (engine.constraints)
    tokens_per_forward: float = 0.0  # tokens after the first per forward pass after the first token
    resumed_tokens: int = 0  # positions restored from a saved state (colibri_core.engine.state), not computed

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class TokenEvent:
    token_id: int
    text: str  # the new text this token completes ("" while a character is incomplete)
    logits: np.ndarray | None = None
    logprob: TokenLogprob | None = None  # when the sampling parameters ask for logprobs


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    finish_reason: str  # "stop" (eos), "length" (max tokens), "context" (context full) or "interrupted"
    logits: list[np.ndarray] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the sampling parameters ask for them
    # with keep_state: the sequence's state to save (colibri_core.engine.state.SequenceState),
    # or None and state_error saying why there is none
    state: object | None = None
    state_error: str | None = None

    def as_dict(self) -> dict:
        out = {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
               "stats": self.stats.as_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token_id": t.token_id, "logprob": t.logprob,
                                "top_logprobs": [{"token_id": i, "logprob": lp} for i, lp in t.top]}
                               for t in self.logprobs]
        return out


@dataclass
class Generation:
    """An in-progress generation: iterate it for TokenEvents; afterwards ``result()``."""

    model: "object"
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    return_logits: bool = False
    # told (prompt tokens through the model, prompt tokens) as the prefill advances, layer by layer
    prefill_progress: Callable[[int, int], None] | None = None
    # drafts verified in batched forwards (colibri_core.engine.speculative); None: none
    speculation: Speculation | None = None
    # keep the sequence's state at the end, for ``result().state`` (colibri_core.engine.state)
    keep_state: bool = False
    # what the output must fit: a CompiledConstraint (colibri_core.engine.constraints); None: anything
    constraint: object | None = None
    # continue a saved sequence: (SequenceState, its cache, its sampler) from engine.state;
    # prompt_ids are then its token ids, all but the last already in the cache
    resume: tuple | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    _text: list[str] = field(default_factory=list)
    _logits: list[np.ndarray] = field(default_factory=list)
    _logprobs: list[TokenLogprob] = field(default_factory=list)
    _state: object | None = None
    _state_error: str | None = None

    def __iter__(self):
        model = self.model
        lm, ops, store_stats = model.lm, model.backend, model.store_counters
        prompt = list(self.prompt_ids)
        if not prompt:
            raise UsageError("the prompt is empty: give text or at least one token id")
        saved = self.resume
        if saved is None:
            lm.check_prompt(prompt)
            if len(prompt) >= lm.max_context:
                raise UsageError(f"the prompt has {len(prompt)} tokens; the context holds {lm.max_context}")
        check_max_tokens(self.max_tokens)
        self.sampling.check_vocab(lm.vocab_size)

        sampler = Sampler(self.sampling) if saved is None else saved[2]
        decoder = model.tokenizer.stream_decoder() if model.tokenizer is not None else None
        clock = _Clock(before=store_stats())
        cache = lm.new_cache(ops) if saved is None else saved[1]
        self.resume = None  # the cache is this generation's now: resuming it again would continue from here
        # room for the reply up front, so that no cache grows (and copies itself) mid-decode;
        # at most RESERVE_AHEAD positions past the prompt: a reply that stops early wastes little
        cache.reserve(len(prompt) + min(self.max_tokens, RESERVE_AHEAD))
        store = model.store
        self.finish_reason = "interrupted"  # until the loop below says otherwise
        report = self.prefill_progress
        layers = max(1, len(lm.layers))
        spec = self.speculation
        keep_hidden = spec is not None and spec.wants_hidden  # a drafter reads the hidden states (MTP)
        matcher = self.constraint.new() if self.constraint is not None else None
        fed = len(prompt)  # prompt tokens computed here (resuming: the last one)
        stopped_by = None  # the stop token that ended the generation
        try:
            logits = None
            if saved is not None:  # the saved caches hold every id but the last: feed it, as the decode step would
                fed = 1 if self.max_tokens > 0 else 0
                if fed:
                    hidden = [] if keep_hidden else None
                    logits = lm.forward(np.asarray(prompt[-1:]), cache, ops, hidden=hidden)
                    if hidden:
                        spec.observe(hidden[0])
            for i in range(0, len(prompt) if saved is None else 0, PREFILL_CHUNK):
                interrupts.check()
                chunk = prompt[i : i + PREFILL_CHUNK]
                after_layer = None
                if report is not None:
                    def after_layer(done, i=i, n=len(chunk)):
                        report(i + n * done // layers, len(prompt))
                hidden = [] if keep_hidden else None
                logits = lm.forward(np.asarray(chunk), cache, ops, after_layer=after_layer, hidden=hidden)
                if hidden:
                    spec.observe(hidden[0])
            if store is not None:
                store.after_tokens(len(prompt))
            clock.prefilled = time.perf_counter()
            finish = "length"
            rows, drafts = [logits], []  # logits to sample in order; the drafted token each row may confirm
            while self.max_tokens > 0:
                accepted, done = 0, False
                for i, row in enumerate(rows):
                    check_logits(row, lm, ops, prompt + self.token_ids, model)
                    token, logprob = sampler.sample(row) if matcher is None else matcher.choose(sampler, row)
                    now = time.perf_counter()
                    if clock.first is None:
                        clock.first = now
                        clock.at_first = store_stats()  # decode reads are counted from here
                    clock.last = now
                    if token in self.stop_ids:
                        finish, done = "stop", True
                        break
                    self.token_ids.append(token)
                    text = decoder.add(token) if decoder is not None else ""
                    self._text.append(text)
                    if self.return_logits:
                        self._logits.append(row)
                    if logprob is not None:
                        self._logprobs.append(logprob)
                    yield TokenEvent(token, text, row if self.return_logits else None, logprob)
                    if matcher is not None and matcher.finished:  # the output is complete
                        finish, done = "stop", True
                        break
                    if len(self.token_ids) >= self.max_tokens:
                        done = True
                        break
                    if i < len(drafts) and token == drafts[i]:
                        accepted += 1
                    else:
                        break
                if done:
                    if drafts:
                        spec.abandon(cache, accepted)
                    break
                if drafts:
                    spec.settle(cache, accepted)
                if spec is not None:
                    spec.step_done(accepted + 1)  # the gate of --draft auto times the step
                if cache.length >= lm.max_context:
                    finish = "context"
                    break
                interrupts.check()
                if spec is not None:  # room: tokens still to generate after the next one, and context
                    room = min(self.max_tokens - len(self.token_ids) - 1, lm.max_context - cache.length - 1)
                    drafts = spec.drafts(prompt + self.token_ids, room, matcher.forced() if matcher is not None else None)
                if drafts:
                    rows = list(spec.verify(cache, token, drafts))
                else:
                    hidden = [] if keep_hidden else None
                    rows = [lm.forward(np.asarray([token]), cache, ops, hidden=hidden)]
                    if hidden:
                        spec.observe(hidden[0])
                clock.decode_steps += 1
                if store is not None:
                    store.after_tokens(len(rows))
            self.finish_reason = finish
            if finish == "stop" and token in self.stop_ids:
                stopped_by = token  # the stop token is part of a kept state: sampled, not fed
        except KeyboardInterrupt:
            interrupts.clear()  # delivered: nothing left for check() to raise
            raise
        finally:  # also when interrupted (Ctrl-C, or the caller stopped iterating): stats of what was made
            self._record_stats(clock, store_stats(), fed, cache)
            if saved is not None:
                self.stats.resumed_tokens = len(prompt) - 1
            if self.keep_state:
                self._keep(cache, sampler, prompt, saved, stopped_by)
        if decoder is not None:
            tail = decoder.flush()
            if tail:
                self._text.append(tail)
                yield TokenEvent(-1, tail)

    def _keep(self, cache, sampler, prompt: list[int], saved, stop_token) -> None:
        """Keep the sequence's state (engine.state), or why it cannot be kept."""
        ids = prompt + self.token_ids + ([stop_token] if stop_token is not None else [])
        first = len(prompt) if saved is None else saved[0].prompt_tokens
        try:
            if len(ids) == len(prompt) and saved is None:
                raise ValueError("no token was sampled")
            self._state = capture(self.model, cache, ids, first, self.sampling, not self.stop_ids, sampler)
        except (ValueError, ColibriError) as exc:
            self._state, self._state_error = None, f"the sequence's state cannot be kept: {exc}"

    def _record_stats(self, clock: "_Clock", after: dict, prompt_tokens: int, cache) -> None:
        model, store = self.model, self.model.store
        before, at_first = clock.before, clock.at_first
        s = self.stats
        s.prompt_tokens, s.generated_tokens = prompt_tokens, len(self.token_ids)
        prefilled = clock.prefilled if clock.prefilled is not None else time.perf_counter()
        s.prefill_s = prefilled - clock.start
        s.prefill_tok_s = prompt_tokens / s.prefill_s if s.prefill_s > 0 and clock.prefilled is not None else 0.0
        # no token sampled (max_tokens 0, or interrupted in prefill): no time to first token
        s.ttft_s = clock.first - clock.start if clock.first is not None else None
        s.decode_s = clock.last - clock.first if clock.first is not None else 0.0
        s.decode_tok_s = (len(self.token_ids) - 1) / s.decode_s if len(self.token_ids) > 1 and s.decode_s > 0 else 0.0
        delta = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int)}
        s.hits_device = delta.get("hits_device", 0)
        s.hits_pinned, s.hits_lru = delta.get("hits_pinned", 0), delta.get("hits_lru", 0)
        s.hits_ram = s.hits_pinned + s.hits_lru
        s.hits_prefetched = delta.get("hits_prefetched", 0)
        s.misses = s.expert_misses = delta.get("misses", 0)
        s.expert_hits = s.hits_device + s.hits_ram
        lookups = s.expert_hits + s.hits_prefetched + s.misses
        s.hit_rate = s.expert_hits / lookups if lookups else 1.0
        s.bytes_read_by_drive = {name: n - before["bytes_by_drive"].get(name, 0) for name, n in after["bytes_by_drive"].items()}
        s.bytes_read = sum(s.bytes_read_by_drive.values())
        # decode reads: those of the forward passes after the first token (none without one)
        s.decode_bytes_read = (sum(n - at_first["bytes_by_drive"].get(name, 0) for name, n in after["bytes_by_drive"].items())
                               if at_first is not None else 0)
        s.decode_bytes_per_token = s.decode_bytes_read / clock.decode_steps if clock.decode_steps else 0.0
        s.disk_reads = delta.get("reads", 0)
        s.prefetch_issued, s.prefetch_unused = delta.get("prefetch_issued", 0), delta.get("prefetch_unused", 0)
        s.prefetch_skipped = delta.get("prefetch_skipped", 0)
        s.prefetch_steps_off = delta.get("prefetch_steps_off", 0)
        predicted, used = delta.get("predicted", 0), delta.get("used", 0)
        s.prefetch_precision = delta.get("predicted_used", 0) / predicted if predicted else 0.0
        s.prefetch_recall = delta.get("predicted_used", 0) / used if used else 0.0
        s.repins = delta.get("repins", 0)
        s.read_wait_s = delta.get("read_wait_ns", 0) / 1e9
        s.decode_read_wait_s = ((after.get("read_wait_ns", 0) - at_first.get("read_wait_ns", 0)) / 1e9
                                if at_first is not None else 0.0)
        s.compute = _counter_delta(after.get("compute", {}), before.get("compute", {}))
        s.host_syncs = delta["host_syncs"]
        decode_syncs = after["host_syncs"] - at_first["host_syncs"] if at_first is not None else 0
        s.host_syncs_per_token = decode_syncs / clock.decode_steps if clock.decode_steps else 0.0
        s.pinned_experts = len(store.ram.pinned_set() | (store.device.pinned_set() if store.device else set())) if store else 0
        s.resident_bytes = model.resident_bytes
        s.device_resident_bytes = model.device_resident_bytes
        s.kv_bytes = cache.nbytes
        s.kv_bytes_per_token = cache.bytes_per_token()
        s.tokens_per_forward = (len(self.token_ids) - 1) / clock.decode_steps if clock.decode_steps else 0.0
        if self.speculation is not None:
            d = self.speculation.stats
            s.draft_source = self.speculation.name
            s.drafted_tokens, s.accepted_tokens, s.draft_acceptance = d.drafted, d.accepted, d.acceptance
            s.draft_verifications, s.draft_replayed_tokens = d.verifications, d.replayed
            s.draft_gated_steps, s.draft_forced_tokens = d.gated_steps, d.forced
        s.cache_slots = model.placement.slots
        s.device_cache_slots = model.placement.device.slots if model.placement.device is not None else 0

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result()

    def result(self) -> GenerationResult:
        text = "".join(self._text) if self.model.tokenizer is not None else None
        return GenerationResult(list(self.token_ids), text, self.stats, self.finish_reason or "length",
                                self._logits if self.return_logits else None,
                                list(self._logprobs) if self.sampling.logprobs is not None else None,
                                self._state, self._state_error)


def _counter_delta(after: dict, before: dict) -> dict:
    """``after - before`` of nested counters (ints and dicts of them); others as after."""
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = _counter_delta(value, before.get(key) or {})
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = value - before.get(key, 0)
        else:
            out[key] = value
    return out


@dataclass
class _Clock:
    """Times and store counters of one generation, as far as it got."""

    before: dict
    start: float = field(default_factory=time.perf_counter)
    prefilled: float | None = None
    first: float | None = None  # when the first token was sampled
    last: float | None = None
    at_first: dict | None = None  # store counters then
    decode_steps: int = 0  # forward passes after the first token


def check_logits(logits: np.ndarray, lm, ops, ids: list[int], model) -> None:
    """Refuse to sample from NaN, infinite or degenerate logits (the same value for every
    token: say, a norm that collapsed a huge hidden state to zeros). The minimum and the
    maximum are two cheap passes over the vocabulary and catch all three; only when they
    fail is the step re-run layer by layer to say where it went wrong."""
    low, high = float(logits.min()), float(logits.max())  # NaN anywhere makes both NaN
    if math.isfinite(high - low) and (high > low or logits.size < 2):
        return
    finite = math.isfinite(high - low)
    found = lm.first_faulty_stage(ids, ops)
    if found:
        where = f"first in {found[0]}: {found[1]}"
    else:
        where = "(a re-run layer by layer stayed sound: the fault is not reproducible)"
    what = f"logits that are all {low:.3g}, the same for every token," if finite else "NaN or infinite logits"
    raise NonFiniteError(
        f"the model computed {what} after {len(ids)} tokens, {where}; its weights are damaged or "
        f"hold absurd values: run colibri doctor --model {model.model_dir} --deep")

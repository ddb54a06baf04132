"""Where each request's time went, phase by phase, for serve's profiling page.

The scheduler runs every forward pass with a ``StageClock`` (colibri_core.nn.stages) and
tells a ``Profiler`` what each step cost: a prefill chunk belongs to its one request; a
batched decode step's stage times, expert lookups and bytes read are shared among its
sequences by the rows each brought (its token and its drafts). Sampling, detokenizing and
drafting are timed per sequence; tokenizing is the caller's (``Request.tokenize_s``).
A finished request becomes a turn; the last ``keep`` turns are kept.

Times are the engine thread's wall clock: on a backend that queues work (``deferred``)
the device's work shows up in the stages that waited for it (colibri_core.nn.stages)."""

from __future__ import annotations

import collections
import threading
import time

from colibri_core.nn.stages import STAGES, StageClock

# the phases of a turn, in drawing order: the forward stages are the decode steps'
PHASES = ("tokenize", "prefill", *STAGES, "drafting", "sampling", "detokenize")
# the store's counters a turn reports, as StoreStats names them
_LOOKUPS = ("hits_device", "hits_pinned", "hits_lru", "hits_prefetched", "misses")


class TurnProfile:
    """One request's accumulators (``Handle.profile``)."""

    __slots__ = ("seconds", "prefill_ns", "counters", "bytes_read", "admitted", "steps")

    def __init__(self, tokenize_s: float = 0.0):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.seconds["tokenize"] = float(tokenize_s)
        self.prefill_ns = [0] * len(STAGES)  # the prefill's own stage split
        self.counters = dict.fromkeys(_LOOKUPS, 0.0)
        self.bytes_read = 0.0
        self.admitted: float | None = None
        self.steps = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds


class Profiler:
    """Per-step accounting for the scheduler, and the last ``keep`` finished turns."""

    def __init__(self, model, keep: int = 30):
        self.model = model
        self._turns: collections.deque = collections.deque(maxlen=keep)
        self._lock = threading.Lock()  # turns are read from the server's threads
        self._next_id = 1

    def _counters(self) -> tuple[dict, int]:
        store = self.model.store
        if store is None:
            return {}, 0
        stats = store.stats
        return {k: getattr(stats, k) for k in _LOOKUPS}, sum(d.bytes_read for d in store.disk.drives)

    def begin(self) -> tuple[StageClock, tuple[dict, int]]:
        """A step starts: its clock and the store's counters now."""
        return StageClock(), self._counters()

    def prefilled(self, profile: TurnProfile, clock: StageClock, before, setup_ns: int = 0) -> None:
        """A prefill chunk of ``profile``'s request ran with ``clock`` (``setup_ns``: setting
        the sequence up before it, reusing a prefix included)."""
        total = sum(clock.ns) + setup_ns
        profile.seconds["prefill"] += total / 1e9
        for i, ns in enumerate(clock.ns):
            profile.prefill_ns[i] += ns
        self._share([(profile, 1.0)], before)

    def decoded(self, shares: list[tuple[TurnProfile, int]], clock: StageClock, before) -> None:
        """A decode step ran with ``clock``; ``shares``: each sequence's rows in it."""
        rows = sum(n for _, n in shares)
        parts = [(p, n / rows) for p, n in shares]
        for p, part in parts:
            for name, ns in zip(STAGES, clock.ns):
                p.seconds[name] += ns * part / 1e9
            p.steps += 1
        self._share(parts, before)

    def _share(self, parts: list[tuple[TurnProfile, float]], before) -> None:
        counters, read = self._counters()
        if not counters:
            return
        was, was_read = before
        for p, part in parts:
            for k in _LOOKUPS:
                p.counters[k] += (counters[k] - was[k]) * part
            p.bytes_read += (read - was_read) * part

    def finished(self, handle, reason: str) -> None:
        """A request ended: keep it as a turn (its profile may still take the last
        sampling's time from the caller: the turn is read from it when asked for)."""
        p: TurnProfile | None = getattr(handle, "profile", None)
        if p is None or p.admitted is None:  # never ran
            return
        fixed = {"finish_reason": reason, "prompt_tokens": handle.usage["prompt_tokens"],
                 "cached_tokens": handle.usage.get("cached_tokens", 0), "completion_tokens": len(handle.token_ids),
                 "wall_s": time.perf_counter() - handle.submitted, "queued_s": p.admitted - handle.submitted,
                 "ttft_s": handle.ttft_s}
        with self._lock:
            fixed = {"id": self._next_id, "time": time.time(), **fixed}
            self._next_id += 1
            self._turns.append((fixed, p))

    def turns(self) -> list[dict]:
        """The last finished turns, oldest first."""
        with self._lock:
            kept = list(self._turns)
        return [_turn(fixed, p) for fixed, p in kept]


def _turn(fixed: dict, p: TurnProfile) -> dict:
    c = dict(p.counters)
    lookups = sum(c.values())
    return {**fixed, "steps": p.steps, "seconds": dict(p.seconds),
            "prefill_stages": {name: ns / 1e9 for name, ns in zip(STAGES, p.prefill_ns)},
            "lookups": round(lookups), "misses": round(c["misses"]),
            "hits": {"device": round(c["hits_device"]), "ram": round(c["hits_pinned"] + c["hits_lru"]),
                     "prefetched": round(c["hits_prefetched"])},
            "hit_rate": 1.0 - c["misses"] / lookups if lookups else None,
            "bytes_read": round(p.bytes_read)}

"""Speculative decoding: tokens drafted cheaply, verified in one batched forward.

A drafter proposes up to ``depth`` tokens to follow the sequence. The verification feeds
the last sampled token and the drafts as single-token segments of one batched step that
share the sequence's cache (``CausalLM.forward_batch``): the token mixers (attention,
MLA, Gated DeltaNet, ...) run position after position exactly as that many decode steps
would, while the dense linears, the routers and the routed experts run on all rows at
once through ``RowInvariantOps``, each row bit for bit what it is alone. Each MoE layer
thus reads the union of the rows' experts once, and every row's logits are the very bits
a decode step would have computed.

Acceptance: row i is sampled exactly as decoding samples it (the sequence's own
``Sampler``, in order), and draft i + 1 is accepted when the sampled token equals it.
The tokens are therefore those of decoding without drafts, greedy or seeded sampling
alike. For a draft that is one token rather than a distribution this is the rejection
rule of Leviathan et al. (2023) with a point-mass draft distribution: draft x is
accepted with probability p(x), and otherwise the token comes from p without x, which
is p again. The first token that differs from its draft is kept too (a verification
always gains one token); then the cache goes back to the last kept position:
``Cache.rewind`` where every layer can (KV caches and MLA latents forget rows, recurrent
states keep each position's state during the verification), else a snapshot taken
before it is restored and the kept tokens are fed again.

Draft sources are plugins (``DraftSpec``, the ``colibri_register_draft_sources`` hook);
the core's are ``ngram`` (prompt lookup) and ``auto`` (prompt lookup behind a
``DraftGate``, which turns drafting off while it measures it slower than decoding
without: a source with ``gated = True`` gets one).
"""

from __future__ import annotations

import time

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from colibri_core.engine.batching import RowInvariantOps
from colibri_core.errors import UsageError, option

MAX_DEPTH = 16  # drafted tokens per verification, at most
DEFAULT_DRAFT_DEPTH = 4


class Drafter(Protocol):
    """One sequence's drafter."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``tokens`` (the prompt and what was
        generated); fewer or none when it has no guess."""


class DraftSource(Protocol):
    """What a ``DraftSpec``'s ``impl`` builds for a loaded model: ``impl(model)``."""

    def new_drafter(self) -> Drafter:
        """A drafter for a new sequence."""


@dataclass
class DraftStats:
    drafted: int = 0  # tokens proposed and verified
    accepted: int = 0  # of those, equal to the token sampled at their position
    verifications: int = 0  # forwards that carried drafts
    replayed: int = 0  # tokens fed again to restore states that cannot rewind
    gated_steps: int = 0  # steps a DraftGate kept from drafting (it measured drafts slower)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class DraftGate:
    """Drafting on only while it pays, measured per sequence: the seconds per token of
    steps with drafts against steps without (moving averages). A drafted step slower
    per token than the plain ones closes the gate for ``backoff`` steps, which doubles
    at each failure up to ``MAX_BACKOFF`` (hysteresis: a source that keeps losing is
    retried ever more rarely) and returns to its start after a drafted step that paid;
    each opening measures drafts afresh.
    Before any plain step is timed, the step after a drafted one runs plain to measure."""

    START_BACKOFF, MAX_BACKOFF = 4, 256
    WEIGHT = 0.3  # of the newest step in the moving averages

    def __init__(self):
        self.plain: float | None = None  # seconds per token, steps without drafts
        self.drafted: float | None = None  # seconds per token, steps with drafts
        self.backoff = self.START_BACKOFF
        self.closed = 0  # steps left without drafting

    def open(self) -> bool:
        return self.closed == 0

    def skip(self) -> None:
        """A step the gate kept from drafting. When it opens again, the drafted steps'
        average starts afresh: what they cost before the pause says little now."""
        self.closed -= 1
        if self.closed == 0:
            self.drafted = None

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A step took ``seconds`` for ``tokens`` tokens, with drafts or without."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = seconds / tokens
        if not drafted:
            self.plain = rate if self.plain is None else self.plain + self.WEIGHT * (rate - self.plain)
            return
        self.drafted = rate if self.drafted is None else self.drafted + self.WEIGHT * (rate - self.drafted)
        if self.plain is None:
            self.closed = 1  # time a plain step first
        elif self.drafted > self.plain:
            self.closed, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_BACKOFF)
        else:
            self.backoff = self.START_BACKOFF


class NgramSource:
    """Prompt lookup (the ``ngram`` draft source): drafts copied from the sequence itself.
    No weights: the usual win where the output repeats its input (code edits, quoting,
    retrieval, tool loops)."""

    def __init__(self, model=None, *, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise UsageError(f"ngram drafts: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def new_drafter(self) -> "NgramDrafter":
        return NgramDrafter(self.min_n, self.max_n)


class AutoSource(NgramSource):
    """``auto``: prompt lookup behind a ``DraftGate``."""

    gated = True


class NgramDrafter:
    """Finds the longest suffix of the sequence (``max_n`` down to ``min_n`` tokens) that
    occurred before, and proposes what followed its latest earlier occurrence. The index
    of n-grams grows with the sequence, so a proposal costs O(new tokens), not a scan."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> position after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        end = len(tokens)
        # index the n-grams that end at positions with a token after them (not the suffix itself)
        for i in range(self._indexed, end - 1):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self._after[tuple(tokens[i - n + 1 : i + 1])] = i + 1
        self._indexed = max(self._indexed, end - 1)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._after.get(tuple(tokens[end - n :]))
            if start is not None:
                return [int(t) for t in tokens[start : start + k]]
        return []


def check_depth(depth) -> int:
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or not 1 <= depth <= MAX_DEPTH:
        raise UsageError(f"{option('draft_depth')} must be an integer from 1 to {MAX_DEPTH}, got {depth!r}")
    return int(depth)


class Speculation:
    """One sequence's drafting and verification (see the module docstring)."""

    def __init__(self, lm, backend, drafter: Drafter, depth: int, name: str = "", gate: DraftGate | None = None,
                 clock=time.perf_counter):
        self.lm, self.drafter, self.depth, self.name = lm, drafter, check_depth(depth), name
        self.ops = RowInvariantOps(backend)
        self.stats = DraftStats()
        self.gate, self.clock = gate, clock
        self._base = 0
        self._fed: list[int] = []
        self._snapshot = None
        self._started: float | None = None
        self._drafting = False

    def drafts(self, tokens: Sequence[int], room: int) -> list[int]:
        """Drafts to follow ``tokens``: at most ``depth``, and at most ``room`` (what the
        sequence may still generate after the next token, and the context still holds);
        none while the gate is closed. Starts the step's clock."""
        self._started = self.clock()
        if self.gate is not None and not self.gate.open():
            self.gate.skip()
            self.stats.gated_steps += 1
            self._drafting = False
            return []
        k = min(self.depth, room)
        drafts = [int(t) for t in self.drafter.propose(tokens, k)[:k]] if k > 0 else []
        self._drafting = bool(drafts)
        return drafts

    def step_done(self, tokens: int) -> None:
        """The step begun by ``drafts`` gave ``tokens`` tokens: the gate learns its time."""
        if self.gate is not None and self._started is not None:
            self.gate.observe(self._drafting, tokens, self.clock() - self._started)
        self._started = None

    def feed(self, cache, token: int, drafts: list[int]) -> list[tuple[np.ndarray, object]]:
        """The batched step's entries for ``token`` then ``drafts`` on ``cache``; readies
        the cache to go back afterwards."""
        self._base, self._fed = cache.length, [token, *drafts]
        if cache.rewindable():
            cache.keep_states()
            self._snapshot = None
        else:
            self._snapshot = cache.snapshot()
        return [(np.asarray([t], dtype=np.int64), cache) for t in self._fed]

    def verify(self, cache, token: int, drafts: list[int]) -> np.ndarray:
        """One sequence's verification on its own: (1 + len(drafts), vocab) logits."""
        return self.lm.forward_batch(self.feed(cache, token, drafts), self.ops, all_logits=True)

    def _count(self, accepted: int) -> None:
        self.stats.drafted += len(self._fed) - 1
        self.stats.accepted += accepted
        self.stats.verifications += 1

    def abandon(self, cache, accepted: int) -> None:
        """The sequence ended during the verification, after ``accepted`` drafts: count
        them, stop keeping states (the cache is not used again)."""
        self._count(accepted)
        if self._snapshot is None:
            cache.rewind(cache.length)
        self._snapshot = None

    def settle(self, cache, accepted: int) -> None:
        """Keep the fed token and the first ``accepted`` drafts; forget the rest."""
        self._count(accepted)
        keep = self._base + 1 + accepted
        if self._snapshot is None:
            cache.rewind(keep)
        elif keep < cache.length:
            cache.restore(self._base, self._snapshot)
            replay = [(np.asarray([t], dtype=np.int64), cache) for t in self._fed[: 1 + accepted]]
            self.lm.forward_batch(replay, self.ops)
            self.stats.replayed += len(replay)
        self._snapshot = None


def draft_sources() -> dict:
    """Installed draft sources: name -> registry entry."""
    from colibri_core.plugins.discovery import get_registry

    return {e.spec.name: e for e in get_registry().all("draft")}


def open_draft_source(name: str, model) -> DraftSource:
    """The installed draft source ``name`` built for ``model``: an unknown name is a
    one-line UsageError naming those installed."""
    sources = draft_sources()
    if name not in sources:
        raise UsageError(f"{option('draft')}: no draft source named {name!r} is installed (installed: "
                         f"{', '.join(sorted(sources)) or 'none'}; 'off' turns drafting off)")
    return sources[name].spec.load()(model)

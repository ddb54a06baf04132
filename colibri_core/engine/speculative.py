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
the core's are ``ngram`` (prompt lookup), ``mtp`` (the checkpoint's multi-token-prediction
layer) and ``auto`` (prompt lookup behind a ``DraftGate``, which verifies drafts only as
deep as their measured acceptance and cost say pays: a source with ``gated = True`` gets
one).
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
    """One sequence's drafter. One that sets ``wants_hidden = True`` also gets
    ``observe(hidden)``: the model's final-normed hidden states (a backend array of rows)
    of the positions it has just computed and kept, in order, from the prompt's first on
    (what MTP layers read)."""

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
    gated_steps: int = 0  # steps whose drafts a DraftGate kept from verification (not expected to pay)
    forced: int = 0  # of the drafted, tokens a constraint forced (colibri_core.engine.constraints)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class DraftGate:
    """Drafting verified only where it is expected to pay, per sequence (``--draft auto``).

    It keeps two measurements. The drafts' per-token acceptance *a*: while the gate keeps
    drafts from being verified it still asks for one and scores it against the token the
    plain step then samples (a shadow draft: it costs the proposal only), and verified
    drafts count too (a verification that keeps m of k drafts scored m hits of m + 1 tries,
    or m of m when all were kept). And the verification's cost: a step carrying k drafts
    costs ``1 + beta * k`` plain steps, beta measured from the drafted steps' times against
    the plain steps' (moving averages; ``BETA_PRIOR`` before any).
    A verification of k drafts gives ``(1 - a^(k+1)) / (1 - a)`` tokens on average, so
    the gate verifies the k that maximises that over its cost, and none (shadow only)
    when no k beats a plain step by ``MARGIN``. A cost measured too high is tried again
    every ``RETRY`` shadow steps while the prior cost would pay (the retry's cost replaces
    the stale one). Measurements decay
    (``DECAY`` per observation): a source that starts or stops guessing right is followed.
    """

    BETA_PRIOR = 0.5  # a drafted token's cost, in plain steps, before any is measured
    A_PRIOR, PRIOR_TRIES = 0.5, 2.0  # the acceptance before any draft is scored, and its weight
    MARGIN = 1.03  # expected speed-up a verification must promise
    DECAY = 0.95  # of the acceptance counts, per scored draft
    WEIGHT = 0.3  # of the newest step in the moving averages of times
    RETRY = 64  # shadow steps between tries of a cost measured too high
    SHADOW_EVERY = 8  # a costly drafter's shadow drafts, once its cost is measured: every 8th plain step

    def __init__(self):
        self.hits, self.tries = self.A_PRIOR * self.PRIOR_TRIES, self.PRIOR_TRIES
        self.plain: float | None = None  # seconds per plain step
        self.beta: float | None = None  # a drafted token's measured cost, in plain steps
        self.since_verified = 0  # shadow steps since the last verification

    @property
    def acceptance(self) -> float:
        return self.hits / self.tries

    def score(self, hits: int, tries: int) -> None:
        for _ in range(tries):
            self.hits, self.tries = self.hits * self.DECAY, self.tries * self.DECAY
        self.hits, self.tries = self.hits + hits, self.tries + tries

    def _best(self, most: int, beta: float) -> tuple[int, float]:
        a = min(self.acceptance, 0.999)
        best = (0, 1.0)
        for k in range(1, most + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / (1 + beta * k)
            if gain > best[1]:
                best = (k, gain)
        return best

    def depth(self, most: int) -> int:
        """How many of ``most`` drafts to verify in the next step (0: none, shadow only)."""
        if self.plain is None:
            return 0  # time a plain step first
        beta = self.BETA_PRIOR if self.beta is None else self.beta
        k, gain = self._best(most, beta)
        if gain >= self.MARGIN:
            return k
        if self.beta is not None and self.since_verified >= self.RETRY:
            k, gain = self._best(most, min(beta, self.BETA_PRIOR))
            if gain >= self.MARGIN:
                return k
        return 0

    def shadow_due(self) -> bool:
        """Whether a costly drafter (``costly = True``: MTP) should propose a shadow draft
        this step: every step while its drafts look right at least as often as the prior
        and no verification has been timed, else every ``SHADOW_EVERY`` steps."""
        return (self.beta is None and self.acceptance >= self.A_PRIOR) or self.since_verified % self.SHADOW_EVERY == 0

    def observe(self, drafted: int, seconds: float) -> None:
        """A step carrying ``drafted`` verified drafts (0: a plain step) took ``seconds``."""
        if seconds <= 0:
            return
        if not drafted:
            self.since_verified += 1
            self.plain = seconds if self.plain is None else self.plain + self.WEIGHT * (seconds - self.plain)
            return
        stale, self.since_verified = self.since_verified >= self.RETRY, 0
        if self.plain is None:
            return
        beta = max(0.0, (seconds / self.plain - 1) / drafted)  # a retry's measurement replaces a stale one
        self.beta = beta if self.beta is None or stale else self.beta + self.WEIGHT * (beta - self.beta)


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


class AutoSource:
    """``auto``: the best source the model has, behind a ``DraftGate``: its MTP layer when
    it was loaded with one (``load(mtp=True)``; the CLI's ``--draft auto`` loads it where
    the checkpoint has a usable one), else prompt lookup."""

    gated = True

    def __init__(self, model):
        self.inner = MTPSource(model) if model.lm.mtp else NgramSource(model)
        self.name = "mtp" if model.lm.mtp else "ngram"

    def new_drafter(self):
        return self.inner.new_drafter()


class MTPSource:
    """The ``mtp`` draft source: the checkpoint's own multi-token-prediction layer
    (``colibri_core.nn.mtp``), loaded with the model (``load(mtp=True)``; the CLI does it
    for ``--draft mtp``). Drafts chain the first MTP layer for depth > 1."""

    def __init__(self, model):
        if not model.lm.mtp:
            from colibri_core.nn.mtp import mtp_layout

            _, has, field_name = mtp_layout(model.config)
            raise UsageError(f"{option('draft')} mtp: " + (
                f"{model.model_dir} was loaded without its multi-token-prediction layers: load it with mtp=True"
                if has else f"{model.model_dir} has no multi-token-prediction layers ({field_name} is "
                            "0 or absent); use ngram or auto"))
        self.layer, self.backend, self.max_len = model.lm.mtp[0], model.backend, model.lm.max_context

    def new_drafter(self) -> "MTPDrafter":
        return MTPDrafter(self.layer, self.backend, self.max_len)


class MTPDrafter:
    """Runs one sequence's positions through the MTP layer as the main model computes
    them (its own attention cache), and drafts greedily: position i's hidden state and
    token i + 1 guess token i + 2; deeper drafts feed the layer's own output back.
    Positions computed for drafts only are forgotten after each proposal (rewound, or
    restored from a snapshot where the cache changes in place: a sliding window)."""

    wants_hidden = True
    costly = True  # a proposal runs the layer and an LM head: a DraftGate asks for shadow drafts rarely

    def __init__(self, layer, backend, max_len: int):
        self.layer, self.ops = layer, backend
        self.cache = layer.new_cache(backend, max_len)
        self.pending: list = []  # hidden rows of positions not through the layer yet
        self.lost = False  # positions were never observed (a reused prompt prefix): no drafts

    def observe(self, hidden) -> None:
        self.pending.append(hidden)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        ops, start = self.ops, self.cache.length
        rows = self.pending[0] if len(self.pending) == 1 else ops.concat(self.pending, 0) if self.pending else None
        count = 0 if rows is None else rows.shape[0]
        if self.lost or start + count != len(tokens) - 1:  # the last token's hidden state is not computed yet
            self.lost, self.pending = True, []
            return []
        if k <= 0 or count == 0:
            return []
        self.pending = []
        logits, out = self.layer(rows, np.asarray(tokens[start + 1 :], dtype=np.int64), self.cache, ops)
        kept = self.cache.length
        drafts = [int(np.argmax(logits))]
        if k == 1:
            return drafts
        # a state that changes in place (a sliding window: MiMo-V2-Flash's MTP layer) goes back through a snapshot
        snapshot = None if self.cache.rewindable() else self.cache.snapshot()
        while len(drafts) < k:
            logits, out = self.layer(out, np.asarray(drafts[-1:], dtype=np.int64), self.cache, ops)
            drafts.append(int(np.argmax(logits)))
        if snapshot is None:
            self.cache.rewind(kept)
        else:
            self.cache.restore(kept, snapshot)
        return drafts


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
        self._drafting = 0  # drafts the current step verifies
        self._shadow: tuple[int, int] | None = None  # (position, draft) kept aside by the gate
        self.wants_hidden = bool(getattr(drafter, "wants_hidden", False))
        self._costly = bool(getattr(drafter, "costly", False))
        self._hidden = None  # the verification's rows of hidden states, for the drafter

    def observe(self, hidden) -> None:
        """Hidden states of positions computed and kept outside a verification (prefill,
        plain steps): for a drafter that reads them."""
        if self.wants_hidden:
            self.drafter.observe(hidden)

    def verified(self, hidden) -> None:
        """The verification's hidden states, one row per fed token (a batched engine
        hands over its sequence's rows)."""
        self._hidden = hidden

    def drafts(self, tokens: Sequence[int], room: int, forced: Sequence[int] | None = None) -> list[int]:
        """Drafts to follow ``tokens``: at most ``depth``, and at most ``room`` (what the
        sequence may still generate after the next token, and the context still holds);
        with a gate, as many as it expects to pay (none: the first draft is kept aside, to
        be scored against the token sampled next). ``forced``: tokens a constraint allows
        alone from here (``Constraint.forced``): drafted instead of the source's, as
        sampling can pick nothing else (they still are verified and sampled). Starts the
        step's clock."""
        if forced:
            self._started = self.clock()
            drafts = [int(t) for t in forced[: min(self.depth, room)]]
            self._drafting = len(drafts)
            self.stats.forced += len(drafts)
            return drafts
        gate = self.gate
        if gate is not None and self._shadow is not None:
            at, guess = self._shadow
            if len(tokens) > at:
                gate.score(int(tokens[at] == guess), 1)
            self._shadow = None
        self._started = self.clock()
        k = min(self.depth, room)
        use = k if gate is None or k <= 0 else gate.depth(k)
        shadow = gate is not None and k > 0 and (not self._costly or gate.shadow_due())
        ask = use if use > 0 else (1 if shadow else 0)
        drafts = [int(t) for t in self.drafter.propose(tokens, ask)[:ask]] if ask > 0 else []
        if gate is not None and use == 0:
            if drafts:
                self._shadow = (len(tokens), drafts[0])
                self.stats.gated_steps += 1
            drafts = []
        self._drafting = len(drafts)
        return drafts

    def step_done(self, tokens: int) -> None:
        """The step begun by ``drafts`` ended (``tokens`` tokens): the gate learns its time."""
        if self.gate is not None and self._started is not None:
            self.gate.observe(self._drafting, self.clock() - self._started)
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
        hidden = [] if self.wants_hidden else None
        logits = self.lm.forward_batch(self.feed(cache, token, drafts), self.ops, all_logits=True, hidden=hidden)
        if hidden:
            self.verified(hidden[0])
        return logits

    def _count(self, accepted: int) -> None:
        drafted = len(self._fed) - 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.verifications += 1
        if self.gate is not None:
            self.gate.score(accepted, accepted + (accepted < drafted))

    def abandon(self, cache, accepted: int) -> None:
        """The sequence ended during the verification, after ``accepted`` drafts: count
        them, stop keeping states (the cache is not used again)."""
        self._count(accepted)
        if self._snapshot is None:
            cache.rewind(cache.length)
        self._snapshot = self._hidden = None

    def settle(self, cache, accepted: int) -> None:
        """Keep the fed token and the first ``accepted`` drafts; forget the rest."""
        self._count(accepted)
        keep = self._base + 1 + accepted
        if self._hidden is not None:  # the kept rows' (a replay below computes the same bits)
            self.drafter.observe(self._hidden[: 1 + accepted])
            self._hidden = None
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

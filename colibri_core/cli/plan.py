"""``colibri plan``: what a placement will look like before anything is loaded.

From the validated model (headers and family declarations; one expert is read to time
it), the backend, the RAM and device budgets and the routing history, it computes the
placement tier by tier (dense weights where, experts per tier), projected hit rates
and the per-token costs of disk, upload and compute, and names the bottleneck.

Two hit rates are projected, because ``colibri run`` starts with empty expert caches
(unless ``--preload``):

- the **run** hit rate: what ``colibri run`` reports for a ``--prompt-tokens`` prompt
  and ``--tokens`` generated tokens from empty caches. It is simulated: the tiers'
  LRUs and pinned sets, fed top-k routings drawn independently per token from the
  saved history's frequencies (uniform when there is none), with a fixed seed. The
  projected decode speed uses the misses of this run.
- the **steady** hit rate: the same caches long after warm-up, by Che's approximation
  of an LRU under independent references.

Routing that repeats itself (a model stuck on one token) hits more often than
independent draws; routing that drifts from the history hits less. Both are estimates;
``colibri run`` reports the real rates.

The compute estimate is measured, not derived from a FLOP rate: the backend computes
one of the model's own experts for one token (the decode shape) a number of times, and
the dense weights are priced as calls of that kind. A miss costs what reading a layer's
top-k experts from disk (their pages dropped from the page cache first) on the store's
I/O threads takes per expert, decoding included; with ``--disk-bw`` given, the expert's
bytes at that bandwidth plus the measured decode.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from colibri_core.model.blueprint import Blueprint
from colibri_core.experts.history import RoutingHistory
from colibri_core.experts.store import PinPolicy
from colibri_core.model.placement import Placement

DEFAULT_UPLOAD_BW = 25e9  # bytes/s host -> device, about PCIe 4.0 x16 (an assumption: not measured)


def lru_item_hits(p: np.ndarray, slots: int) -> np.ndarray:
    """Che's approximation: the probability that item i is in an LRU with ``slots``
    entries when it is requested with probability p[i] (p sums to 1)."""
    hits = np.zeros(p.size)
    live = p > 0
    if slots <= 0 or not live.any():
        return hits
    if slots >= live.sum():
        hits[live] = 1.0
        return hits
    q = p[live]
    lo, hi = 0.0, 1.0
    while np.sum(1 - np.exp(-q * hi)) < slots:
        hi *= 2
    for _ in range(100):  # characteristic time: expected distinct items in time t equals slots
        mid = (lo + hi) / 2
        if np.sum(1 - np.exp(-q * mid)) < slots:
            lo = mid
        else:
            hi = mid
    hits[live] = 1 - np.exp(-q * hi)
    return hits


def lru_hit_rate(p: np.ndarray, slots: int) -> float:
    """Che's approximation: hit rate of an LRU with ``slots`` entries when item i is
    requested with probability p[i] (p sums to 1)."""
    return float(np.sum(p * lru_item_hits(p, slots)))


def projected_hit_rates(scores: np.ndarray | None, layers: int, experts: int,
                        tiers: list[tuple[int, list[tuple[int, int]]]]) -> list[float]:
    """The share of all lookups each tier serves; ``tiers`` are (LRU slots per layer,
    pinned (layer, expert) pairs), fastest first, each seeing what those before it missed."""
    rates = np.zeros(len(tiers))
    for layer in range(layers):
        counts = scores[layer] if scores is not None and scores[layer].sum() > 0 else np.ones(experts)
        q = counts / counts.sum()  # the requests reaching this tier, as a share of all
        for i, (slots, pinned) in enumerate(tiers):
            mask = np.zeros(experts, dtype=bool)
            mask[[e for le, e in pinned if le == layer]] = True
            hit = mask.astype(float)
            rest = np.where(mask, 0.0, q)
            if rest.sum() > 0:
                hit[~mask] = lru_item_hits(rest[~mask] / rest.sum(), slots)
            rates[i] += float(np.sum(q * hit))
            q = q * (1 - hit)
    return [float(r / layers) for r in rates] if layers else [1.0] + [0.0] * (len(tiers) - 1)


DEFAULT_PROMPT_TOKENS = 16
DEFAULT_TOKENS = 128  # colibri run's --max-tokens default
SIMULATED_RUNS = 4  # independent draws of the routing, averaged


def _held(tier, e) -> bool:
    return e in tier[0] or e in tier[1]


def _put(tier, e, slots) -> None:
    """``CachedTier.put``: an expert just used is kept in the LRU when it has slots."""
    pinned, lru = tier
    if e in pinned or e in lru or slots <= 0:
        return
    while len(lru) >= slots:
        lru.popitem(last=False)
    lru[e] = True


def inclusion_probabilities(counts: np.ndarray, k: int) -> np.ndarray:
    """The chance that a token routes to each expert, from routing counts: k times the
    expert's share, capped at 1 (the excess spread over the others), summing to k."""
    pi = np.zeros(counts.size)
    if k <= 0:
        return pi
    live = counts > 0
    if live.sum() <= k:  # every expert ever chosen is chosen always, the rest fill up
        pi[live] = 1.0
        rest = ~live
        if rest.any():
            pi[rest] = (k - live.sum()) / rest.sum()
        return pi
    capped = np.zeros(counts.size, dtype=bool)
    while True:
        free = live & ~capped
        pi[capped] = 1.0
        pi[free] = counts[free] / counts[free].sum() * (k - capped.sum())
        over = free & (pi > 1)
        if not over.any():
            return pi
        capped |= over


def draw_routings(inclusion: np.ndarray, k: int, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """``tokens`` routings of k distinct experts each, expert i included with probability
    ``inclusion[i]`` (they sum to k): systematic sampling over a random order of the
    experts, so the draws match the history's frequencies exactly, token by token."""
    out = np.empty((tokens, k), dtype=np.int64)
    for t in range(tokens):
        order = rng.permutation(inclusion.size)
        edges = np.cumsum(inclusion[order])
        edges[-1] = k  # no rounding gap at the end: every point lands on an expert
        points = rng.random() + np.arange(k)
        out[t] = order[np.minimum(np.searchsorted(edges, points, side="right"), inclusion.size - 1)]
    return out


def simulate_run(scores: np.ndarray | None, layers: int, experts: int, top_k: int,
                 tiers: list[tuple[int, list[tuple[int, int]]]], *, prompt_tokens: int, tokens: int,
                 preload: bool = False, runs: int = SIMULATED_RUNS, seed: int = 0) -> dict:
    """The expert lookups of a run from empty caches, simulated as the store serves them.

    ``tiers``: (LRU slots per layer, pinned (layer, expert) pairs), fastest first. The
    prompt is one forward pass per ``PREFILL_CHUNK`` tokens (each expert looked up once
    for all its tokens), then each generated token looks up its ``top_k`` experts. A hit
    in a tier offers the expert to the faster tiers; a miss to all of them. Routing:
    ``top_k`` distinct experts per token, each chosen as often as in the history
    (uniformly without one), independently token to token. Returns the share of all lookups each
    tier served (``tier_rates``), the run's ``hit_rate`` and ``decode_misses_per_token``."""
    from collections import OrderedDict

    from colibri_core.engine.generation import PREFILL_CHUNK

    rng = np.random.default_rng(seed)
    hits = np.zeros(len(tiers))
    lookups = decode_misses = 0
    chunks = [min(PREFILL_CHUNK, prompt_tokens - i) for i in range(0, max(prompt_tokens, 0), PREFILL_CHUNK)]
    steps = len(chunks) + max(tokens - 1, 0)  # the prefill's last pass makes the first token
    k = min(top_k, experts)
    for layer in range(layers):
        counts = scores[layer] if scores is not None and scores[layer].sum() > 0 else np.ones(experts)
        inclusion = inclusion_probabilities(counts, k)
        pinned = [{e for le, e in p if le == layer} for _, p in tiers]
        for _ in range(runs):
            chosen = draw_routings(inclusion, k, prompt_tokens + max(tokens - 1, 0), rng)
            state = [(pinned[i], OrderedDict()) for i in range(len(tiers))]
            if preload:  # ``ExpertStore.warm``: the lowest ids, through RAM to the device tier
                for e in range(max((slots for slots, _ in tiers), default=0)):
                    for i in reversed(range(len(tiers))):
                        if e < tiers[i][0]:
                            _put(state[i], e, tiers[i][0])
            row = 0
            for step in range(steps):
                prefill = step < len(chunks)
                n = chunks[step] if prefill else 1
                wanted = np.unique(chosen[row : row + n])
                row += n
                for e in wanted.tolist():
                    lookups += 1
                    for i, tier in enumerate(state):
                        if _held(tier, e):
                            hits[i] += 1
                            if e in tier[1]:
                                tier[1].move_to_end(e)
                            for j in range(i):
                                _put(state[j], e, tiers[j][0])
                            break
                    else:
                        decode_misses += not prefill
                        for j in range(len(tiers)):
                            _put(state[j], e, tiers[j][0])
    if not lookups:
        return {"tier_rates": [1.0] + [0.0] * (len(tiers) - 1) if tiers else [], "hit_rate": 1.0,
                "decode_misses_per_token": 0.0}
    rates = hits / lookups
    decoded = runs * layers * max(tokens - 1, 0)
    return {"tier_rates": [float(r) for r in rates], "hit_rate": float(rates.sum()),
            "decode_misses_per_token": decode_misses / (decoded / layers) if decoded else 0.0}


DENSE_CALLS_PER_LAYER = 4  # at least: attention projections, attention, output projection, router


@dataclass
class ExpertTiming:
    one_expert_s: float  # the backend computing one expert for one token
    top_k_s: float  # a MoE layer's top-k experts for one token (one routed_experts call)
    host_form_s: float  # turning one expert's bytes, once read, into the form the tiers keep
    miss_s: float  # one expert of a layer's misses, read from disk with the others as the store reads them
    row_cost: float = 1.0  # what a second token costs a weight pass, in first tokens (0: free, 1: as much)

    def compute_s(self, *, dense_bytes: int, expert_bytes: int, layers: int, moe_layers: int) -> float:
        """Seconds of computation per decoded token: each MoE layer's top-k experts, and
        the dense weights priced as one-expert calls, by bytes, but at least
        ``DENSE_CALLS_PER_LAYER`` calls per layer (a small model's time is mostly calls)."""
        dense_calls = max(dense_bytes / max(expert_bytes, 1), DENSE_CALLS_PER_LAYER * layers)
        return moe_layers * self.top_k_s + dense_calls * self.one_expert_s


def _median_seconds(call, repeats: int) -> float:
    call()  # a warm-up: first calls pay for thread pools and caches
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def measure_expert_timing(bp: Blueprint, repeats: int = 15, window_s: float = 0.5) -> ExpertTiming:
    """Time the model's first expert on the backend, for one token (the decode shape):
    alone, and as a whole layer's top-k (the same weights fetched for k expert ids, so
    only one expert is read from disk). Also the load of that expert once its bytes are
    in the page cache. Medians of repeated calls of the backend's own kernels on the
    model's own format: a busy machine slows every call of the run too, and a median
    is what a run's many calls average to, where one FLOP-rate sample of an unrelated
    matrix product is neither stable nor the cost of a one-token decode."""
    from colibri_core.io.drives import Drive
    from colibri_core.plugins.discovery import get_registry

    backend = bp.backend
    matrices = bp.moe[0].matrices[0]
    disk = get_registry().tier("disk").spec.load()(
        [Drive("primary", {sf.path: sf.path for sf in bp.checkpoint.files.values()})], bp.resolver, backend)
    try:
        miss_s = _miss_seconds(bp, disk)
        host = disk.load(0, 0, matrices)  # the bytes are in the page cache now
        host_form_s = _median_seconds(lambda: disk.load(0, 0, matrices), max(3, repeats // 3))
    finally:
        disk.close()
    weights = host.prepared(backend)
    decl = bp.moe[0]
    hidden = bp.lm.embed.weight.shape[-1]
    x = backend.asarray(np.random.default_rng(0).standard_normal((1, hidden), dtype=np.float32))
    k = max(1, bp.top_k)

    def layer(n):
        indices = np.arange(n, dtype=np.int64)[None, :]
        scale = np.full((1, n), 1 / n, dtype=np.float32)
        if decl.glu:  # biases, a fused gate_up or another activation (gpt-oss)
            return lambda: backend.to_host(backend.routed_glu_experts(x, indices, scale, lambda e: weights,
                                                                      decl.activation))
        return lambda: backend.to_host(backend.routed_experts(x, indices, scale, lambda e: weights))

    x2 = backend.asarray(np.random.default_rng(1).standard_normal((2, hidden), dtype=np.float32))
    both = np.zeros((2, 1), dtype=np.int64)
    half = np.full((2, 1), 1.0, dtype=np.float32)
    if decl.glu:
        rows2 = lambda: backend.to_host(backend.routed_glu_experts(x2, both, half, lambda e: weights, decl.activation))  # noqa: E731
    else:
        rows2 = lambda: backend.to_host(backend.routed_experts(x2, both, half, lambda e: weights))  # noqa: E731

    one, top_k = layer(1), layer(k)
    one(), top_k(), rows2()  # warm-up: first calls pay for thread pools and caches
    times = []
    started = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - started < window_s:
        pair = []
        for call in (one, top_k, rows2):  # interleaved: a burst of load slows all alike
            t0 = time.perf_counter()
            call()
            pair.append(time.perf_counter() - t0)
        times.append(pair)
    one_s, top_k_s, two_rows_s = np.mean(times, axis=0)
    row_cost = float(np.clip(two_rows_s / one_s - 1, 0.0, 1.0)) if one_s > 0 else 1.0
    return ExpertTiming(float(one_s), float(max(top_k_s, one_s)), host_form_s, miss_s, row_cost)


DRAFT_DEPTHS = (1, 2, 3, 4)
DRAFT_ACCEPTANCES = (0.5, 0.8)  # prompt lookup on repetitive text; MTP layers at int8


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verification of ``k`` drafts gives when each is right with probability
    ``a`` (until the first wrong one), the token after the last kept included."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def break_even_acceptance(cost_ratio: float, k: int) -> float | None:
    """The acceptance at which ``k`` drafts give as many tokens as their verification
    costs plain steps (``cost_ratio``), or None when no acceptance pays."""
    if cost_ratio >= k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens(mid, k) < cost_ratio else (low, mid)
    return high


def draft_projection(*, dense_s: float, experts_s: float, disk_s: float, upload_s: float, prefetch: bool,
                     row_cost: float, experts: int, top_k: int, acceptance: float | None = None) -> list[dict]:
    """Speculative decoding projected on this plan: per draft depth k, what a step
    verifying k drafts costs in plain steps, the acceptance above which it pays, and the
    speed-up at typical acceptances (and at ``acceptance``). A step of 1 + k rows passes
    the dense weights once, each row adding ``row_cost`` of a pass; each MoE layer computes
    and reads the union of the rows' experts (routing taken as uniform: a trained router
    that repeats itself reads fewer), the misses in proportion."""
    def step(rows: int) -> float:
        union = experts * (1 - (1 - top_k / experts) ** rows) / top_k if experts else 1.0  # in one token's top-k
        per_expert_rows = rows / union
        compute = dense_s * (1 + row_cost * (rows - 1)) + experts_s * union * (1 + row_cost * (per_expert_rows - 1))
        transfer = (disk_s + upload_s) * union
        return max(transfer, compute) if prefetch else transfer + compute

    plain = step(1)
    out = []
    for k in DRAFT_DEPTHS:
        ratio = step(1 + k) / plain if plain > 0 else float(k + 1)
        row = {"depth": k, "cost_ratio": ratio, "break_even_acceptance": break_even_acceptance(ratio, k),
               "speedup": {str(a): expected_tokens(a, k) / ratio for a in DRAFT_ACCEPTANCES}}
        if acceptance is not None:
            row["speedup"][str(acceptance)] = expected_tokens(acceptance, k) / ratio
        out.append(row)
    return out


def _miss_seconds(bp: Blueprint, disk) -> float:
    """Seconds per expert when a layer's experts miss together: their pages dropped from
    the page cache, then read and turned into their host form on the store's I/O threads
    at once, as ``ExpertStore.request`` reads a layer's misses. Two batches of distinct
    experts: the first pays what a run pays once (threads, fresh buffers faulted in), the
    second is timed."""
    from concurrent.futures import ThreadPoolExecutor

    from colibri_core.experts.store import ExpertStore
    from colibri_core.io.pagecache import drop_page_cache

    n = max(16, 2 * bp.top_k)  # enough reads to average a disk's jitter
    batches = [[(0, e) for e in range(min(n, bp.moe[0].count))]]
    if len(bp.moe) > 1:
        batches.append([(1, e) for e in range(min(n, bp.moe[1].count))])
    else:
        batches.append([(0, e) for e in range(n, min(2 * n, bp.moe[0].count))] or batches[0])
    for sf in bp.checkpoint.files.values():
        drop_page_cache(sf.path)
    workers = ExpertStore.__dataclass_fields__["io_workers"].default
    with ThreadPoolExecutor(workers) as pool:
        seconds = 0.0
        for batch in batches:
            if batch is batches[-1] and batch is batches[0]:  # one small layer: the same experts, dropped again
                for sf in bp.checkpoint.files.values():
                    drop_page_cache(sf.path)
            started = time.perf_counter()
            list(pool.map(lambda le: disk.load(le[0], le[1], bp.moe[le[0]].matrices[le[1]]), batch))
            seconds = (time.perf_counter() - started) / len(batch)
        return seconds


@dataclass
class PlanReport:
    data: dict
    placement: Placement


def make_plan(bp: Blueprint, *, ram: int | None, cap: int | None, pin: str = "auto", pin_share: float = 0.5,
              prefetch: bool = False, prefetch_slots: int | None = None, prefetch_window: int | None = None,
              context: int | None = None, disk_bw: float | None = None,
              use_history: bool = True, vram: int | None = None, prompt_tokens: int | None = None,
              tokens: int | None = None, preload: bool = False, draft_acceptance: float | None = None) -> PlanReport:
    """The plan on ``bp.backend`` (its device memory decides the tiers), for a run of a
    ``prompt_tokens`` prompt and ``tokens`` generated tokens from empty caches (filled
    to their slots first with ``preload``). Left out, ``prompt_tokens`` and ``tokens``
    are the defaults cut to what the model's context holds; given, they must fit it."""
    from colibri_core.errors import UsageError
    from colibri_core.io.drives import Drive, measure_bandwidth

    limit = bp.lm.max_context
    if prompt_tokens is None:
        prompt_tokens = max(1, min(DEFAULT_PROMPT_TOKENS, limit // 4))
    if tokens is None:
        tokens = max(0, min(DEFAULT_TOKENS, limit - prompt_tokens))
    if context is not None and not 0 < context <= limit:
        raise UsageError(f"--context {context} is beyond the model's limit: its context holds 1 to {limit} tokens")
    if prompt_tokens < 1 or tokens < 0:
        raise UsageError(f"--prompt-tokens must be >= 1 and --tokens >= 0, got {prompt_tokens} and {tokens}")
    if prompt_tokens + tokens > limit:
        raise UsageError(f"--prompt-tokens {prompt_tokens} plus --tokens {tokens} is beyond the model's context of {limit} tokens")

    moe_layers, experts, top_k = len(bp.moe), bp.experts_per_layer, bp.top_k
    history = None
    if use_history and moe_layers:
        history = RoutingHistory.open(bp.model_dir, bp.family.spec.name, bp.config.get("model_type"), moe_layers, experts)
    policy = PinPolicy(mode=pin, share=pin_share)
    pinning = history is not None and (pin == "on" or (pin == "auto" and history.total_tokens >= policy.min_tokens))
    placement = bp.placement(ram=ram, cap=cap, pin_share=pin_share if pinning else 0.0,
                             prefetch_slots=bp.prefetch_slots(prefetch=prefetch, slots=prefetch_slots, window=prefetch_window),
                             vram=vram)
    scores = history.scores() if history is not None and history.total_tokens > 0 else None
    hot: list[tuple[int, int]] = []
    if scores is not None:
        flat = np.lexsort((np.arange(scores.size), -scores.ravel()))[: sum(t.pinned for t in placement.tiers)]
        hot = [divmod(int(i), experts) for i in flat if scores.flat[i] > 0]
    pinned_by_tier = []
    for tier in placement.tiers:  # the hottest in the fastest tier, the next ones in the next
        pinned_by_tier.append(hot[: tier.pinned])
        hot = hot[tier.pinned :]
    tier_specs = [(t.slots, p) for t, p in zip(placement.tiers, pinned_by_tier)]
    steady_rates = projected_hit_rates(scores, moe_layers, experts, tier_specs)
    steady = sum(steady_rates)
    run = simulate_run(scores, moe_layers, experts, top_k, tier_specs, prompt_tokens=prompt_tokens, tokens=tokens,
                       preload=preload)
    tier_rates, hit = run["tier_rates"], run["hit_rate"]
    pinned = [le for p in pinned_by_tier for le in p]

    if disk_bw is None:
        primary = Drive("primary", {sf.path: sf.path for sf in bp.checkpoint.files.values()})
        disk_bw = measure_bandwidth(primary)
        disk_source = "measured"
    else:
        disk_source = "given"

    timing = measure_expert_timing(bp) if moe_layers else None
    lookups = top_k * moe_layers
    misses = run["decode_misses_per_token"]  # per generated token, from empty caches
    missed_bytes = misses * bp.expert_disk_bytes
    host_form_s = timing.host_form_s if timing is not None else 0.0
    if disk_source == "given" or timing is None:  # a given bandwidth prices the bytes; the decode is measured
        miss_s = bp.expert_disk_bytes / disk_bw + host_form_s
    else:
        miss_s = timing.miss_s
    disk_s = misses * miss_s
    if timing is not None:
        compute_s = timing.compute_s(dense_bytes=bp.dense_bytes, expert_bytes=bp.expert_bytes,
                                     layers=len(bp.lm.layers), moe_layers=moe_layers)
    else:  # no experts to time: a one-token matrix product prices the dense weights
        compute_s = bp.dense_bytes * _dense_seconds_per_byte(bp.backend)
    costs = {"disk": disk_s, "compute": compute_s}
    device = placement.device
    if device is not None and not placement.unified:  # device misses cross the bus
        device_misses = run["decode_misses_per_token"] + lookups * sum(tier_rates[1:])
        costs["upload"] = device_misses * placement.expert_bytes / DEFAULT_UPLOAD_BW
    bottleneck = max(costs, key=costs.get)
    transfer_s = disk_s + costs.get("upload", 0.0)
    # prefetch overlaps disk with compute; without it they add up
    per_token = max(transfer_s, compute_s) if prefetch else transfer_s + compute_s
    steady_missed = max(0.0, 1 - steady) * lookups
    steady_s = steady_missed * miss_s
    steady_per_token = max(steady_s, compute_s) if prefetch else steady_s + compute_s
    drafts = None
    if timing is not None:
        drafts = draft_projection(dense_s=compute_s - moe_layers * timing.top_k_s, experts_s=moe_layers * timing.top_k_s,
                                  disk_s=steady_s, upload_s=costs.get("upload", 0.0), prefetch=prefetch,
                                  row_cost=timing.row_cost, experts=experts, top_k=top_k, acceptance=draft_acceptance)
    tiers = [{"role": t.role, "budget": t.budget, "budget_source": t.budget_source, "expert_bytes": t.expert_bytes,
              "slots_per_layer": t.slots, "pinned_capacity": t.pinned, "pinned_experts": len(p),
              "cache_bytes": t.cache_bytes(moe_layers), "projected_hit_rate": rate, "steady_hit_rate": steady_rate}
             for t, p, rate, steady_rate in zip(placement.tiers, pinned_by_tier, tier_rates, steady_rates)]
    tiers.append({"role": "disk", "projected_hit_rate": max(0.0, 1 - hit), "steady_hit_rate": max(0.0, 1 - steady),
                  "bytes_per_token": missed_bytes})

    context = context or limit
    kv_per_token = bp.kv_bytes_per_token()
    data = {
        "model_dir": str(bp.model_dir), "family": bp.family.spec.name, "model_type": bp.config.get("model_type"),
        "backend": bp.backend.name, "device_memory": bp.backend.device_memory(),
        "unified_memory": placement.unified, "dense_in": placement.dense_in,
        "dense_bytes": bp.dense_bytes, "dense_disk_bytes": bp.dense_disk_bytes,
        "kv_bytes_per_token": kv_per_token, "context_length": context, "kv_bytes_at_context": bp.kv_bytes_for(context),
        "moe_layers": moe_layers, "experts_per_layer": experts, "top_k": top_k,
        "expert_bytes": bp.expert_bytes, "expert_disk_bytes": bp.expert_disk_bytes,
        "experts_total_bytes": bp.expert_bytes * experts * moe_layers,
        "ram_budget": placement.budget, "ram_budget_source": placement.budget_source,
        "vram_budget": device.budget if device else None, "vram_budget_source": device.budget_source if device else None,
        "tiers": tiers,
        "cache_slots_per_layer": placement.slots, "pinned_experts": len(pinned), "pinned_capacity": placement.pinned,
        "prefetch_slots": placement.prefetch_slots,
        "all_resident": placement.all_resident,
        "history_tokens": history.total_tokens if history is not None else 0,
        "run_prompt_tokens": prompt_tokens, "run_tokens": tokens, "preload": preload,
        "projected_hit_rate": hit, "steady_hit_rate": steady, "missed_bytes_per_token": missed_bytes,
        "disk_bandwidth": disk_bw, "disk_bandwidth_source": disk_source,
        "expert_seconds": timing.one_expert_s if timing else None,
        "top_k_experts_seconds": timing.top_k_s if timing else None, "host_form_seconds_per_expert": host_form_s,
        "seconds_per_missed_expert": miss_s,
        "seconds_per_token": costs,
        "projected_decode_tok_s": 1 / per_token if per_token > 0 else None,
        "steady_decode_tok_s": 1 / steady_per_token if steady_per_token > 0 else None,
        "bottleneck": bottleneck,
        "row_cost": timing.row_cost if timing else None,
        "draft_projection": drafts,
        "recommended": recommend(bp, placement, hit, bottleneck, history, cap=cap, prefetch=prefetch),
    }
    return PlanReport(data, placement)


def _dense_seconds_per_byte(backend, repeats: int = 9) -> float:
    """Median seconds per weight byte of a one-token float32 matrix product on the backend."""
    w = backend.prepare_weight(np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32))
    x = backend.asarray(np.ones((1, 1024), dtype=np.float32))
    return _median_seconds(lambda: backend.to_host(backend.linear(x, w)), repeats) / (1024 * 1024 * 4)


def recommend(bp, placement, hit, bottleneck, history, *, cap, prefetch) -> list[str]:
    tips = []
    moe_layers, experts = len(bp.moe), bp.experts_per_layer
    if not moe_layers:
        return ["the model has no routed experts: everything is resident"]
    device = placement.device
    total = experts * moe_layers
    if device is not None and not placement.unified:
        on_device = device.expert_bytes * total
        if device.budget < on_device and on_device + bp.dense_bytes <= bp.backend.device_memory():
            tips.append(f"--vram {_gib(on_device)} would hold every expert in device memory")
        everything = placement.expert_bytes * total  # the dense weights are in device memory
    else:  # RAM holds the dense weights, and on unified memory the device tier's experts
        everything = bp.dense_bytes + (device.expert_bytes if device is not None else placement.expert_bytes) * total
    if placement.all_resident:
        tips.append("every expert fits the budget: add --preload to read them all before generating")
        return tips
    if placement.budget < everything:
        tips.append(f"--ram {_gib(everything)} would hold every expert (all resident)")
    if bottleneck == "disk":
        if not prefetch:
            tips.append("disk-bound: try --prefetch to read the next layer's experts while this one computes")
        tips.append("disk-bound: try --direct-io (O_DIRECT reads skip the page cache; on this project's reference "
                    "machine it raised decode speed by 40% in a 3 GiB cgroup)")
        tips.append("disk-bound: a mirror on a second drive (--mirror DIR) adds read bandwidth")
        if history is None or history.total_tokens < 64:
            tips.append("run some representative prompts first: the routing history lets colibri pin hot experts")
    if max(t.slots for t in placement.tiers) < bp.top_k:
        tips.append(f"the LRU holds {placement.slots} experts per layer, fewer than top-k ({bp.top_k}): most tokens will read from disk")
    return tips


def _gib(n: int) -> str:
    return f"{math.ceil(n / (1 << 30) * 10) / 10}G"

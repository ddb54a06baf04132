"""The expert store: serves each routed expert from the fastest tier holding it.

Lookup order: the device tier (a backend with device memory: prepared experts, pinned
then LRU), the RAM tier (host forms, pinned then LRU), experts prefetched for this
layer, and finally the disk (primary or mirror). The device tier is fed from RAM only: a
device miss takes the RAM tier's copy, or reads the disk into the RAM tier first, then
prepares it. Without a device tier the RAM tier holds what the backend computes with.
Family code asks for (layer, expert) and never knows where the weights came from;
placement changes speed only, never the numbers.

The store also keeps the routing history, chooses the pinned sets from it (the hottest
experts in the device tier, the next hottest in RAM; re-pinned live, with hysteresis),
and runs the prefetch I/O pool.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from colibri_core.errors import ColibriError
from colibri_core.io.drives import ReadStopped, stop_reads_when
from colibri_core.io.safetensors import TensorInfo
from colibri_core.experts.history import RoutingHistory
from colibri_core.experts.reads import ReadPool
from colibri_core.experts.tiers import CachedTier, DeviceTier, DiskTier, ExpertWeights, RamTier


def _demand_priority(layer: int) -> tuple:
    """A read the computation is waiting for: before every prefetch."""
    return (0, layer)


def _prefetch_priority(layer: int) -> tuple:
    """A predicted read: after every demand read, nearer layers first."""
    return (1, layer)


@dataclass
class StoreStats:
    hits_device: int = 0  # served by the device tier (pinned or LRU)
    hits_pinned: int = 0  # served by the RAM tier's pinned set
    hits_lru: int = 0  # served by the RAM tier's LRU
    hits_prefetched: int = 0  # lookups served by a prefetch: misses it saved
    misses: int = 0
    prefetch_issued: int = 0  # experts read ahead of use
    prefetch_unused: int = 0  # of those, read but not used by their layer
    prefetch_skipped: int = 0  # predicted reads not issued: recent ones did not pay, or the step ran without
    prefetch_steps_off: int = 0  # steps the prefetcher's measured gate ran without reading ahead
    predicted: int = 0  # predictions made (resident or not)
    predicted_used: int = 0  # predictions that the layer really used
    used: int = 0  # experts a layer really used (per forward pass, unique)
    # bytes (the matrices, not their scales) of the predicted reads, issued or not, that
    # their layer did not use: what reading ahead spends for nothing
    predicted_reads_unused_bytes: int = 0
    repins: int = 0
    # time the computing thread spent blocked on expert reads (demand misses, and
    # predicted reads not finished when their layer asked): what the disk cost the step
    read_wait_ns: int = 0

    @property
    def hits_ram(self) -> int:
        return self.hits_pinned + self.hits_lru

    @property
    def hits(self) -> int:
        return self.hits_device + self.hits_ram

    @property
    def lookups(self) -> int:
        return self.hits + self.hits_prefetched + self.misses

    def snapshot(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PinPolicy:
    """When and how the pinned hot set is chosen.

    mode: "auto" pins once the history holds ``min_tokens`` tokens, "on" always, "off" never.
    share: part of the expert budget given to pinned experts.
    Live re-pinning runs every ``interval`` generated tokens and swaps at most
    ``max_swaps`` experts, each only when the hot one's count beats the coldest pinned
    one's by ``margin`` (hysteresis: the set does not thrash).
    """

    mode: str = "auto"
    share: float = 0.5
    min_tokens: int = 64
    interval: int = 16
    max_swaps: int = 4
    margin: float = 1.25


@dataclass
class ExpertStore:
    # layouts[moe_layer][expert] -> role -> where that matrix lies on disk
    layouts: list[list[dict[str, TensorInfo]]]
    disk: DiskTier
    ram: RamTier
    history: RoutingHistory | None = None
    pin_policy: PinPolicy = field(default_factory=PinPolicy)
    io_workers: int = 3  # threads reading experts from disk (demand misses and prefetch)
    io_window: int = 8  # demand reads of one layer in flight at once (bounds transient memory)
    history_decay: float = 1.0
    # A predicted read pays when predictions of its rank (its place in the predicted list,
    # surest first) are mostly used: a wasted read costs disk time and a share of the two or
    # so cores that compute, a used one saves a wait, and on a disk the demand reads keep
    # busy it saves little. Each rank's would-be reads (predicted, not resident) are scored
    # whether issued or not (counts decayed by ``prefetch_memory`` each time that rank is
    # scored); a rank is read ahead only while at least ``prefetch_min_precision`` of its
    # scored reads were used. Steps of one row and of several (a prompt, a batch) keep
    # apart scores: a prompt's rows use most experts, so its predictions nearly all come
    # true, which says nothing of the next token's.
    prefetch_memory: float = 0.98
    prefetch_min_precision: float = 0.8
    save_history: bool = True
    device: DeviceTier | None = None  # prepared experts in the backend's memory, consulted first
    stats: StoreStats = field(default_factory=StoreStats)
    # a ComputeTier computing the routed experts elsewhere (the store serves its fallback)
    compute: object = None

    def __post_init__(self):
        # without a device tier, the RAM tier keeps what the backend computes with
        self._backend = None if self.device is not None else self.disk.backend
        self._staged: list[dict[int, Future]] = [{} for _ in self.layouts]  # prefetched (predicted)
        self._stops: list[dict[int, threading.Event]] = [{} for _ in self.layouts]  # set: give that read up
        self._demand: list[dict[int, Future]] = [{} for _ in self.layouts]  # misses being read
        self._queue: list[deque[int]] = [deque() for _ in self.layouts]  # misses waiting for the window
        self._predicted: list[set[int]] = [set() for _ in self.layouts]
        # this layer's predicted reads: expert -> (predicted for several rows, its rank; None:
        # known exactly, not scored by rank)
        self._would_read: list[dict[int, tuple[bool, int | None]]] = [{} for _ in self.layouts]
        # predicted reads waiting for a MoE layer's misses to be queued first:
        # {that layer: (the layer predicted, experts)}; one predictor per layer, so a newer
        # prediction replaces one a failed forward pass left behind
        self._held: dict[int, tuple[int, list[int]]] = {}
        # for steps of one row / several, by rank: decayed counts of predicted reads the
        # layer used / did not use. A rank starts at 0 / 1, as if one read had gone unused,
        # so it is read ahead only once its predictions have come true about four times
        # running: a first step's guesses, and a weak rank's lucky streak, cost no reads.
        self._rank_used: dict[bool, list[float]] = {False: [], True: []}
        self._rank_unused: dict[bool, list[float]] = {False: [], True: []}
        self._pool = ReadPool(self.io_workers) if self.io_workers else None
        self._tokens_since_repin = 0

    # -- serving -----------------------------------------------------------------------
    def get(self, layer: int, expert: int) -> ExpertWeights:
        device = self.device
        if device is None:
            return self._get_ram(layer, expert)
        weights = device.pinned(layer, expert)
        if weights is None:
            weights = device.get(layer, expert)
        if weights is not None:
            self.stats.hits_device += 1
            return weights
        return device.put(layer, expert, self._get_ram(layer, expert))

    def _read(self, layer: int, expert: int) -> ExpertWeights:
        """An expert from disk, in the form the RAM tier keeps (runs on the I/O pool)."""
        weights = self.disk.load(layer, expert, self.layouts[layer][expert])
        return weights if self._backend is None else weights.prepared(self._backend)

    def _resident(self, layer: int, expert: int) -> bool:
        return self.ram.holds(layer, expert) or (self.device is not None and self.device.holds(layer, expert))

    def _get_ram(self, layer: int, expert: int) -> ExpertWeights:
        weights = self.ram.pinned(layer, expert)
        if weights is not None:
            self.stats.hits_pinned += 1
            return weights
        weights = self.ram.get(layer, expert)
        if weights is not None:
            self.stats.hits_lru += 1
            return weights
        future = self._staged[layer].pop(expert, None)
        if future is not None:
            self.ram.return_slot(layer)  # the expert takes its place in the cache (put, below)
            weights = self._settled(future, layer, expert)
            self.stats.hits_prefetched += 1
        else:
            self.stats.misses += 1
            future = self._demand[layer].pop(expert, None)
            if future is not None:  # already being read, with the layer's other misses
                weights = self._settled(future, layer, expert)
                self._fill(layer)
            else:
                started = time.perf_counter_ns()
                weights = self._read(layer, expert)
                self.stats.read_wait_ns += time.perf_counter_ns() - started
        self.ram.put(layer, expert, weights)
        return weights

    def _wait(self, future: Future) -> ExpertWeights:
        if future.done():
            return future.result()
        started = time.perf_counter_ns()
        try:
            return future.result()
        finally:
            self.stats.read_wait_ns += time.perf_counter_ns() - started

    def _settled(self, future: Future, layer: int, expert: int) -> ExpertWeights:
        """What a read started earlier gave; where it failed, the expert read again now. A
        forward pass that fails midway leaves its layer's reads behind (failed, or stopped
        reads ahead): their failure must not fail a later pass, once the file reads again."""
        try:
            return self._wait(future)
        except (OSError, ColibriError, ReadStopped):
            return self._read(layer, expert)

    def ready(self, layer: int, expert: int) -> bool:
        """Whether ``get`` would answer without waiting for a read."""
        if self._resident(layer, expert):
            return True
        future = self._staged[layer].get(expert) or self._demand[layer].get(expert)
        return future is not None and future.done()

    def request(self, layer: int, experts) -> bool:
        """A layer is about to use these experts (ascending): start reading the ones not
        resident, up to ``io_window`` at a time, so their reads overlap each other and the
        computation of the experts already at hand. Returns whether all of them are at
        hand already (no read to wait for). Predicted reads for this layer that it does
        not use are given up now, not when the layer ends: those not started are
        cancelled (a worker would otherwise spend the layer's computation reading them),
        and those running stop at their next ``STOP_CHUNK`` (``io/drives.py``)."""
        at_hand = True
        queue, staged = self._queue[layer], self._staged[layer]
        wanted = set()
        for e in experts:
            e = int(e)
            wanted.add(e)
            if self._resident(layer, e):
                continue
            at_hand = False
            if e in staged:  # predicted right: if its read has not started, it goes first now
                self._pool.hurry(staged[e], _demand_priority(layer))
            elif self._pool is not None and e not in self._demand[layer]:
                queue.append(e)
        for e in [e for e in staged if e not in wanted]:
            if staged[e].cancel():
                del staged[e]
                self.ram.return_slot(layer)
            else:  # running: it stops at its next chunk (DiskTier reads; a plugin's may finish)
                self._stops[layer][e].set()
        if self._pool is not None:
            self._fill(layer)
        self._release(layer)
        return at_hand

    def _fill(self, layer: int) -> None:
        queue, demand = self._queue[layer], self._demand[layer]
        while queue and len(demand) < self.io_window:
            e = queue.popleft()
            demand[e] = self._pool.submit(_demand_priority(layer), self._read, layer, e)

    def end_layer(self, layer: int, indices: np.ndarray, experts: np.ndarray) -> None:
        """A MoE layer finished a forward pass with this routing (``experts``: its unique
        expert ids): count it, score the prediction made for it, and drop what was
        prefetched for it but not used."""
        self._release(layer)  # (a layer computed by a compute tier asks for nothing)
        used = set(experts.tolist())
        if self.history is not None and layer < self.history.shape[0]:  # (MTP layers are not in it)
            self.history.record(layer, indices)
        predicted = self._predicted[layer]
        if predicted:
            self.stats.predicted += len(predicted)
            self.stats.predicted_used += len(predicted & used)
            self.stats.used += len(used)
        self._predicted[layer] = set()
        would = self._would_read[layer]
        if would:
            keep = self.prefetch_memory
            for e, (several, rank) in would.items():
                if rank is None:
                    continue
                used_by_rank, unused_by_rank = self._rank_used[several], self._rank_unused[several]
                while len(used_by_rank) <= rank:
                    used_by_rank.append(0.0)
                    unused_by_rank.append(1.0)
                hit = e in used
                used_by_rank[rank] = used_by_rank[rank] * keep + hit
                unused_by_rank[rank] = unused_by_rank[rank] * keep + (not hit)
            self.stats.predicted_reads_unused_bytes += sum(
                info.nbytes for e in would.keys() - used for info in self.layouts[layer][e].values())
            self._would_read[layer] = {}
        for future in self._staged[layer].values():
            self.ram.return_slot(layer)
            if not future.cancel():  # already read (or reading): wasted I/O
                self.stats.prefetch_unused += 1
        self._staged[layer] = {}
        self._stops[layer] = {}
        for future in self._demand[layer].values():  # only left when a computation failed midway
            future.cancel()
        self._demand[layer] = {}
        self._queue[layer].clear()

    # -- prefetch ----------------------------------------------------------------------
    def prefetch_pays(self, rank: int, several: bool = False) -> bool:
        """Whether recent predicted reads of this rank (0: the surest), for steps of one row
        or of ``several``, were used often enough to issue more."""
        if self.prefetch_min_precision <= 0:
            return True
        if rank >= len(self._rank_used[several]):
            return False  # not scored yet
        used = self._rank_used[several][rank]
        return used >= self.prefetch_min_precision * (used + self._rank_unused[several][rank])

    def prefetch_precision_by_rank(self, several: bool = False) -> list[float]:
        """The decayed share of each rank's scored predicted reads that were used."""
        return [u / (u + n) for u, n in zip(self._rank_used[several], self._rank_unused[several])]

    def prefetch(self, layer: int, experts: list[int], behind: int | None = None, issue: bool = True,
                 several: bool = False, exact: bool = False) -> None:
        """Start reading experts predicted for ``layer`` (surest first) on the I/O pool:
        those whose rank pays (``prefetch_pays``), when ``issue`` asks for reads (the
        prefetcher's measured gate); the prediction is scored either way. ``behind``: the
        MoE layer now running, whose misses are not known yet: the reads wait until that
        layer's ``request`` has queued them (a read already started cannot give way).
        ``several``: the step has several rows (a prompt, a batch). ``exact``: the experts
        are known, not predicted (a layer routed by token id): all are read, unranked."""
        self._predicted[layer] = set(experts)
        staged = self._staged[layer]
        ranked_reads = [(rank, e) for rank, e in enumerate(experts) if e not in staged and not self._resident(layer, e)]
        would = self._would_read[layer]
        for rank, e in ranked_reads:  # layers between two MoE layers each predict the next one
            before = would.get(e, (several, rank))[1]
            would[e] = (several, None if exact else min(rank, rank if before is None else before))
        reads = [e for rank, e in ranked_reads if issue and (exact or self.prefetch_pays(rank, several))]
        self.stats.prefetch_skipped += len(ranked_reads) - len(reads)
        if behind is not None:
            self._held[behind] = (layer, reads)
            return
        self._submit_prefetch(layer, reads)

    def _submit_prefetch(self, layer: int, reads: list[int]) -> None:
        """Read ahead: each read takes a slot of its layer's cache while it is staged
        (``CachedTier.lend_slot``: the cache evicts an expert the prediction does not name,
        if full), so reading ahead costs the cache only while its reads are staged, and
        the RAM budget holds as without it."""
        staged = self._staged[layer]
        for i, e in enumerate(reads):
            if e in staged or self._resident(layer, e):
                continue
            if not self.ram.lend_slot(layer, keep=self._predicted[layer]):
                self.stats.prefetch_skipped += len(reads) - i
                break
            stop = self._stops[layer][e] = threading.Event()
            staged[e] = self._pool.submit(_prefetch_priority(layer), self._read_ahead, layer, e, stop)
            self.stats.prefetch_issued += 1

    def _read_ahead(self, layer: int, expert: int, stop: threading.Event) -> ExpertWeights:
        """A predicted read: given up midway (``ReadStopped``) once ``stop`` is set."""
        with stop_reads_when(stop.is_set):
            return self._read(layer, expert)

    def _release(self, layer: int) -> None:
        """Issue the predicted reads held until ``layer``'s misses were queued."""
        held = self._held.pop(layer, None)
        if held is not None:
            self._submit_prefetch(*held)

    # -- pinning -----------------------------------------------------------------------
    def _pin_tiers(self) -> list[CachedTier]:
        """The tiers with a pinned set, fastest first: the hottest experts go to the first."""
        return [t for t in (self.device, self.ram) if t is not None and t.pinned_capacity > 0]

    @property
    def pinned_capacity(self) -> int:
        """Experts (across all layers) the pinned sets of all tiers may hold."""
        return sum(t.pinned_capacity for t in self._pin_tiers())

    def pins_wanted(self) -> bool:
        if self.pinned_capacity <= 0 or self.history is None or self.pin_policy.mode == "off":
            return False
        return self.pin_policy.mode == "on" or self.history.total_tokens >= self.pin_policy.min_tokens

    def hottest(self, n: int) -> list[tuple[int, int]]:
        """The n (layer, expert) pairs with the highest counts (ties: lower ids first)."""
        scores = self.history.scores()
        flat = np.lexsort((np.arange(scores.size), -scores.ravel()))[:n]
        return [divmod(int(i), scores.shape[1]) for i in flat if scores.flat[i] > 0]

    def apply_pins(self, progress=None) -> None:
        """Pin the hottest experts up to each tier's pinned capacity, the hottest in the
        fastest tier (reading them from disk)."""
        if not self.pins_wanted():
            return
        hot = self.hottest(self.pinned_capacity)
        for tier in self._pin_tiers():
            chosen, hot = hot[: tier.pinned_capacity], hot[tier.pinned_capacity :]
            for layer, expert in chosen:
                self._pin(tier, layer, expert)
                if progress:
                    progress()

    def _pin(self, tier: CachedTier, layer: int, expert: int) -> None:
        # through the RAM tier, as every expert reaching the device tier
        weights = self.ram.lookup(layer, expert)
        if weights is None:
            weights = self._read(layer, expert)
            if tier is not self.ram:
                self.ram.put(layer, expert, weights)
        tier.pin(layer, expert, weights)

    def after_tokens(self, n: int) -> None:
        """Called by the generation loop: count tokens, and re-pin at intervals."""
        if self.history is not None:
            self.history.record_tokens(n)
        self._tokens_since_repin += n
        if self._tokens_since_repin >= self.pin_policy.interval and self.pins_wanted():
            self._tokens_since_repin = 0
            self.repin()

    def repin(self) -> int:
        """Swap cold pinned experts for hotter unpinned ones, a few at a time, tier by
        tier (fastest first; an expert pinned in a faster tier leaves the slower ones)."""
        swaps = 0
        faster: set[tuple[int, int]] = set()
        for tier in self._pin_tiers():
            swaps += self._repin_tier(tier, faster, self.pin_policy.max_swaps - swaps)
            faster |= tier.pinned_set()
        self.stats.repins += swaps
        return swaps

    def _repin_tier(self, tier: CachedTier, faster: set[tuple[int, int]], max_swaps: int) -> int:
        policy, scores = self.pin_policy, self.history.scores()
        for le in tier.pinned_set() & faster:
            tier.unpin(*le)
        pinned = tier.pinned_set()
        free = tier.pinned_capacity - len(pinned)
        swaps = 0
        for layer, expert in self.hottest(len(faster) + tier.pinned_capacity + policy.max_swaps):
            if swaps >= max_swaps:
                break
            if (layer, expert) in pinned or (layer, expert) in faster:
                continue
            if free > 0:
                free -= 1
            else:
                coldest = min(pinned, key=lambda le: (scores[le], le))
                if scores[layer, expert] <= policy.margin * scores[coldest]:
                    break
                tier.unpin(*coldest)
                pinned.discard(coldest)
            self._pin(tier, layer, expert)
            pinned.add((layer, expert))
            swaps += 1
        return swaps

    # -- state -------------------------------------------------------------------------
    # expert_map's codes, one character per expert: where it is served from now
    TIER_CODES = {"D": "device_pinned", "d": "device_lru", "R": "ram_pinned", "r": "ram_lru", ".": "disk"}

    def expert_map(self) -> dict:
        """Where each routed expert is now and how often it was routed, in plain lists,
        for a monitor polling from another thread (as ``Model.store_counters`` is read).

        ``tiers``: one string per MoE layer, one character per expert (``TIER_CODES``: D
        device pinned, d device LRU, R RAM pinned, r RAM LRU, ``.`` on disk only); an
        expert held by both tiers shows the device, the one consulted first. ``heat``:
        per layer, per expert, how many times the router chose it since the model was
        loaded (None without a routing history). ``counts``: experts per code.

        Read without a lock: each tier's table of a layer is copied in one step (``list``
        of a dict holds the GIL), so none is seen half-changed; the engine thread may move
        an expert between two copies, so the map can be a step stale, never malformed.
        Cost: one pass over the experts (75 layers x 256 experts: a few milliseconds)."""
        tiers = []
        for layer, experts in enumerate(self.layouts):
            row = np.full(len(experts), ord("."), dtype=np.uint8)
            for tier, (pinned, lru) in ((self.ram, b"Rr"), (self.device, b"Dd")):
                if tier is not None:
                    row[tier.cached(layer)] = lru
                    row[tier.pinned_experts(layer)] = pinned
            tiers.append(row.tobytes().decode("ascii"))
        heat = None
        if self.history is not None:
            heat = np.rint(self.history.session).astype(np.int64).tolist()
        counts = {name: sum(row.count(code) for row in tiers) for code, name in self.TIER_CODES.items()}
        device = self.device
        capacity = {"device_lru_per_layer": device.slots if device is not None else 0,
                    "device_pinned": device.pinned_capacity if device is not None else 0,
                    "ram_lru_per_layer": self.ram.slots, "ram_pinned": self.ram.pinned_capacity}
        return {"layers": len(self.layouts), "experts": max((len(x) for x in self.layouts), default=0),
                "tiers": tiers, "heat": heat, "counts": counts, "capacity": capacity}

    @property
    def resident_bytes(self) -> int:
        """Bytes of experts held, RAM and device tiers together."""
        return self.ram.resident_bytes + self.device_resident_bytes

    @property
    def device_resident_bytes(self) -> int:
        """Bytes of experts held in the device tier."""
        return self.device.resident_bytes if self.device is not None else 0

    def close(self) -> None:
        if self.compute is not None:
            self.compute.close()
            self.compute = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.history is not None and self.save_history:
            self.history.save(self.history_decay)
        self.disk.close()

    def warm(self, progress=None) -> None:
        """Fill the LRUs up to their slots (lowest expert ids first; through RAM to the
        device tier)."""
        for layer, experts in enumerate(self.layouts):
            for expert in range(min(self.warm_slots, len(experts))):
                weights = self.ram.lookup(layer, expert)
                if weights is None:
                    weights = self._read(layer, expert)
                    self.ram.put(layer, expert, weights)
                if self.device is not None and expert < self.device.slots:
                    self.device.put(layer, expert, weights)
                if progress:
                    progress()

    @property
    def warm_slots(self) -> int:
        """Experts per layer ``warm`` reads."""
        return max(self.ram.slots, self.device.slots if self.device is not None else 0)

"""Storage tiers that serve expert weights.

- ``DiskTier``: the model's shards on one or more drives (the primary and mirrors); it
  yields experts in their host form.
- ``RamTier``: experts in host memory: a pinned hot set plus a per-layer LRU.
- ``DeviceTier``: experts prepared in a backend's own memory (VRAM), the same two parts;
  fed from the RAM tier. A backend may bring its own subclass (``Backend.device_tier``).

The store composes them; family code asks for (layer, expert) and never knows which
tier answered.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from colibri_core.errors import ColibriError
from colibri_core.formats.base import permute_rows
from colibri_core.io.safetensors import TensorInfo, as_array
from colibri_core.warn import warn
from colibri_core.io.checkpoint import merge_ranges
from colibri_core.io.drives import Drive, choose_drive
from colibri_core.io.integrity import IntegrityError


@dataclass
class ExpertWeights:
    """One expert's matrices by role ("gate", "up", "down"): host forms (float32 numpy
    arrays or packed ``QuantTensor``) from the disk tier, or a backend's prepared forms."""

    arrays: dict
    nbytes: int
    derived: dict = field(default_factory=dict)  # what a backend derives once per expert (e.g. kernel arguments)

    def __getitem__(self, role: str):
        return self.arrays[role]

    def prepared(self, backend) -> "ExpertWeights":
        """The matrices as ``backend.prepare_weight`` makes them; itself when preparing
        changes nothing (the CPU computes with host forms), so what was derived stays."""
        # biases (``*_bias``: gpt-oss's experts) are added as arrays, never multiplied
        arrays = {role: backend.prepare_weight(a, "array" if role.endswith("_bias") else "linear")
                  for role, a in self.arrays.items()}
        if all(arrays[role] is a for role, a in self.arrays.items()):
            return self
        return ExpertWeights(arrays, sum(backend.nbytes(a) for a in arrays.values()))


class DiskTier:
    """Reads an expert's matrices (and their formats' companion tensors) with as few
    positioned reads as possible from the drive the expert is assigned to, and returns
    them in their host form (``FormatResolver.host_form``: packed when the backend keeps
    the kind, else float32), never prepared for the backend. A failing mirror (a read
    error, or bytes that differ from the integrity manifest) is disabled with one
    warning; the primary serves. Bytes on the primary that differ from the manifest
    (checked with ``--verify``) are served by a mirror holding the shard, with one
    warning; without one they are an IntegrityError."""

    name = "disk"

    def __init__(self, drives: list[Drive], resolver, backend):
        self.primary = drives[0]
        self.drives = drives
        self.resolver = resolver
        self.backend = backend
        self.seconds = 0.0
        self.loads = 0  # experts read
        self._lock = threading.Lock()
        self._in_flight, self._busy_since, self._busy_ns = 0, 0, 0  # see busy_ns
        self._warned_primary = False

    @property
    def bytes_read(self) -> int:
        return sum(d.bytes_read for d in self.drives)

    @property
    def reads(self) -> int:
        return sum(d.reads for d in self.drives)

    def busy_ns(self) -> int:
        """Nanoseconds so far in which at least one read was in flight: the time the disk
        worked for colibri (overlapping reads count once; turning bytes into host forms
        does not count). A step's time less this is what reading ahead could still use."""
        with self._lock:
            return self._busy_ns + (time.perf_counter_ns() - self._busy_since if self._in_flight else 0)

    def _reading(self, started: bool) -> None:
        with self._lock:
            if started:
                if not self._in_flight:
                    self._busy_since = time.perf_counter_ns()
                self._in_flight += 1
            else:
                self._in_flight -= 1
                if not self._in_flight:
                    self._busy_ns += time.perf_counter_ns() - self._busy_since

    def drive_for(self, layer: int, expert: int, infos: list[TensorInfo]) -> Drive:
        candidates = [d for d in self.drives if all(d.has(t.path) for t in infos)]
        if len(candidates) <= 1:
            return self.primary
        return choose_drive(f"{layer}:{expert}", candidates)

    def load(self, layer: int, expert: int, matrices: dict[str, TensorInfo]) -> ExpertWeights:
        started = time.perf_counter()
        infos = list(matrices.values())
        wanted = self.resolver.with_companions(infos)
        self._reading(True)
        try:
            raw = self._read_somewhere(self.drive_for(layer, expert, wanted), wanted)
        finally:
            self._reading(False)
        typed = {t.name: as_array(t, raw[t.name]) for t in wanted}
        arrays = {}
        for role, info in matrices.items():
            companions = {t.name: typed[t.name] for t in self.resolver.companions(info)}
            # roles an expert declaration reads otherwise (biases, transformed layouts): ExpertMatrices.forms
            use, transform = getattr(matrices, "forms", {}).get(role, ("linear", None))
            host = self.resolver.host_form(info, typed[info.name], companions, self.backend, use)
            host = host if transform is None else np.ascontiguousarray(transform(host), dtype=np.float32)
            order = getattr(matrices, "row_orders", {}).get(role)
            if order is not None:  # e.g. interleaved gate/up rows, once per read rather than per step
                moved = permute_rows(host, order)
                if moved is None:  # a packed kind whose scales span rows: reordered as float32
                    moved = permute_rows(self.resolver.format_for(info).decode(info, typed[info.name], companions), order)
                host = moved
            arrays[role] = host
        with self._lock:
            self.seconds += time.perf_counter() - started
            self.loads += 1
        return ExpertWeights(arrays, sum(int(a.nbytes) for a in arrays.values()))

    def _read_somewhere(self, drive: Drive, wanted: list[TensorInfo]):
        """Read from ``drive``; on a failure, from the primary, then from any other drive
        holding every shard wanted."""
        tried = []
        while True:
            try:
                return self._read(drive, wanted)
            except (OSError, ColibriError) as exc:
                tried.append(drive)
                if drive is not self.primary:
                    self._disable(drive, exc)
                elif not isinstance(exc, IntegrityError):
                    raise
                others = [d for d in self.drives if d not in tried and all(d.has(t.path) for t in wanted)]
                if self.primary not in tried:
                    drive = self.primary
                elif others:
                    self._primary_mismatch(exc, others[0])
                    drive = others[0]
                else:
                    raise

    def _primary_mismatch(self, exc: Exception, other: Drive) -> None:
        with self._lock:
            if not self._warned_primary:
                self._warned_primary = True
                warn(f"{exc}; served by mirror {other.name} (and so on for other such reads)")

    @staticmethod
    def _read(drive: Drive, infos: list[TensorInfo]):
        raw = {}
        for group in merge_ranges(infos):
            raw.update(drive.read(group))
        return raw

    def _disable(self, drive: Drive, exc: Exception) -> None:
        with self._lock:
            if drive.failed is None:
                drive.failed = str(exc)
                warn(f"mirror {drive.name} failed ({exc}); reading from the primary from now on")

    def close(self) -> None:
        for drive in self.drives:
            drive.close()


class CachedTier:
    """A resident tier: a pinned hot set that is never evicted, plus a least-recently-used
    cache of at most ``slots`` experts per layer. ``hold`` turns the host weights handed
    to the tier into what it keeps (the RAM tier keeps them as they are). A layer's slots
    may be lent to reads ahead for it (``lend_slot``): the cache keeps that many fewer
    experts of the layer until each is given back (``return_slot``)."""

    name = "cached"

    def __init__(self, n_layers: int, slots: int, pinned_capacity: int = 0):
        self.slots = slots
        self.pinned_capacity = pinned_capacity  # experts the pinned set may hold, across all layers
        self._lru: list[OrderedDict[int, ExpertWeights]] = [OrderedDict() for _ in range(n_layers)]
        self._pinned: list[dict[int, ExpertWeights]] = [{} for _ in range(n_layers)]
        self._lent: list[int] = [0] * n_layers  # slots of each layer lent to reads ahead
        self.resident_bytes = 0
        self.pinned_bytes = 0
        self.evictions = 0

    def hold(self, weights: ExpertWeights) -> ExpertWeights:
        return weights

    # -- pinned set --------------------------------------------------------------------
    def pinned(self, layer: int, expert: int) -> ExpertWeights | None:
        return self._pinned[layer].get(expert)

    def pin(self, layer: int, expert: int, weights: ExpertWeights) -> None:
        if expert in self._pinned[layer]:
            return
        held = self._lru[layer].pop(expert, None)  # an LRU copy moves to the pinned set
        if held is not None:
            self.resident_bytes -= held.nbytes
        else:
            held = self.hold(weights)
        self._pinned[layer][expert] = held
        self.resident_bytes += held.nbytes
        self.pinned_bytes += held.nbytes

    def unpin(self, layer: int, expert: int) -> None:
        weights = self._pinned[layer].pop(expert, None)
        if weights is not None:
            self.resident_bytes -= weights.nbytes
            self.pinned_bytes -= weights.nbytes

    def pinned_set(self) -> set[tuple[int, int]]:
        return {(layer, e) for layer, table in enumerate(self._pinned) for e in table}

    def pinned_experts(self, layer: int) -> list[int]:
        """The experts of ``layer`` in the pinned set (one copy, safe to take from
        another thread: ``list`` of a dict is one step under the GIL)."""
        return list(self._pinned[layer])

    # -- LRU ---------------------------------------------------------------------------
    def get(self, layer: int, expert: int) -> ExpertWeights | None:
        cache = self._lru[layer]
        weights = cache.get(expert)
        if weights is not None:
            cache.move_to_end(expert)
        return weights

    def lookup(self, layer: int, expert: int) -> ExpertWeights | None:
        """The expert if held (pinned or LRU), without counting a use."""
        weights = self._pinned[layer].get(expert)
        return weights if weights is not None else self._lru[layer].get(expert)

    def put(self, layer: int, expert: int, weights: ExpertWeights) -> ExpertWeights:
        """Offer an expert just used: kept in the LRU when it has slots. Returns the
        tier's form of it (the held one, or a transient one when nothing is kept)."""
        held = self.lookup(layer, expert)
        if held is not None:
            return held
        held = self.hold(weights)
        room = self.slots - self._lent[layer]
        if room <= 0:
            return held
        cache = self._lru[layer]
        self._evict_down_to(cache, room - 1)
        cache[expert] = held
        self.resident_bytes += held.nbytes
        return held

    def holds(self, layer: int, expert: int) -> bool:
        return expert in self._pinned[layer] or expert in self._lru[layer]

    def resize(self, slots: int) -> None:
        """Set the LRU slots per layer; a smaller count evicts each layer's least recently
        used experts down to it at once (their memory is free on return)."""
        self.slots = slots
        for cache, lent in zip(self._lru, self._lent):
            self._evict_down_to(cache, max(slots - lent, 0))

    def lend_slot(self, layer: int, keep=()) -> bool:
        """Take one of ``layer``'s slots for an expert read ahead (its memory comes out of
        the budget the cache had): the layer's least recently used expert not in ``keep``
        is evicted if the slots left are full. False, lending nothing, when the slots are
        all lent already or every expert left to evict is in ``keep``."""
        cache, room = self._lru[layer], self.slots - self._lent[layer] - 1
        # the slots left hold at least the cached experts that may not go (``keep``, a
        # prediction, is small; the cache may not be: count over ``keep``)
        if room < 0 or sum(1 for e in keep if e in cache) > room:
            return False
        self._lent[layer] += 1
        self._evict_down_to(cache, room, keep)
        return True

    def return_slot(self, layer: int) -> None:
        """A read ahead for ``layer`` was used (the cache may now keep it) or given up."""
        self._lent[layer] = max(0, self._lent[layer] - 1)

    def lent_slots(self, layer: int) -> int:
        return self._lent[layer]

    def _evict_down_to(self, cache: OrderedDict, size: int, keep=()) -> None:
        while len(cache) > size:
            old_expert = next(e for e in cache if e not in keep) if keep else next(iter(cache))
            old = cache.pop(old_expert)
            self.resident_bytes -= old.nbytes
            self.evictions += 1

    def cached(self, layer: int) -> list[int]:
        return list(self._lru[layer])


class RamTier(CachedTier):
    """Experts in host memory (``--ram``), as the disk tier yields them. On a backend
    without device memory they are the prepared forms the backend computes with (the
    store prepares them once, as they arrive from disk)."""

    name = "ram"


class DeviceTier(CachedTier):
    """Experts prepared in the backend's own memory (``--vram``): ``backend.prepare_weight``
    of each matrix, made when the expert arrives from the RAM tier. The store consults it
    before RAM. It changes where the weights live, never their values. A backend may
    subclass it (``Backend.device_tier``) to manage its memory its own way."""

    name = "device"

    def __init__(self, n_layers: int, slots: int, backend, pinned_capacity: int = 0):
        super().__init__(n_layers, slots, pinned_capacity)
        self.backend = backend

    def hold(self, weights: ExpertWeights) -> ExpertWeights:
        return weights.prepared(self.backend)


class ComputeTier:
    """Computes a MoE layer's routed experts instead of the backend: a tier of role
    "compute" (``TierSpec(..., role="compute")``), chosen by name with
    ``load(compute=NAME, compute_options={...})`` (a plugin's ``LoadOptions`` turns its
    command-line options into those). The store still serves every expert locally
    (``fetch``), for the tier to fall back on.

    The promise of placement holds here too: the output must be bit for bit what
    ``ops.routed_experts`` / ``ops.routed_glu_experts`` gives: each expert's rows
    computed by the same backend operation on the same rows, the weighted outputs added
    with ``ops.add_rows`` into zeros in ascending expert order (``routed_output``)."""

    name = "compute"

    @classmethod
    def open(cls, model_dir, blueprint, backend, store, options: dict) -> "ComputeTier":
        """The tier for a model being loaded (``store``: its local expert store);
        ``options`` are ``load``'s ``compute_options``. A bad option is a UsageError
        naming it."""
        raise NotImplementedError

    def routed_experts(self, decl, x, indices: np.ndarray, weights: np.ndarray, ops, fetch) -> object:
        """The layer's output for ``x`` (T, hidden) routed by ``indices`` / ``weights``
        (host (T, k)); ``decl`` is the layer's ``ExpertDecl`` (``moe_index``, ``glu``,
        ``activation``, ``interleaved``), ``ops`` the step's operations (a
        ``RowInvariantOps`` in a batched decode step), ``fetch(e)`` the local store's
        expert e."""
        raise NotImplementedError

    def counters(self) -> dict:
        """Cumulative counters (ints, or dicts of ints by worker) for the statistics;
        a generation reports their differences as ``GenerationStats.compute``."""
        return {}

    def close(self) -> None:
        pass


def routed_output(ops, x, groups, outputs):
    """The routed experts' sum as ``Backend.routed_experts`` forms it: zeros, then each
    expert's output (``outputs[e]``: a host (rows, hidden) float32 array) times its
    weights added to its rows, in ascending expert order. ``groups`` are
    ``expert_groups(indices, weights)``."""
    out = ops.zeros(tuple(x.shape), ops.activation_dtype)
    for e, rows, scale in groups:
        out = ops.add_rows(out, rows, ops.asarray(outputs[e], ops.activation_dtype), scale)
    return out

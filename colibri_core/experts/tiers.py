"""Storage tiers that serve expert weights.

- ``DiskTier``: the model's shards on one or more drives (the primary and mirrors).
- ``RamTier``: decoded experts in memory: a pinned hot set plus a per-layer LRU.
- ``DeviceTier``: the contract a GPU backend fills to keep experts in its own memory.

The store composes them; family code asks for (layer, expert) and never knows which
tier answered.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from colibri_core.errors import ColibriError
from colibri_core.io.safetensors import TensorInfo, as_array
from colibri_core.warn import warn
from colibri_core.io.checkpoint import merge_ranges
from colibri_core.io.drives import Drive, choose_drive


@dataclass
class ExpertWeights:
    """One expert's matrices on the compute backend, by role ("gate", "up", "down")."""

    arrays: dict
    nbytes: int
    derived: dict = field(default_factory=dict)  # what a backend derives once per expert (e.g. kernel arguments)

    def __getitem__(self, role: str):
        return self.arrays[role]


class DiskTier:
    """Reads an expert's matrices (and their formats' companion tensors) with as few
    positioned reads as possible from the drive the expert is assigned to, then decodes
    and uploads them. A failing mirror is disabled with one warning; the primary serves."""

    name = "disk"

    def __init__(self, drives: list[Drive], resolver, backend):
        self.primary = drives[0]
        self.drives = drives
        self.resolver = resolver
        self.backend = backend
        self.seconds = 0.0
        self._lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        return sum(d.bytes_read for d in self.drives)

    @property
    def reads(self) -> int:
        return sum(d.reads for d in self.drives)

    def drive_for(self, layer: int, expert: int, infos: list[TensorInfo]) -> Drive:
        candidates = [d for d in self.drives if all(d.has(t.path) for t in infos)]
        if len(candidates) <= 1:
            return self.primary
        return choose_drive(f"{layer}:{expert}", candidates)

    def load(self, layer: int, expert: int, matrices: dict[str, TensorInfo]) -> ExpertWeights:
        started = time.perf_counter()
        infos = list(matrices.values())
        wanted = self.resolver.with_companions(infos)
        drive = self.drive_for(layer, expert, wanted)
        try:
            raw = self._read(drive, wanted)
        except (OSError, ColibriError) as exc:
            if drive is self.primary:
                raise
            self._disable(drive, exc)
            raw = self._read(self.primary, wanted)
        typed = {t.name: as_array(t, raw[t.name]) for t in wanted}
        arrays = {}
        for role, info in matrices.items():
            companions = {t.name: typed[t.name] for t in self.resolver.companions(info)}
            arrays[role] = self.resolver.resident(info, typed[info.name], companions, self.backend, "linear")
        with self._lock:
            self.seconds += time.perf_counter() - started
        return ExpertWeights(arrays, sum(self.backend.nbytes(a) for a in arrays.values()))

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


class RamTier:
    """Decoded experts in RAM: a pinned hot set that is never evicted, plus a
    least-recently-used cache of at most ``slots`` experts per layer."""

    name = "ram"

    def __init__(self, n_layers: int, slots: int):
        self.slots = slots
        self._lru: list[OrderedDict[int, ExpertWeights]] = [OrderedDict() for _ in range(n_layers)]
        self._pinned: list[dict[int, ExpertWeights]] = [{} for _ in range(n_layers)]
        self.resident_bytes = 0
        self.pinned_bytes = 0
        self.evictions = 0

    # -- pinned set --------------------------------------------------------------------
    def pinned(self, layer: int, expert: int) -> ExpertWeights | None:
        return self._pinned[layer].get(expert)

    def pin(self, layer: int, expert: int, weights: ExpertWeights) -> None:
        if expert in self._pinned[layer]:
            return
        old = self._lru[layer].pop(expert, None)  # an LRU copy moves to the pinned set
        if old is not None:
            self.resident_bytes -= old.nbytes
        self._pinned[layer][expert] = weights
        self.resident_bytes += weights.nbytes
        self.pinned_bytes += weights.nbytes

    def unpin(self, layer: int, expert: int) -> None:
        weights = self._pinned[layer].pop(expert, None)
        if weights is not None:
            self.resident_bytes -= weights.nbytes
            self.pinned_bytes -= weights.nbytes

    def pinned_set(self) -> set[tuple[int, int]]:
        return {(layer, e) for layer, table in enumerate(self._pinned) for e in table}

    # -- LRU ---------------------------------------------------------------------------
    def get(self, layer: int, expert: int) -> ExpertWeights | None:
        cache = self._lru[layer]
        weights = cache.get(expert)
        if weights is not None:
            cache.move_to_end(expert)
        return weights

    def put(self, layer: int, expert: int, weights: ExpertWeights) -> None:
        if self.slots <= 0 or expert in self._pinned[layer]:
            return
        cache = self._lru[layer]
        if expert in cache:
            return
        while len(cache) >= self.slots:
            _, old = cache.popitem(last=False)
            self.resident_bytes -= old.nbytes
            self.evictions += 1
        cache[expert] = weights
        self.resident_bytes += weights.nbytes

    def holds(self, layer: int, expert: int) -> bool:
        return expert in self._pinned[layer] or expert in self._lru[layer]

    def cached(self, layer: int) -> list[int]:
        return list(self._lru[layer])


class DeviceTier:
    """The contract of an accelerator's expert tier (VRAM), filled by GPU backends.

    The store consults a device tier before RAM: ``get`` returns the expert's weights in
    the backend's memory or None; ``admit`` offers an expert just used (the tier decides,
    within its own capacity, whether to keep it); ``resident_bytes`` is what it holds.
    A device tier must return exactly the numbers the RAM tier would: it changes where
    the weights live, never their values.
    """

    name = "device"

    def get(self, layer: int, expert: int) -> ExpertWeights | None:
        raise NotImplementedError

    def admit(self, layer: int, expert: int, weights: ExpertWeights) -> None:
        raise NotImplementedError

    @property
    def resident_bytes(self) -> int:
        raise NotImplementedError

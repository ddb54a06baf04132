"""Storage tiers that serve expert weights: the disk (the model's own shards) and RAM."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from ..safetensors_file import TensorInfo


@dataclass
class ExpertWeights:
    """One expert's matrices on the compute backend, by role ("gate", "up", "down")."""

    arrays: dict
    nbytes: int

    def __getitem__(self, role: str):
        return self.arrays[role]


class DiskTier:
    """Reads an expert's matrices from the safetensors shards, merging adjacent ranges
    into as few positioned reads as possible, then decodes and uploads them."""

    name = "disk"

    def __init__(self, checkpoint, resolver, backend):
        self.checkpoint = checkpoint
        self.resolver = resolver
        self.backend = backend
        self.bytes_read = 0
        self.reads = 0
        self.seconds = 0.0

    def load(self, matrices: dict[str, TensorInfo]) -> ExpertWeights:
        start = time.perf_counter()
        before_bytes, before_reads = self.checkpoint.bytes_read, self.checkpoint.reads
        decoded = self.resolver.read_decoded(self.checkpoint, list(matrices.values()))
        arrays = {role: self.backend.asarray(decoded[info.name]) for role, info in matrices.items()}
        self.bytes_read += self.checkpoint.bytes_read - before_bytes
        self.reads += self.checkpoint.reads - before_reads
        self.seconds += time.perf_counter() - start
        return ExpertWeights(arrays, sum(self.backend.nbytes(a) for a in arrays.values()))


class RamTier:
    """A least-recently-used cache of experts per layer, at most ``slots`` each."""

    name = "ram"

    def __init__(self, n_layers: int, slots: int):
        self.slots = slots
        self._layers: list[OrderedDict[int, ExpertWeights]] = [OrderedDict() for _ in range(n_layers)]
        self.resident_bytes = 0
        self.evictions = 0

    def get(self, layer: int, expert: int) -> ExpertWeights | None:
        cache = self._layers[layer]
        weights = cache.get(expert)
        if weights is not None:
            cache.move_to_end(expert)
        return weights

    def put(self, layer: int, expert: int, weights: ExpertWeights) -> None:
        if self.slots <= 0:
            return
        cache = self._layers[layer]
        if expert in cache:
            return
        while len(cache) >= self.slots:
            _, old = cache.popitem(last=False)
            self.resident_bytes -= old.nbytes
            self.evictions += 1
        cache[expert] = weights
        self.resident_bytes += weights.nbytes

    def cached(self, layer: int) -> list[int]:
        return list(self._layers[layer])

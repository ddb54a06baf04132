"""The expert store: serves each routed expert from the fastest tier holding it.

Family code asks for (layer, expert) and never knows where the weights came from;
placement (the tiers and their budgets) changes speed only, never the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..safetensors_file import TensorInfo
from .tiers import DiskTier, ExpertWeights, RamTier


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses


@dataclass
class ExpertStore:
    # layouts[moe_layer][expert] -> role -> where that matrix lies on disk
    layouts: list[list[dict[str, TensorInfo]]]
    disk: DiskTier
    ram: RamTier
    stats: StoreStats = field(default_factory=StoreStats)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        weights = self.ram.get(layer, expert)
        if weights is not None:
            self.stats.hits += 1
            return weights
        self.stats.misses += 1
        weights = self.disk.load(self.layouts[layer][expert])
        self.ram.put(layer, expert, weights)
        return weights

    def warm(self, progress=None) -> None:
        """Fill the RAM tier up to its slots (lowest expert ids first)."""
        for layer, experts in enumerate(self.layouts):
            for expert in range(min(self.ram.slots, len(experts))):
                if self.ram.get(layer, expert) is None:
                    self.ram.put(layer, expert, self.disk.load(experts[expert]))
                if progress:
                    progress()

    @property
    def resident_bytes(self) -> int:
        return self.ram.resident_bytes

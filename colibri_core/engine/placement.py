"""Placement: how much of the model stays in RAM, and how.

Dense weights are always resident. What is left of the RAM budget is the expert budget:
``--cap N`` limits it to N experts per MoE layer; experts being prefetched for the next
layers are reserved from it; a share of the rest holds the pinned hot set (when
pinning is on) and the remainder becomes LRU slots, the same number in every MoE layer.
Placement changes speed only, never the numbers the model computes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from colibri_core.errors import BudgetError, UsageError
from colibri_core.units import format_bytes

DEFAULT_SHARE_OF_AVAILABLE = 0.8


def available_memory() -> int:
    """Bytes the OS says are available (MemAvailable on Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


@dataclass(frozen=True)
class Placement:
    budget: int  # bytes of RAM for weights
    budget_source: str  # "--ram" or "default"
    dense_bytes: int
    expert_bytes: int  # one expert, as resident in memory
    moe_layers: int
    experts_per_layer: int
    slots: int  # LRU slots per MoE layer
    pinned: int  # experts the pinned set may hold, across all layers
    prefetch_slots: int  # experts read ahead per layer (0: no prefetch)
    cap: int | None
    io_window: int = 1  # a layer's misses read at once: transient experts beyond the cache

    @property
    def prefetch_reserve_bytes(self) -> int:
        # predictions for the next layer are staged while the current layer's are in use
        return 2 * self.prefetch_slots * self.expert_bytes

    @property
    def expert_cache_bytes(self) -> int:
        return (self.slots * self.moe_layers + self.pinned) * self.expert_bytes

    @property
    def all_resident(self) -> bool:
        return self.slots >= self.experts_per_layer


def plan(*, dense_bytes: int, expert_bytes: int, moe_layers: int, experts_per_layer: int, ram: int | None,
         cap: int | None, pin_share: float = 0.0, prefetch_slots: int = 0, io_window: int = 1) -> Placement:
    if cap is not None and cap < 0:
        raise UsageError(f"--cap must be >= 0, got {cap}")
    if not 0 <= pin_share < 1:
        raise UsageError(f"the pinned share must be in [0, 1), got {pin_share}")
    source = "--ram"
    if ram is None:
        source = "default"
        ram = int(available_memory() * DEFAULT_SHARE_OF_AVAILABLE)
    # the misses of one layer being read (at least the one computing) live beyond the cache
    working = max(1, io_window) * expert_bytes if moe_layers else 0
    reserve = 2 * prefetch_slots * expert_bytes
    if ram < dense_bytes + working + reserve:
        hint = "give a larger --ram" if source == "--ram" else "free memory or use a machine with more RAM"
        raise BudgetError(
            f"RAM budget {format_bytes(ram)} ({source}) cannot hold the dense weights ({format_bytes(dense_bytes)})"
            + (f" plus {max(1, io_window)} expert(s) being read ({format_bytes(working)})" if working else "")
            + (f" plus the prefetch reserve ({format_bytes(reserve)})" if reserve else "")
            + f"; {hint}"
        )
    if not (moe_layers and expert_bytes):
        return Placement(ram, source, dense_bytes, expert_bytes, moe_layers, experts_per_layer, experts_per_layer, 0, 0, cap,
                         io_window)
    total_experts = moe_layers * experts_per_layer
    budget_experts = (ram - dense_bytes - reserve - working) // expert_bytes  # in experts
    if cap is not None:
        budget_experts = min(budget_experts, cap * moe_layers)
    budget_experts = min(budget_experts, total_experts)
    pinned = 0
    if pin_share > 0 and budget_experts < total_experts:
        pinned = int(budget_experts * pin_share)
    slots = min(experts_per_layer, (budget_experts - pinned) // moe_layers)
    return Placement(ram, source, dense_bytes, expert_bytes, moe_layers, experts_per_layer, int(slots), pinned,
                     prefetch_slots, cap, io_window)

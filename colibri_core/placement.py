"""Placement: how much of the model stays in RAM.

Dense weights are always resident. The rest of the RAM budget becomes expert cache
slots, the same number in every MoE layer. Placement changes speed only, never the
numbers the model computes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import BudgetError
from .units import format_bytes

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
    slots: int  # cached experts per MoE layer
    cap: int | None

    @property
    def expert_cache_bytes(self) -> int:
        return self.slots * self.moe_layers * self.expert_bytes

    @property
    def all_resident(self) -> bool:
        return self.slots >= self.experts_per_layer


def plan(*, dense_bytes: int, expert_bytes: int, moe_layers: int, experts_per_layer: int, ram: int | None, cap: int | None) -> Placement:
    if cap is not None and cap < 0:
        raise BudgetError(f"--cap must be >= 0, got {cap}")
    source = "--ram"
    if ram is None:
        source = "default"
        ram = int(available_memory() * DEFAULT_SHARE_OF_AVAILABLE)
    # one expert beyond the cache is in use while it computes
    working = expert_bytes if moe_layers else 0
    if ram < dense_bytes + working:
        hint = "give a larger --ram" if source == "--ram" else "free memory or use a machine with more RAM"
        raise BudgetError(
            f"RAM budget {format_bytes(ram)} ({source}) cannot hold the dense weights ({format_bytes(dense_bytes)})"
            + (f" plus one expert ({format_bytes(expert_bytes)})" if working else "")
            + f"; {hint}"
        )
    if moe_layers and expert_bytes:
        slots = min(experts_per_layer, (ram - dense_bytes) // (moe_layers * expert_bytes))
    else:
        slots = experts_per_layer
    if cap is not None:
        slots = min(slots, cap)
    return Placement(ram, source, dense_bytes, expert_bytes, moe_layers, experts_per_layer, int(slots), cap)

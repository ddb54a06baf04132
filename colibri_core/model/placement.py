"""Placement: where the weights live, tier by tier, and how many experts each tier holds.

Dense weights are always resident: in RAM on a backend computing from host memory (the
CPU), in the backend's own memory on a backend that has some (``device_memory()``).

Each resident expert tier gets its own budget and splits it the same way: ``--cap N``
limits it to N experts per MoE layer, a share of it holds the pinned hot set (when
pinning is on) and the remainder becomes LRU slots, the same number in every MoE layer.

- RAM tier (``--ram``): host forms of experts. Experts being read for the current layer
  (the io window) are reserved from it; an expert read ahead for a layer borrows one of
  that layer's LRU slots while it waits to be used (``CachedTier.lend_slot``).
- Device tier (``--vram``, only on a backend with device memory): prepared experts.
  Default: a share of ``device_memory()`` less the dense weights (they live there too).
  On unified memory (device memory is host memory) both tiers share ``--ram``: the
  device tier gets ``--vram`` of what the dense weights and the io window leave (default: all
  of it, since a prepared expert is what the backend computes with), the RAM tier the rest.

Placement changes speed only, never the numbers the model computes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from colibri_core.errors import BudgetError, UsageError, option
from colibri_core.units import format_bytes

DEFAULT_SHARE_OF_AVAILABLE = 0.8
# of device memory, before the dense weights: the rest is left for the KV cache and activations
DEFAULT_SHARE_OF_DEVICE = 0.8


PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def available_memory() -> int:
    """Bytes this process may still use: the lower of what the OS says is available
    (MemAvailable on Linux) and what the memory cgroups it runs in leave."""
    return memory_available()[0]


def memory_available() -> tuple[int, str]:
    """(bytes available, where the number comes from)."""
    found = _meminfo_available(), "MemAvailable"
    cgroup = _cgroup_available()
    if cgroup is not None and cgroup < found[0]:
        found = cgroup, "the memory cgroup's limit less its usage"
    return found


def budget_beyond_memory(budget: int) -> str | None:
    """A one-line warning when a RAM budget is more than the memory available, else None."""
    available, source = memory_available()
    if budget <= available:
        return None
    return (f"--ram {format_bytes(budget)} is more than the memory available ({format_bytes(available)}, {source}): "
            "what it lets the caches hold would not fit: expect swapping or the out-of-memory killer as they fill")


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def _cgroup_available() -> int | None:
    """The least any memory cgroup of this process (v2 or v1) and its ancestors leave:
    limit - usage + page cache (reclaimable). None without a limited cgroup."""
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            root, limit_name, usage_name, cache_key = Path(CGROUP_ROOT), "memory.max", "memory.current", "file"
        elif "memory" in controllers.split(","):
            root = Path(CGROUP_ROOT) / "memory"
            limit_name, usage_name, cache_key = "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache"
        else:
            continue
        d = root / path.lstrip("/")
        while True:
            limit = _read_int(d / limit_name)
            if limit is not None and limit < _UNLIMITED:
                usage = _read_int(d / usage_name) or 0
                left = max(0, limit - usage + _memory_stat(d, cache_key))
                best = left if best is None else min(best, left)
            if d == root or root not in d.parents:
                break
            d = d.parent
    return best


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None  # absent, or "max" (v2: no limit)


def _memory_stat(d: Path, key: str) -> int:
    try:
        for line in (d / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass(frozen=True)
class TierPlacement:
    """One resident expert tier: its budget and what it holds."""

    role: str  # "ram" or "device"
    budget: int  # bytes this tier's experts may take
    budget_source: str  # "--ram", "--vram" or "default"
    expert_bytes: int  # one expert as this tier holds it
    slots: int  # LRU slots per MoE layer
    pinned: int  # experts the pinned set may hold, across all layers

    def cache_bytes(self, moe_layers: int) -> int:
        return (self.slots * moe_layers + self.pinned) * self.expert_bytes


@dataclass(frozen=True)
class Placement:
    budget: int  # bytes of RAM for weights
    budget_source: str  # "--ram" or "default"
    dense_bytes: int
    expert_bytes: int  # one expert, as the RAM tier holds it
    moe_layers: int
    experts_per_layer: int
    slots: int  # RAM LRU slots per MoE layer
    pinned: int  # experts the RAM pinned set may hold, across all layers
    prefetch_slots: int  # experts read ahead per layer (0: no prefetch)
    cap: int | None
    io_window: int = 1  # a layer's misses read at once: transient experts beyond the cache
    device: TierPlacement | None = None  # the device tier, on a backend with device memory
    unified: bool = False  # device memory is host memory: both tiers share ``budget``

    @property
    def dense_in(self) -> str:
        """Where the dense weights live: "ram" or "device"."""
        return "ram" if self.device is None else "device"

    @property
    def ram(self) -> TierPlacement:
        return TierPlacement("ram", self.budget, self.budget_source, self.expert_bytes, self.slots, self.pinned)

    @property
    def tiers(self) -> list[TierPlacement]:
        """The resident expert tiers, fastest first."""
        return ([self.device] if self.device is not None else []) + [self.ram]

    @property
    def expert_cache_bytes(self) -> int:
        """Bytes of the RAM tier's experts (pinned + LRU) when full."""
        return (self.slots * self.moe_layers + self.pinned) * self.expert_bytes

    @property
    def all_resident(self) -> bool:
        return any(t.slots >= self.experts_per_layer for t in self.tiers)


def plan(*, dense_bytes: int, expert_bytes: int, moe_layers: int, experts_per_layer: int, ram: int | None,
         cap: int | None, pin_share: float = 0.0, prefetch_slots: int = 0, io_window: int = 1,
         device_memory: int | None = None, vram: int | None = None, unified: bool = False,
         device_expert_bytes: int | None = None) -> Placement:
    """``expert_bytes``: one expert as the RAM tier holds it; ``device_expert_bytes``: as
    the device tier holds it (prepared; default ``expert_bytes``). ``device_memory`` None:
    the backend computes from host memory and there is no device tier."""
    if cap is not None and cap < 0:
        raise UsageError(f"{option('cap')} must be >= 0, got {cap}")
    if not 0 <= pin_share < 1:
        raise UsageError(f"{option('pin_share')} must be in [0, 1), got {pin_share}")
    if vram is not None and device_memory is None:
        raise UsageError(f"{option('vram')}: the backend has no device memory (its experts live in RAM: use {option('ram')})")
    if vram is not None and vram < 0:
        raise UsageError(f"{option('vram')} must be >= 0, got {vram}")
    ram_option, vram_option = option("ram", keyword=True), option("vram", keyword=True)
    source = "--ram"
    if ram is None:
        source = "default"
        ram = int(available_memory() * DEFAULT_SHARE_OF_AVAILABLE)
    # the misses of one layer being read (at least the one computing) live beyond the cache
    working = max(1, io_window) * expert_bytes if moe_layers else 0
    dense_in_ram = dense_bytes if device_memory is None or unified else 0
    if ram < dense_in_ram + working:
        hint = f"give a larger {ram_option}" if source == "--ram" else "free memory or use a machine with more RAM"
        raise BudgetError(
            f"RAM budget {format_bytes(ram)} ({ram_option if source == '--ram' else source}) cannot hold "
            + (f"the dense weights ({format_bytes(dense_bytes)})" if dense_in_ram else "")
            + (f"{' plus ' if dense_in_ram else ''}{max(1, io_window)} expert(s) being read ({format_bytes(working)})" if working else "")
            + f"; {hint}"
        )
    experts_left = ram - dense_in_ram - working  # bytes for the resident expert tiers
    device = None
    if device_memory is not None:
        device_expert_bytes = device_expert_bytes or expert_bytes
        vram_source = "--vram" if vram is not None else "default"
        if unified:
            if vram is None:
                vram = experts_left
            elif vram > experts_left:
                raise BudgetError(f"device budget {format_bytes(vram)} ({vram_option}) is more than the unified RAM budget "
                                  f"({ram_option}) leaves for experts ({format_bytes(experts_left)} of {format_bytes(ram)}); "
                                  f"give a smaller {vram_option} or a larger {ram_option}")
        else:
            if vram is None:
                vram = int(device_memory * DEFAULT_SHARE_OF_DEVICE) - dense_bytes
                if vram < 0:
                    raise BudgetError(f"device memory {format_bytes(device_memory)} cannot hold the dense weights "
                                      f"({format_bytes(dense_bytes)}) with room to compute; use a backend computing from RAM")
            elif vram + dense_bytes > device_memory:
                raise BudgetError(f"device budget {format_bytes(vram)} ({vram_option}) plus the dense weights "
                                  f"({format_bytes(dense_bytes)}) is more than the device memory ({format_bytes(device_memory)}); "
                                  f"give a smaller {vram_option}")
        device = _tier("device", vram, vram_source, device_expert_bytes, moe_layers, experts_per_layer, cap, pin_share)
        if unified:
            experts_left -= device.cache_bytes(moe_layers)
    ram_tier = _tier("ram", experts_left, source, expert_bytes, moe_layers, experts_per_layer, cap, pin_share)
    return Placement(ram, source, dense_bytes, expert_bytes, moe_layers, experts_per_layer, ram_tier.slots,
                     ram_tier.pinned, prefetch_slots, cap, io_window, device, unified and device_memory is not None)


def _tier(role: str, budget: int, source: str, expert_bytes: int, moe_layers: int, experts_per_layer: int,
          cap: int | None, pin_share: float) -> TierPlacement:
    """Split one tier's budget (bytes) into pinned experts and LRU slots per layer."""
    if not (moe_layers and expert_bytes):
        return TierPlacement(role, budget, source, expert_bytes, experts_per_layer, 0)
    total_experts = moe_layers * experts_per_layer
    budget_experts = max(0, budget) // expert_bytes
    if cap is not None:
        budget_experts = min(budget_experts, cap * moe_layers)
    budget_experts = min(budget_experts, total_experts)
    pinned = 0
    if pin_share > 0 and budget_experts < total_experts:
        pinned = int(budget_experts * pin_share)
    slots = min(experts_per_layer, (budget_experts - pinned) // moe_layers)
    return TierPlacement(role, budget, source, expert_bytes, int(slots), pinned)

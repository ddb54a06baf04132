"""Read buffers for experts (and dense weights), in anonymous mappings backed by 2 MiB pages.

The CPU kernels stream every resident expert's bytes once per token. Through 4 KiB
pages that costs ~10% of the bandwidth the kernels reach through 2 MiB pages (TLB
misses; measured on the full-size OLMoE shape: 24-26 against 27-29 GB/s). numpy asks
for huge pages only for arrays of 4 MiB and more, and an expert of a small model is
less, so the store takes its buffers from here: fixed-size slots in mappings the kernel
is asked (``MADV_HUGEPAGE``) to back with huge pages. A slot goes back to its free list
when the last array viewing it is gone, so an evicted expert that a computation still
uses stays intact. Slots are 4096-aligned, as O_DIRECT reads need.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
import weakref
from collections import defaultdict

import numpy as np

PAGE = 4096
HUGE = 2 << 20
CHUNK = 64 << 20  # bytes mapped at a time per slot size (untouched pages cost nothing)


class BufferPool:
    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[mmap.mmap, int]]] = defaultdict(list)
        self._maps: list[mmap.mmap] = []
        self.mapped_bytes = 0
        # A slot's death only appends its weakref to ``_dead`` (list.append, a C call): no
        # Python code runs in the finalization, so a Ctrl-C cannot land there and be
        # dropped as "Exception ignored" (it would on every eviction). ``take`` returns
        # the dead slots to the free lists.
        self._dead: list[weakref.ref] = []
        self._live: dict[int, tuple[weakref.ref, int, mmap.mmap, int]] = {}  # id(ref) -> (ref, size, mapping, offset)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` in a slot of its own (contents undefined)."""
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            self._reclaim()
            free = self._free[size]
            if not free:
                self._map_more(size, free)
            mapping, offset = free.pop()
            slot = (ctypes.c_uint8 * size).from_buffer(mapping, offset)
            ref = weakref.ref(slot, self._dead.append)
            self._live[id(ref)] = (ref, size, mapping, offset)
        return np.frombuffer(slot, dtype=np.uint8, count=nbytes)

    def _reclaim(self) -> None:
        while self._dead:
            _, size, mapping, offset = self._live.pop(id(self._dead.pop()))
            self._free[size].append((mapping, offset))

    def _map_more(self, size: int, free: list) -> None:
        per_map = max(1, self.chunk // size)
        length = -(-(per_map * size) // HUGE) * HUGE
        mapping = _huge_mapping(length)
        self._maps.append(mapping)
        self.mapped_bytes += length
        free.extend((mapping, i * size) for i in reversed(range(per_map)))


def _huge_mapping(length: int) -> mmap.mmap:
    """An anonymous private mapping the kernel is asked to back with 2 MiB pages."""
    try:
        mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        if exc.errno not in (errno.ENOMEM, errno.EAGAIN):
            raise
        from colibri_core.errors import ResourceError, option
        from colibri_core.units import format_bytes

        raise ResourceError(f"cannot map {format_bytes(length)} more memory for weights ({exc.strerror}): the machine "
                            f"or the address-space limit (ulimit -v) allows less; give a smaller {option('ram', keyword=True)}"
                            ) from None
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # transparent huge pages disabled: 4 KiB pages it is
            pass
    return mapping


_POOL = BufferPool() if hasattr(mmap, "MAP_ANONYMOUS") else None  # POSIX anonymous mappings


def expert_buffer(nbytes: int) -> np.ndarray:
    """A 4096-aligned read buffer for expert bytes from the process's pool (plain memory
    where the platform has no anonymous mappings)."""
    if _POOL is not None:
        return _POOL.take(nbytes)
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return raw[start : start + nbytes]


def huge_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` in an anonymous mapping of its own, 2 MiB-aligned and
    asked to be backed by huge pages; unmapped when the last array viewing it is gone.
    The dense weights are read into these: kept packed, they are views of the read
    buffer, and the kernels stream them every token like the experts (measured on the
    full-size OLMoE q/k/v projections: ~10% faster than through 4 KiB pages, see
    docs/benchmarks.md)."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.empty(nbytes, dtype=np.uint8)
    whole = np.frombuffer(_huge_mapping(-(-max(nbytes, 1) // HUGE) * HUGE + HUGE), dtype=np.uint8)
    start = (-whole.ctypes.data) % HUGE
    return whole[start : start + nbytes]

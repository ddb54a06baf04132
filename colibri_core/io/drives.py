"""Drives: the copies of a model's shards that expert reads are served from.

The primary drive is the model directory itself; mirrors are read-only byte-identical
copies (full or partial) on other drives. A mirror shard is used only if its size and
header bytes equal the primary's. Each expert is assigned to one drive by a
deterministic hash weighted by the drives' bandwidth, so the same expert always comes
from the same drive and the load spreads in proportion to speed. A read error on a
mirror disables that mirror with one warning and the read is served by the primary.
With an integrity manifest (``io/integrity.py``), every tensor read from a mirror (and,
with ``--verify``, from the primary) is hashed and compared: different bytes are a read
error like any other.

Reads are positioned (``preadv``), merged when tensors lie close together, optionally
with O_DIRECT (aligned supersets of the wanted bytes), and followed by
``posix_fadvise(DONTNEED)`` so the page cache does not quietly keep the model in memory
and make the RAM budget a lie.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibri_core.errors import ColibriError, UsageError
from colibri_core.io.safetensors import TensorInfo
from colibri_core.warn import warn
from colibri_core.io.buffers import expert_buffer
from colibri_core.io.pagecache import _FADVISE, ALIGN, drop_page_cache, forget



def aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer whose address is ALIGN-aligned (for O_DIRECT)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + nbytes]


# A read that may be given up midway (``stop_reads_when``) reads this much between two
# looks at whether it is still wanted; a multiple of ALIGN, for O_DIRECT.
STOP_CHUNK = 4 << 20


class ReadStopped(Exception):
    """A read given up midway because its bytes are no longer wanted (``stop_reads_when``):
    not a failure of the drive. ``nbytes``: what it had read."""

    def __init__(self, nbytes: int):
        super().__init__(f"read stopped after {nbytes} bytes")
        self.nbytes = nbytes


_stopping = threading.local()


@contextmanager
def stop_reads_when(stop):
    """Within the block, this thread's reads look at ``stop()`` every ``STOP_CHUNK`` bytes
    and raise ``ReadStopped`` once it is true (the store's reads ahead, when their layer
    turns out not to use them)."""
    _stopping.check = stop
    try:
        yield
    finally:
        _stopping.check = None


class ReadFailed(ColibriError):
    """A read of a weight file failed: an I/O error, or the file ended early (changed or
    truncated since it was opened). ``path``: that file."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


@dataclass
class Drive:
    """One copy of the shards. ``files`` maps a primary shard path to this drive's copy."""

    name: str
    files: dict[str, str]
    direct: bool = False
    fadvise: bool = True
    bandwidth: float | None = None  # bytes/s, given or measured
    bytes_read: int = 0
    reads: int = 0
    failed: str | None = None  # why this drive is no longer used
    integrity: object | None = None  # a Manifest the bytes read are checked against (None: not checked)
    _fds: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # files whose last read failed: before the next read, a file put back in their place
    # (a new inode: restored by rename) is opened instead, so a failure does not outlast the fault
    _suspect: set[str] = field(default_factory=set)
    # descriptors of replaced files: closed with the drive, as a read in flight may still use them
    _retired: list[tuple[int, int | None]] = field(default_factory=list)

    def has(self, primary_path: str) -> bool:
        return self.failed is None and primary_path in self.files

    def _open(self, primary_path: str) -> tuple[int, int | None]:
        with self._lock:
            fds = self._fds.get(primary_path)
            if fds is not None and primary_path in self._suspect:
                self._suspect.discard(primary_path)
                if _replaced(self.files[primary_path], fds[0]):
                    self._retired.append(self._fds.pop(primary_path))
                    fds = None
            if fds is None:
                path = self.files[primary_path]
                # non-blocking: a shard swapped for a FIFO since it was validated cannot hang the open
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
                if _FADVISE:  # expert reads are random: readahead would cache bytes nobody asked for
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                direct_fd = None
                if self.direct:
                    try:
                        direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                    except (OSError, AttributeError) as exc:
                        self.direct = False
                        warn(f"{path}: O_DIRECT is not available here ({exc}); reading through the page cache")
                fds = self._fds[primary_path] = (fd, direct_fd)
            return fds

    def read(self, group: list[TensorInfo]) -> dict[str, np.ndarray]:
        """Read one merged group (tensors of one shard) and return each tensor's bytes."""
        start = group[0].offset
        end = max(t.offset + t.nbytes for t in group)
        path = self.files[group[0].path]
        try:
            fd, direct_fd = self._open(group[0].path)
            if direct_fd is not None:
                lo = start - start % ALIGN
                hi = -(-end // ALIGN) * ALIGN
                buf = expert_buffer(hi - lo)
                got = _read_full(direct_fd, buf, lo, minimum=end - lo, path=path)
                data = buf[start - lo : end - lo]
                nread = got
            else:
                data = expert_buffer(end - start)
                nread = _read_full(fd, data, start, minimum=end - start, path=path)
        except ReadStopped as stopped:  # the bytes it did read were read
            self._ended(fd, start, end, stopped.nbytes)
            raise
        except (OSError, ReadFailed) as exc:
            with self._lock:
                self._suspect.add(group[0].path)
            if isinstance(exc, ReadFailed):
                raise
            raise ReadFailed(f"{path}: cannot read: {exc.strerror or exc}", path) from None
        self._ended(fd, start, end, nread)
        out = {t.name: data[t.offset - start : t.offset - start + t.nbytes] for t in group}
        if self.integrity is not None:
            for t in group:
                self.integrity.check(t, out[t.name], self.files[t.path])
        return out

    def _ended(self, fd: int, start: int, end: int, nread: int) -> None:
        """A read of [start, end) ended, ``nread`` bytes read: out of the page cache, counted."""
        if self.fadvise:
            forget(fd, start, end - start)
        with self._lock:
            self.bytes_read += nread
            self.reads += 1

    def close(self) -> None:
        with self._lock:
            for fd, direct_fd in [*self._fds.values(), *self._retired]:
                os.close(fd)
                if direct_fd is not None:
                    os.close(direct_fd)
            self._fds.clear()
            self._retired.clear()


def _replaced(path: str, fd: int) -> bool:
    """Whether ``path`` now names another file than the one open as ``fd`` (a missing
    file is not a replacement: the open one is read, and fails, until one appears)."""
    try:
        now, opened = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino)


def _read_full(fd: int, buf: np.ndarray, offset: int, minimum: int, path: str) -> int:
    """preadv into buf until at least ``minimum`` bytes arrived; returns bytes read.
    ``path`` (the file ``fd`` reads) names it in the error of a short read.
    Under ``stop_reads_when``, in chunks of STOP_CHUNK, looking at the stop before each."""
    view = memoryview(buf)
    done = 0
    stop = getattr(_stopping, "check", None)
    while done < minimum:
        if stop is not None and stop():
            raise ReadStopped(done)
        n = os.preadv(fd, [view[done:] if stop is None else view[done : done + STOP_CHUNK]], offset + done)
        if n <= 0:
            raise ReadFailed(f"{path}: short read at offset {offset + done}: file changed or truncated", path)
        done += n
    return done


# -- mirrors -----------------------------------------------------------------------------
@dataclass(frozen=True)
class MirrorSpec:
    path: Path
    bandwidth: float | None = None  # bytes/s

    @classmethod
    def parse(cls, text: str) -> "MirrorSpec":
        """'DIR' or 'DIR@BANDWIDTH', bandwidth in bytes/s with a unit per second: 2.5G = 2.5 GiB/s."""
        from colibri_core.units import parse_size

        path, sep, bw = text.rpartition("@") if "@" in text else (text, "", "")
        bandwidth = float(parse_size(bw)) if sep else None
        if bandwidth is not None and bandwidth <= 0:
            raise UsageError(f"mirror bandwidth must be positive: {text!r}")
        return cls(Path(path), bandwidth)


def validate_mirror(primary_files: dict[str, "object"], mirror: MirrorSpec) -> tuple[dict[str, str], list[str]]:
    """Which primary shards this mirror can serve. ``primary_files`` maps a primary path to
    its SafetensorsFile. A shard counts only if the mirror's copy has the same size and
    the same header bytes. Returns (primary path -> mirror path, reasons for skipped shards)."""
    usable: dict[str, str] = {}
    skipped: list[str] = []
    if not mirror.path.is_dir():
        raise UsageError(f"mirror {mirror.path} is not a directory")
    for primary_path, sf in primary_files.items():
        candidate = mirror.path / Path(primary_path).name
        if not candidate.is_file():
            continue  # partial mirrors are fine
        size = candidate.stat().st_size
        if size != sf.file_size:
            skipped.append(f"{candidate}: {size} bytes, the primary has {sf.file_size}")
            continue
        with open(primary_path, "rb") as a, open(candidate, "rb") as b:
            head = 8 + int.from_bytes(a.read(8), "little")
            a.seek(0)
            if a.read(head) != b.read(head):
                skipped.append(f"{candidate}: header differs from the primary's")
                continue
        usable[primary_path] = str(candidate)
    return usable, skipped


def measure_bandwidth(drive: Drive, samples: int = 4, chunk: int = 4 << 20) -> float:
    """Bytes/s of a few spread-out reads from the drive's largest shard, uncached (O_DIRECT
    where the file system has it, else through the page cache after forgetting it)."""
    path = max(drive.files.values(), key=lambda p: os.path.getsize(p))
    rate = read_rate(path, chunk, samples, direct=True)
    return rate if rate is not None else read_rate(path, chunk, samples, direct=False)


def read_rate(path, request: int, samples: int = 4, *, direct: bool) -> float | None:
    """Bytes/s reading ``samples`` requests of ``request`` bytes spread over ``path``: with
    O_DIRECT (None where the file system refuses it) or through the page cache, the file's
    pages forgotten first either way."""
    size = os.path.getsize(path)
    request = max(ALIGN, min(request, size) // ALIGN * ALIGN)
    drop_page_cache(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
    except OSError:
        if direct:
            return None
        raise
    try:
        buf = aligned_empty(request)
        total = 0
        started = time.perf_counter()
        for i in range(samples):
            offset = (size - request) * i // max(samples - 1, 1) // ALIGN * ALIGN
            total += os.preadv(fd, [memoryview(buf)], offset)
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
    return total / elapsed if elapsed > 0 else float("inf")


def choose_drive(key: str, drives: list[Drive]) -> Drive:
    """Weighted rendezvous hashing: deterministic, and each drive gets a share of keys
    proportional to its bandwidth."""
    best, best_score = None, -math.inf
    for drive in drives:
        digest = hashlib.blake2b(f"{drive.name}\0{key}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / 2**64  # uniform in (0, 1)
        score = (drive.bandwidth or 1.0) / -math.log(u)
        if score > best_score:
            best, best_score = drive, score
    return best

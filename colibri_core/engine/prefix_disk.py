"""Prompt prefixes kept on disk: the batched engine's prefix cache spilled to files
(``colibri serve --kv-disk SIZE``), so that a returning conversation or a shared system
prompt skips its prefill after the prefix left memory, or after a restart.

A prefix is the cache of a prompt's first ``n`` positions, ``n`` a whole number of
prefill chunks: the positions the scheduler would reuse from memory (computed by whole
chunks, so bit for bit what a cold prefill computes), with the state of the recurrent
layers at ``n``. Its file holds those arrays in the saved-state container
(colibri_core.engine.state: a document with the token ids, the arrays, a SHA-256 over
both) under ``KEY.kvstate``, KEY the SHA-256 of the model's identity, the backend, the
KV cache dtype, the prefill chunk and the ``n`` token ids: a prefix is found by hashing
the new prompt's first chunk boundaries, longest first, and its token ids are compared
again on reading.

Files go to ``kv/<model>/`` in colibri's cache dir, written atomically on a thread of
their own (the engine hands over host copies and goes on), least recently used first out
when the directory passes its budget in bytes (a hit touches its file). A damaged or
unreadable file is removed and counted, never used. Several servers may share the
directory: writes are atomic, and a file another one removed is a miss.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np

from colibri_core.errors import ColibriError, ModelFormatError

FORMAT = "colibri-prefix-state"
VERSION = 1
SUFFIX = ".kvstate"


def default_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("colibri")) / "kv"


class PrefixDisk:
    """The directory of one model's spilled prefixes, ``budget`` bytes at most."""

    def __init__(self, model, budget: int, chunk: int, directory: str | os.PathLike | None = None):
        from colibri_core.engine.state import model_identity

        self.model, self.budget, self.chunk = model, int(budget), int(chunk)
        identity = model_identity(model)
        backend = model.backend
        base = hashlib.sha256(f"colibri prefix 1\0{identity['sha256']}\0{backend.name}\0{backend.kv_cache_dtype}\0"
                              f"{self.chunk}\0".encode())
        self._base = base
        self.identity = identity
        self.dir = Path(directory) if directory is not None else default_dir() / base.hexdigest()[:24]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hit_tokens = self.hits = self.writes = self.bytes_written = self.evictions = self.errors = 0
        self.read_s = 0.0
        self._usage = self._scan()  # (files, bytes) on disk: kept current by writes and removals, not rescanned per call
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="colibri-kv-disk", daemon=True)
        self._writer.start()

    # -- keys --------------------------------------------------------------------------
    def _keys(self, tokens: list[int], limit: int) -> dict[int, str]:
        """The key of ``tokens[:b]`` for every chunk boundary b <= limit."""
        h, keys, at = self._base.copy(), {}, 0
        for b in range(self.chunk, limit + 1, self.chunk):
            h.update(np.asarray(tokens[at:b], dtype="<i8").tobytes())
            keys[b] = h.copy().hexdigest()
            at = b
        return keys

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    # -- reading -------------------------------------------------------------------------
    def lookup(self, prompt: list[int], longer_than: int = 0):
        """The longest spilled prefix of ``prompt`` leaving at least one id to prefill and
        longer than ``longer_than``: ``(n, layers)`` (host arrays of n positions), or None."""
        from colibri_core.engine.state import read_layers

        limit = (len(prompt) - 1) // self.chunk * self.chunk
        for n, key in sorted(self._keys(prompt, limit).items(), reverse=True):
            if n <= longer_than:
                return None
            path = self.path(key)
            if not path.exists():
                continue
            began = time.perf_counter()
            try:
                doc, layers = read_layers(path, FORMAT, VERSION, {"format", "version", "model", "positions", "token_ids"},
                                          _check_prefix)
                if doc["model"]["sha256"] != self.identity["sha256"] or doc["token_ids"] != list(prompt[:n]):
                    raise ColibriError(f"{path}: another prefix under this key")
            except FileNotFoundError:  # another server removed it meanwhile
                continue
            except (ColibriError, OSError):
                self.errors += 1
                _unlink(path)
                self._usage = self._scan()
                continue
            self.read_s += time.perf_counter() - began
            try:
                os.utime(path)  # recently used: the last to go
            except OSError:
                pass
            self.hits += 1
            self.hit_tokens += n
            return n, layers
        return None

    # -- writing -------------------------------------------------------------------------
    def spill(self, tokens: list[int], layers: list) -> None:
        """Keep the prefix ``tokens`` (its layers' host arrays) on disk, unless it is there
        or on its way; the file is written on the writer thread."""
        n = len(tokens)
        if n == 0 or n % self.chunk:
            raise ValueError(f"a spilled prefix holds whole chunks of {self.chunk}, not {n} positions")
        key = self._keys(tokens, n)[n]
        with self._lock:
            if key in self._pending or self.path(key).exists():
                return
            self._pending.add(key)
        self._jobs.put((key, list(tokens), layers))

    def _write_loop(self) -> None:
        from colibri_core.engine.state import layer_arrays, write_layers

        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            key, tokens, layers = job
            try:
                size = sum(a.nbytes for _, a in layer_arrays(layers))
                if size <= self.budget:
                    doc = {"format": FORMAT, "version": VERSION, "model": self.identity, "positions": len(tokens),
                           "token_ids": tokens}
                    self.bytes_written += write_layers(self.path(key), doc, layers)
                    self.writes += 1
                    self._evict()
            except (ColibriError, OSError):  # a full or read-only disk: the prefix stays unspilled
                self.errors += 1
            finally:
                with self._lock:
                    self._pending.discard(key)
                self._jobs.task_done()

    def _scan(self) -> tuple[int, int]:
        """(files, bytes) of the prefixes in the directory now."""
        files = size = 0
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                size += path.stat().st_size
                files += 1
            except OSError:  # another server removed it meanwhile
                pass
        return files, size

    def _evict(self) -> None:
        """Remove the least recently used files while the directory is over its budget."""
        files = []
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        total, count = sum(size for _, size, _ in files), len(files)
        for _, size, path in sorted(files):
            if total <= self.budget:
                break
            _unlink(path)
            total, count = total - size, count - 1
            self.evictions += 1
        self._usage = (count, total)

    def flush(self) -> None:
        """Wait until every spilled prefix is written."""
        self._jobs.join()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._writer.join()

    def stats(self) -> dict:
        """Counters, and what is on disk as of the last write or removal (/metrics and the
        dashboard ask every second: no directory listing per call)."""
        files, size = self._usage
        return {"kv_disk_budget_bytes": self.budget, "kv_disk_bytes": size, "kv_disk_files": files,
                "kv_disk_hits": self.hits, "kv_disk_hit_tokens": self.hit_tokens, "kv_disk_writes": self.writes,
                "kv_disk_bytes_written": self.bytes_written, "kv_disk_evictions": self.evictions,
                "kv_disk_errors": self.errors, "kv_disk_read_s": self.read_s}


def _check_prefix(doc: dict, path: str) -> None:
    ids, positions = doc["token_ids"], doc["positions"]
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise ModelFormatError(f"{path}: saved prefix's token_ids must be a non-empty list of integers >= 0")
    if positions != len(ids):
        raise ModelFormatError(f"{path}: saved prefix holds {positions!r} positions for {len(ids)} token ids")


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass

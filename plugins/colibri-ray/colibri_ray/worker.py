"""The expert worker: a Ray actor owning a shard of the experts.

It opens its own copy of the checkpoint (the model directory must be readable on its
machine, with the coordinator's shards: same sizes and headers, checked at start), keeps
its experts in its own RAM tier (a per-layer LRU within its RAM budget) and reads misses
from its own disk, and answers the coordinator's requests: for one MoE layer, the
activations of the rows routed to its experts, and back each expert's output.

Every call carries the run's token (a random secret the coordinator made for this run);
a call without it is refused, so another job reaching this actor cannot use it. A
request id is answered at most once. Payloads are numpy arrays and plain ints / strings.
"""

from __future__ import annotations

import hmac
import os
import socket
from collections import deque

import numpy as np


def shard_fingerprints(files) -> dict[str, tuple[int, str]]:
    """shard file name -> (size, sha256 of its 8-byte length and header): what a worker's
    copy of the checkpoint must match."""
    import hashlib
    import struct
    from pathlib import Path

    out = {}
    for path in files:
        path = Path(path)
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head)
            out[path.name] = (path.stat().st_size, hashlib.sha256(head + f.read(n)).hexdigest())
    return out


class ExpertWorker:
    """The actor's class (``ray.remote`` is applied by the coordinator)."""

    SEEN = 4096  # request ids remembered, to refuse a repeated one

    def __init__(self, index: int, token: str):
        self.index, self._token = index, token
        self.host = socket.gethostname()
        self.model_dir = None
        self.store = self.bp = self.backend = None
        self.budget = 0
        self.requests = self.experts = self.bytes_in = self.bytes_out = 0
        self._seen: set[int] = set()
        self._order: deque[int] = deque()

    def open(self, token: str, model_dir: str, backend: str, ram: int | None, fingerprints: dict) -> dict:
        """Open a model (closing the one open before): its checkpoint must be readable
        here with the coordinator's shards."""
        from pathlib import Path

        from colibri_core.model.placement import available_memory
        from colibri_core.errors import UsageError
        from colibri_core.experts.store import ExpertStore
        from colibri_core.io.drives import Drive
        from colibri_core.model.blueprint import inspect_model
        from colibri_core.plugins.discovery import create_backend, get_registry

        self._check(token)
        self.release(token)
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise UsageError(f"ray worker {self.index} on {self.host}: {model_dir} is not readable there (no "
                             "config.json); every worker's machine needs the checkpoint at the same path")
        self.backend = create_backend(get_registry(), backend)
        bp = inspect_model(path, self.backend)
        try:
            mine = shard_fingerprints(sorted({sf.path for sf in bp.checkpoint.files.values()}))
            for name, want in fingerprints.items():
                if mine.get(name) != tuple(want):
                    raise UsageError(f"ray worker {self.index} on {self.host}: shard {name} of {model_dir} differs from "
                                     "the coordinator's (size or header): every machine needs the same checkpoint")
            self.budget = int(ram) if ram is not None else int(0.8 * available_memory())
            moe = bp.moe
            # an absolute count: only this worker's experts ever enter its LRU, so a budget
            # holding its whole shard holds every one of them
            slots = max(1, min(bp.experts_per_layer, self.budget // max(1, bp.expert_ram_bytes * len(moe))))
            tiers = get_registry()
            disk = tiers.tier("disk").spec.load()(
                [Drive("primary", {sf.path: sf.path for sf in bp.checkpoint.files.values()})], bp.resolver, self.backend)
            ram_tier = tiers.tier("ram").spec.load()(len(moe), slots)
        except BaseException:
            bp.close()
            raise
        self.bp = bp
        # its misses of a request are read together on the store's I/O pool, overlapping each
        # other and the computation of the experts at hand, as the local path reads them
        self.store = ExpertStore([d.matrices for d in moe], disk, ram_tier, save_history=False)
        self.model_dir = str(model_dir)
        return self.info(token)

    def _check(self, token: str) -> None:
        if not isinstance(token, str) or not hmac.compare_digest(token, self._token):
            raise PermissionError("this colibri expert worker takes work only from its coordinator (wrong run token)")

    def info(self, token: str) -> dict:
        self._check(token)
        return {"index": self.index, "host": self.host, "pid": os.getpid(), "ram_budget": self.budget,
                "model": self.model_dir}

    def counters(self, token: str) -> dict:
        self._check(token)
        if self.store is None:
            return {}
        disk = self.store.disk
        return {"requests": self.requests, "experts": self.experts, "bytes_read": disk.bytes_read,
                "disk_reads": disk.reads, "hits": self.store.stats.hits, "misses": self.store.stats.misses,
                "bytes_received": self.bytes_in, "bytes_sent": self.bytes_out}

    def compute(self, token: str, request: int, layer: int, x: np.ndarray, experts: np.ndarray, offsets: np.ndarray,
                rows: np.ndarray, invariant: bool):
        """(request, outputs, counters): each expert's output for its rows of x."""
        from colibri_core.errors import UsageError

        from colibri_ray.compute import expert_outputs

        self._check(token)
        if self.store is None:
            raise UsageError(f"ray worker {self.index} has no model open")
        request = int(request)
        if request in self._seen:
            raise UsageError(f"request {request} was already answered: refused")
        self._seen.add(request)
        self._order.append(request)
        if len(self._order) > self.SEEN:
            self._seen.discard(self._order.popleft())
        arrays = (x, experts, offsets, rows)
        if not all(isinstance(a, np.ndarray) for a in arrays) or x.dtype != np.float32 or x.ndim != 2:
            raise UsageError("a request's payload is numpy arrays: x float32 (rows, hidden), experts, offsets, rows int64")
        decl = self.bp.moe[int(layer)]
        store = self.store
        store.request(int(layer), experts.tolist())
        out = expert_outputs(self.backend, decl, lambda e: store.get(int(layer), e), x, experts, offsets, rows,
                             bool(invariant))
        store.end_layer(int(layer), np.asarray(experts)[None, :], np.asarray(experts))
        self.requests += 1
        self.experts += len(experts)
        self.bytes_in += sum(int(a.nbytes) for a in arrays)
        self.bytes_out += int(out.nbytes)
        return request, out, self.counters(token)

    def release(self, token: str) -> None:
        """Close the model open here, if any (the worker stays, for another model)."""
        self._check(token)
        if self.store is not None:
            self.store.close()
            self.bp.close()
        self.store = self.bp = None
        self.model_dir = None
        self.requests = self.experts = self.bytes_in = self.bytes_out = 0
        self._seen, self._order = set(), deque()

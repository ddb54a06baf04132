"""The ``ray`` compute tier: the coordinator's side.

At load it joins a Ray cluster (``address``: an existing one; ``"local"``: starts one
here; an already initialised Ray is used as it is), starts ``workers`` expert workers
(``colibri_ray.worker.ExpertWorker`` actors, spread over the nodes, in a namespace of
this run) and assigns each (layer, expert) to one of them by weighted rendezvous hashing
over their RAM budgets (``colibri_ray.placement``).

Per MoE layer and step it sends each worker owning some of the step's experts one
request: the union of the rows routed to them (float32 activations), and for each
expert its rows; all requests are in flight together. It sums the returned outputs in
ascending expert order with the backend's ``add_rows``, exactly as the local path sums
(``colibri_core.experts.tiers.routed_output``): the tokens are the local run's.

A worker that fails (its process died, an error) or does not answer within ``timeout``
seconds is marked down with one warning; its experts are computed here, read through
the coordinator's own expert store (its RAM tier and disk), by the same code the
workers run (``colibri_ray.compute``), so nothing changes in the output. Each request is
answered once: by the worker in time, else by the fallback (a late answer is dropped).
Every ``retry`` seconds a down worker is pinged; once it answers (Ray restarted it) it
rejoins and gets its experts back.
"""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np

from colibri_core.compute.host import expert_groups
from colibri_core.errors import UsageError
from colibri_core.experts.tiers import ComputeTier, routed_output
from colibri_core.warn import warn

from colibri_ray.compute import expert_outputs
from colibri_ray.placement import assign
from colibri_ray.worker import ExpertWorker, shard_fingerprints

DEFAULT_TIMEOUT = 30.0  # seconds a worker may take to answer one request
DEFAULT_RETRY = 10.0  # seconds between pings of a worker that is down


class _Worker:
    def __init__(self, index: int, actor):
        self.index, self.actor = index, actor
        self.name = f"worker-{index}"
        self.host = "?"
        self.budget = 0
        self.alive = True
        self.ping = None  # a ping in flight while down
        self.next_ping = 0.0
        self.remote: dict = {}  # the worker's own counters, from its last answer
        self.requests = self.experts = self.bytes_sent = self.bytes_received = 0
        self.failures = self.timeouts = self.rejoins = 0


class WorkerPool:
    """Expert workers (Ray actors, each in its own process, spread over the nodes) and
    the secret token they take work with. A ``RayTier`` makes its own, or is given one
    (``compute_options={"pool": pool}``) to open its model on: a pool outlives the
    models opened on it (tests, a process loading several models), until ``close``."""

    def __init__(self, workers: int, *, cpus: float = 1.0):
        import ray

        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise UsageError(f"--ray-workers must be an integer >= 1, got {workers!r}")
        self.token = secrets.token_hex(32)
        actor_class = ray.remote(ExpertWorker)
        # restarted by Ray when its process dies (it then rejoins); a request is never retried by Ray
        self.actors = [actor_class.options(num_cpus=cpus, max_restarts=-1, max_task_retries=0,
                                           scheduling_strategy="SPREAD").remote(i, self.token)
                       for i in range(workers)]

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            for actor in self.actors:
                try:
                    ray.kill(actor)
                except Exception:
                    pass
        self.actors = []


class RayTier(ComputeTier):
    name = "ray"

    @classmethod
    def open(cls, model_dir, blueprint, backend, store, options: dict) -> "RayTier":
        return cls(model_dir, blueprint, backend, store, **options)

    def __init__(self, model_dir, blueprint, backend, store, *, address: str | None = None, workers: int = 2,
                 worker_ram: int | None = None, timeout: float = DEFAULT_TIMEOUT, retry: float = DEFAULT_RETRY,
                 worker_cpus: float = 1.0, pool: WorkerPool | None = None):
        import ray

        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise UsageError(f"--ray-timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout, self.retry = float(timeout), float(retry)
        self._started_ray = False
        self._own_pool = pool is None
        self.workers: list[_Worker] = []
        self.pool = None
        if not ray.is_initialized():
            if address is None:
                raise UsageError("--ray: give a cluster's ADDRESS (host:port, ray://host:port, auto) or 'local'")
            kwargs = dict(namespace=f"colibri-{secrets.token_hex(8)}", include_dashboard=False, log_to_driver=False,
                          configure_logging=False)
            if address == "local":
                ray.init(num_cpus=max(2, int(workers * worker_cpus) + 1), **kwargs)
            else:
                ray.init(address=address, **kwargs)
            self._started_ray = True
        self._lock = threading.Lock()
        self._next_request = 0
        self.fallback_experts = self.fallback_requests = self.fallback_bytes_read = self.fallback_reads = 0
        self.requests = self.bytes_sent = self.bytes_received = 0
        self._warned: set[int] = set()
        self._disk = store.disk  # the coordinator's disk tier: its reads while falling back are counted
        self._model = (str(model_dir), backend.name, worker_ram,
                       shard_fingerprints(sorted({sf.path for sf in blueprint.checkpoint.files.values()})))
        try:
            self.pool = pool if pool is not None else WorkerPool(workers, cpus=worker_cpus)
            self._token = self.pool.token
            self.workers = [_Worker(i, actor) for i, actor in enumerate(self.pool.actors)]
            infos = self._get([w.actor.open.remote(self._token, *self._model) for w in self.workers], "start")
        except BaseException:
            self.close()
            raise
        for w, info in zip(self.workers, infos):
            w.host, w.budget = info["host"], info["ram_budget"]
        self.owners = assign([d.count for d in blueprint.moe], [(w.name, w.budget) for w in self.workers])

    def _get(self, refs, what: str):
        import ray

        try:
            return ray.get(refs, timeout=max(self.timeout, 120.0))
        except ray.exceptions.GetTimeoutError:
            raise UsageError(f"--ray: the expert workers did not {what} in time (do the nodes have free CPUs?)") from None
        except ray.exceptions.RayError as exc:  # a worker's own error (its checkpoint), or its process died
            raise UsageError(f"--ray: an expert worker could not {what}: {_first_line(exc)}") from None

    # -- serving -----------------------------------------------------------------------
    def routed_experts(self, decl, x, indices, weights, ops, fetch):
        import ray

        layer = decl.moe_index
        from colibri_core.engine.batching import RowInvariantOps

        # a batched decode step: the backend wrapped, each row computed as it would be alone
        invariant = isinstance(ops, RowInvariantOps) and indices.shape[0] > 1
        backend = ops.backend if isinstance(ops, RowInvariantOps) else ops
        groups = list(expert_groups(indices, weights))
        host_x = np.ascontiguousarray(backend.to_host(x), dtype=np.float32)
        owners = self.owners[layer]
        mine: dict[int, list[tuple[int, np.ndarray]]] = {}
        for e, rows, _ in groups:
            mine.setdefault(owners[e], []).append((e, rows))
        self._ping_down()
        outputs: dict[int, np.ndarray] = {}
        fallback: list[tuple[int, np.ndarray]] = []
        pending = []
        for index, items in sorted(mine.items()):
            worker = self.workers[index]
            if not worker.alive:
                fallback += items
                continue
            union = np.unique(np.concatenate([rows for _, rows in items]))
            experts = np.asarray([e for e, _ in items], dtype=np.int64)
            offsets = np.zeros(len(items) + 1, dtype=np.int64)
            np.cumsum([len(rows) for _, rows in items], out=offsets[1:])
            local = np.concatenate([np.searchsorted(union, rows) for _, rows in items]).astype(np.int64)
            xs = host_x[union]
            request = self._request_id()
            ref = worker.actor.compute.remote(self._token, request, layer, xs, experts, offsets, local, invariant)
            sent = xs.nbytes + experts.nbytes + offsets.nbytes + local.nbytes
            worker.requests += 1
            worker.bytes_sent += sent
            self.requests += 1
            self.bytes_sent += sent
            pending.append((worker, ref, request, items, offsets))
        deadline = time.monotonic() + self.timeout
        for worker, ref, request, items, offsets in pending:
            try:
                answered, out, remote = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                if answered != request or out.shape != (int(offsets[-1]), host_x.shape[1]) or out.dtype != np.float32:
                    raise RuntimeError(f"answer to request {answered} of shape {out.shape} for request {request}")
            except ray.exceptions.GetTimeoutError:
                try:
                    ray.cancel(ref)  # its answer, should it come, is never read
                except Exception:
                    pass
                worker.timeouts += 1
                self._down(worker, f"no answer within {self.timeout:g} s")
                fallback += items
                continue
            except Exception as exc:  # the actor died, or refused: compute its experts here
                worker.failures += 1
                self._down(worker, _first_line(exc))
                fallback += items
                continue
            worker.remote = remote
            worker.experts += len(items)
            worker.bytes_received += out.nbytes
            self.bytes_received += out.nbytes
            for i, (e, _) in enumerate(items):
                outputs[e] = out[offsets[i] : offsets[i + 1]]
        if fallback:
            outputs.update(self._fallback(backend, decl, fetch, host_x, sorted(fallback, key=lambda item: item[0]),
                                          invariant))
        return routed_output(ops, x, groups, outputs)

    def _fallback(self, backend, decl, fetch, host_x, items, invariant) -> dict[int, np.ndarray]:
        experts = np.asarray([e for e, _ in items], dtype=np.int64)
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum([len(rows) for _, rows in items], out=offsets[1:])
        rows = np.concatenate([r for _, r in items]).astype(np.int64)
        disk = self._disk
        before = (disk.bytes_read, disk.reads)
        out = expert_outputs(backend, decl, fetch, host_x, experts, offsets, rows, invariant)
        self.fallback_bytes_read += disk.bytes_read - before[0]
        self.fallback_reads += disk.reads - before[1]
        self.fallback_requests += 1
        self.fallback_experts += len(items)
        return {e: out[offsets[i] : offsets[i + 1]] for i, (e, _) in enumerate(items)}

    def _request_id(self) -> int:
        with self._lock:
            self._next_request += 1
            return self._next_request

    def _down(self, worker: _Worker, why: str) -> None:
        worker.alive = False
        worker.ping = None
        worker.next_ping = time.monotonic() + self.retry
        if worker.index not in self._warned:
            self._warned.add(worker.index)
            warn(f"ray expert worker {worker.index} on {worker.host} failed ({why}): its experts are computed here from "
                 "the local disk until it answers again")

    def _ping_down(self) -> None:
        """Ping the workers that are down every ``retry`` seconds; one answering rejoins."""
        import ray

        now = time.monotonic()
        for worker in self.workers:
            if worker.alive:
                continue
            if worker.ping is None:
                if now >= worker.next_ping:
                    worker.ping = worker.actor.info.remote(self._token)
                continue
            ready, _ = ray.wait([worker.ping], timeout=0)
            if not ready:
                continue
            try:
                info = ray.get(worker.ping)
                if info["model"] != self._model[0]:  # restarted by Ray: a fresh process opens the model again
                    ray.get(worker.actor.open.remote(self._token, *self._model), timeout=max(self.timeout, 120.0))
            except Exception:
                worker.ping, worker.next_ping = None, now + self.retry
                continue
            worker.alive, worker.ping = True, None
            worker.rejoins += 1

    # -- statistics --------------------------------------------------------------------
    def counters(self) -> dict:
        workers = {}
        for w in self.workers:
            workers[w.name] = {"host": w.host, "alive": w.alive, "requests": w.requests, "experts": w.experts,
                               "network_bytes_sent": w.bytes_sent, "network_bytes_received": w.bytes_received,
                               "bytes_read": w.remote.get("bytes_read", 0), "disk_reads": w.remote.get("disk_reads", 0),
                               "failures": w.failures, "timeouts": w.timeouts, "rejoins": w.rejoins}
        return {"tier": "ray", "requests": self.requests, "network_bytes_sent": self.bytes_sent,
                "network_bytes_received": self.bytes_received, "fallback_requests": self.fallback_requests,
                "fallback_experts": self.fallback_experts, "fallback_bytes_read": self.fallback_bytes_read,
                "fallback_reads": self.fallback_reads, "workers": workers}

    def close(self) -> None:
        import ray

        if ray.is_initialized() and self.pool is not None:
            if self._own_pool:
                self.pool.close()
            else:  # the pool's workers stay, for the next model
                for w in self.workers:
                    try:
                        ray.get(w.actor.release.remote(self._token), timeout=10)
                    except Exception:
                        pass
        self.pool, self.workers = None, []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def check_workers(model_dir, options: dict) -> list[tuple[str, str, str, str]]:
    """``colibri doctor --ray``: start the workers and have each open the model (its
    checkpoint readable on its machine, with this machine's shards); one check each."""
    import ray

    from colibri_core.model.blueprint import inspect_model

    started = not ray.is_initialized()
    address, workers = options["address"], options["workers"]
    checks = []
    try:
        if started:
            kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
            if address == "local":
                ray.init(num_cpus=workers + 1, **kwargs)
            else:
                ray.init(address=address, **kwargs)
        bp = inspect_model(model_dir)
        try:
            model = (str(bp.model_dir), "cpu", options.get("worker_ram"),
                     shard_fingerprints(sorted({sf.path for sf in bp.checkpoint.files.values()})))
        finally:
            bp.close()
        pool = WorkerPool(workers)
        try:
            refs = [actor.open.remote(pool.token, *model) for actor in pool.actors]
            for i, ref in enumerate(refs):
                try:
                    info = ray.get(ref, timeout=max(120.0, options.get("timeout", DEFAULT_TIMEOUT)))
                    checks.append((f"ray worker {i}", "pass", f"on {info['host']}: reads {model[0]}, the same shards",
                                   ""))
                except Exception as exc:
                    checks.append((f"ray worker {i}", "fail", _first_line(exc),
                                   "every worker's machine needs the same checkpoint at the same path"))
        finally:
            pool.close()
    except Exception as exc:
        checks.append(("ray workers", "fail", f"{address}: {_first_line(exc)}", "start the cluster (ray start) or "
                       "give its address"))
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    return checks


def _first_line(exc: BaseException) -> str:
    exc = getattr(exc, "cause", None) or exc  # a RayTaskError: the worker's own exception
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__

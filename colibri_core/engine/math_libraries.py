"""The math libraries' memory, taken before the weights take the rest.

OpenBLAS (numpy's BLAS) maps a work buffer per thread, and the compiled kernels' OpenMP
runtime starts its threads, the first time each is used. When that first use comes after
the weights have taken the memory (a tight ``ulimit -v``, a small RLIMIT_AS or
RLIMIT_DATA), they fail in C and end the process: OpenBLAS prints "Memory allocation
still failed after 10 retries, giving up." and exits 1, libgomp prints "Thread creation
failed" and exits 1; Python never sees an exception. So ``reserve`` uses both once,
at the start of the first load, while memory is still free; afterwards they reuse what
they took, and running out of memory later is an exception colibri reports (exit 3).

Where the address space is limited, even that first use may not fit: it is tried first in
a forked child (the same address space, the same limits), so that a failure there (an exit,
or a hang: OpenBLAS's exit in a forked child waits for threads it no longer has) is a
ResourceError here, not the libraries' exit. And there numpy's BLAS runs on one thread:
OpenBLAS's threaded product mallocs its job table (512 KiB) at every call and exits the
process ("malloc failed in gemm_driver") when that fails, so whether a full address space
ended the run in C or raised MemoryError (exit 3) was a race with numpy's own allocations.
Its one-thread product only reuses the buffer started here. (With the compiled kernels on
packed weights BLAS is on one thread anyway: ``CpuBackend.placed``.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import numpy as np

from colibri_core.errors import ResourceError

try:
    import resource
except ImportError:  # not POSIX: no limits to probe
    resource = None

# a product this size engages every OpenBLAS thread (it splits gemm by m*n*k, 262144 per
# thread at least: 512^3 is enough for 512 threads); about a millisecond on a few cores
WARM_N = 512
PROBE_TIMEOUT_S = 10.0

_reserved = False
_lock = threading.Lock()


def reserve(backend=None) -> None:
    """Start numpy's BLAS thread pool and the backend's own (``Backend.start_threads``:
    the CPU kernels' OpenMP team) and their buffers now, once per process; a
    ResourceError when the address space cannot hold them."""
    global _reserved
    with _lock:
        if _reserved:
            return
        limited = _address_space_limited()
        if limited and hasattr(os, "fork"):
            _probe_in_child(backend, limited)
        _use_once(backend, limited)
        _reserved = True


def _address_space_limited() -> bool:
    if resource is None:
        return False
    limits = [resource.RLIMIT_AS] + ([resource.RLIMIT_DATA] if hasattr(resource, "RLIMIT_DATA") else [])
    return any(resource.getrlimit(limit)[0] != resource.RLIM_INFINITY for limit in limits)


def _use_once(backend, one_blas_thread: bool) -> None:
    if one_blas_thread:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1, user_api="blas")
    a = np.ones((WARM_N, WARM_N), dtype=np.float32)
    a @ a
    if backend is not None:
        backend.start_threads()  # the CPU backend's kernels: OpenMP's team


def _probe_in_child(backend, one_blas_thread: bool) -> None:
    """Run ``_use_once`` in a forked child (the same address space, the same limits);
    a ResourceError if it could not."""
    with warnings.catch_warnings():  # the fork warns when threads run (OpenBLAS's): the child only computes and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: silent (the libraries' own messages would read as colibri's), then gone
        code = 1
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            _use_once(backend, one_blas_thread)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            failed = os.waitstatus_to_exitcode(status) != 0
            break
        if time.monotonic() > deadline:
            # stuck: OpenBLAS, failing in a forked child, gives up with exit(), whose handlers
            # then wait for its worker threads forever; it takes milliseconds when it works
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            failed = True
            break
        time.sleep(0.005)
    if failed:
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        where = "the address-space limit"
        if limit != resource.RLIM_INFINITY:
            where += f" ({limit >> 20} MiB, ulimit -v)"
        raise ResourceError(f"out of memory: {where} leaves too little for the math libraries (OpenBLAS, OpenMP) to "
                            "start their threads and buffers; raise the limit, or run with fewer threads "
                            "(OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1)")

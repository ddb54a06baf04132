"""What the CUDA backend needs of CuPy besides array operations: uploads, downloads,
streams and events, memory size. Imported only when the backend is made (the plugin's
probe never imports CuPy). The tests run the backend's Python code on numpy with a
stand-in of this class (tests/numpy_device.py)."""

from __future__ import annotations

import contextlib

import cupy
import numpy as np


class CupyDevice:
    """The current CUDA device, computing on CuPy's current stream."""

    xp = cupy

    def __init__(self):
        self.id = cupy.cuda.runtime.getDevice()
        properties = cupy.cuda.runtime.getDeviceProperties(self.id)
        self.multiprocessors = int(properties["multiProcessorCount"])
        self.name = properties["name"].decode() if isinstance(properties["name"], bytes) else str(properties["name"])
        # uploads to the device tier run here, beside the compute (colibri_cuda.tier)
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self.uploader = StagingUploader(self.copy_stream)

    # -- arrays ------------------------------------------------------------------------
    def upload(self, host: np.ndarray):
        return cupy.asarray(host)

    def to_host(self, x) -> np.ndarray:
        """A copy on the host: waits for the work queued on the current stream that
        makes ``x``, nothing else."""
        return cupy.asnumpy(x, stream=cupy.cuda.get_current_stream())

    def pointer(self, x) -> int:
        return int(x.data.ptr)

    def errstate(self):
        """Floating-point warnings off: CuPy raises none (numpy's stand-in silences them)."""
        return contextlib.nullcontext()

    def upload_async(self, arrays: list[np.ndarray]):
        """(device arrays, the event that marks their copies' end): see StagingUploader."""
        return self.uploader.upload(arrays)

    def memory(self) -> int:
        """Bytes of the device's memory."""
        return int(cupy.cuda.runtime.memGetInfo()[1])

    # -- streams and events -------------------------------------------------------------
    def compute_stream(self):
        return cupy.cuda.get_current_stream()

    def wait(self, event) -> None:
        """Make the compute stream wait for ``event`` (an upload's end) without the host
        waiting: no device-wide synchronisation."""
        cupy.cuda.get_current_stream().wait_event(event)


STAGING_SLOTS = 4  # uploads in flight at once; a fifth waits for the oldest copy to end
ALIGN = 256  # bytes: each array's place in a staging buffer


class StagingUploader:
    """Host-to-device copies through pinned staging buffers on a copy stream of their own.

    ``upload(arrays)`` allocates the device arrays (from CuPy's pool, on the compute
    stream, so memory freed by the compute is reused only after the work queued before
    it), copies the host arrays into a pinned staging buffer, queues the copies on the
    copy stream after the compute work queued so far, and returns the arrays with the
    event that marks the copies' end. The caller makes the compute stream wait for that
    event before it reads them (``CupyDevice.wait``). The host waits only when it reuses
    a staging buffer whose copy is still in flight: never for the whole device."""

    def __init__(self, copy_stream):
        self.copy_stream = copy_stream
        self._buffers: list = [None] * STAGING_SLOTS  # (pinned memory, capacity, event of its last copy)
        self._next = 0

    @staticmethod
    def _layout(arrays) -> tuple[list[int], int]:
        offsets, size = [], 0
        for a in arrays:
            offsets.append(size)
            size += -(-a.nbytes // ALIGN) * ALIGN
        return offsets, size

    def _staging(self, size: int):
        slot = self._next
        self._next = (slot + 1) % STAGING_SLOTS
        held = self._buffers[slot]
        if held is not None and held[2] is not None:
            held[2].synchronize()  # this buffer's previous copy must have left it
        if held is None or held[1] < size:
            held = [cupy.cuda.alloc_pinned_memory(size), size, None]
            self._buffers[slot] = held
        return held

    def upload(self, arrays: list[np.ndarray]):
        offsets, size = self._layout(arrays)
        staging = self._staging(max(size, ALIGN))
        host = np.frombuffer(staging[0], dtype=np.uint8, count=staging[1])
        compute = cupy.cuda.get_current_stream()
        out = [cupy.empty(a.shape, dtype=a.dtype) for a in arrays]
        self.copy_stream.wait_event(compute.record())
        for a, offset, dst in zip(arrays, offsets, out):
            view = host[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
            np.copyto(view, a)
            dst.set(view, stream=self.copy_stream)
        event = self.copy_stream.record()
        staging[2] = event
        return out, event

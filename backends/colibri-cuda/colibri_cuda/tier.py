"""The CUDA device tier: experts in VRAM (``--vram``), uploaded asynchronously.

An expert reaching the tier (from the RAM tier, in its host form) is laid out for the
kernels on the host (``colibri_cuda.layouts``), copied through pinned staging buffers on
the device's copy stream, and held as ``PackedWeight``s that carry the copies' event:
the backend makes the compute stream wait for it the first time the expert is used
(``CudaBackend._ready``). Nothing on this path synchronises the device. Host float32
matrices (kinds the backend decodes) travel the same way, as layout "f32".

The pinned hot set and the LRU are the generic tier's (``CachedTier``); only how an
expert is made resident differs.
"""

from __future__ import annotations

import numpy as np

from colibri_core.experts.tiers import DeviceTier, ExpertWeights
from colibri_core.formats.base import QuantTensor
from colibri_core.formats.reference import dequantize
from colibri_cuda import layouts
from colibri_cuda.layouts import HostPacked, PackedWeight


def host_layout(backend, w) -> HostPacked:
    """The kernels' layout of one host matrix: packed when the backend computes with its
    kind, else float32."""
    if isinstance(w, QuantTensor):
        if backend.has_kernel(w.kind):
            return layouts.host_pack(w)
        w = dequantize(w)
    w = np.ascontiguousarray(w, dtype=np.float32)
    return HostPacked("f32", tuple(w.shape), w, None)


class CudaDeviceTier(DeviceTier):
    def hold(self, weights: ExpertWeights) -> ExpertWeights:
        if all(isinstance(a, PackedWeight) for a in weights.arrays.values()):
            return weights  # already on the device
        roles = list(weights.arrays)
        packed = [host_layout(self.backend, weights.arrays[role]) for role in roles]
        host_arrays = [a for p in packed for a in p.arrays()]
        device_arrays, event = self.backend.device.upload_async(host_arrays)
        arrays, position = {}, 0
        for role, p in zip(roles, packed):
            data = device_arrays[position]
            scales = device_arrays[position + 1] if p.scales is not None else None
            position += 1 if p.scales is None else 2
            arrays[role] = PackedWeight(p.kind, p.shape, data, scales, p.p0, p.p1, ready=event)
        return ExpertWeights(arrays, sum(a.nbytes for a in arrays.values()))

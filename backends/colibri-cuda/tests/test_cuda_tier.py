"""The CUDA device tier's logic on the numpy stand-in: experts reaching it are laid out
for the kernels and uploaded in one asynchronous batch per expert; the compute waits for
that upload (once per matrix) before it reads them; the values are unchanged; the LRU
and pinned set are the generic tier's."""

import numpy as np

from colibri_core.compute.reference import ReferenceBackend
from colibri_core.experts.tiers import ExpertWeights
from colibri_core.formats.reference import dequantize
from colibri_core.testing.backend_kit import pack
from colibri_cuda.backend import CudaBackend
from colibri_cuda.layouts import PackedWeight
from colibri_cuda.tier import CudaDeviceTier
from cuda_stand_ins import MirrorKernels, NumpyDevice


def backend_and_device():
    device = NumpyDevice()
    return CudaBackend(device=device, kernels=MirrorKernels(device)), device


def host_expert(rng, kind):
    w = {role: (rng.standard_normal(shape) * 0.1).astype(np.float32)
         for role, shape in (("gate", (24, 96)), ("up", (24, 96)), ("down", (96, 24)))}
    arrays = w if kind == "f32" else {role: pack(kind, a) for role, a in w.items()}
    return ExpertWeights(arrays, sum(int(a.nbytes) for a in arrays.values()))


def test_the_backend_names_its_tier():
    assert CudaBackend.device_tier == "colibri_cuda.tier:CudaDeviceTier"


def test_an_expert_is_uploaded_once_and_waited_for_once_per_matrix():
    backend, device = backend_and_device()
    tier = CudaDeviceTier(1, 3, backend)
    rng = np.random.default_rng(0)
    for e, kind in enumerate(("q4", "mxfp4", "f32")):
        expert = host_expert(rng, kind)
        uploads = device.uploads
        held = tier.put(0, e, expert)
        assert device.uploads == uploads + 1, "one upload per expert"
        assert all(isinstance(held[r], PackedWeight) and held[r].ready is not None for r in ("gate", "up", "down"))
        assert {held[r].kind for r in ("gate", "up", "down")} == {kind}
        assert held.nbytes == sum(held[r].nbytes for r in ("gate", "up", "down"))
        event = held["gate"].ready
        x = rng.standard_normal((1, 96)).astype(np.float32)
        waited = len(device.waited)
        out = backend.routed_experts(x, np.array([[0]]), np.array([[1.0]], np.float32), lambda e: held)
        assert device.waited[waited:] == [event] * 3, "the compute waits for the upload before reading"
        backend.routed_experts(x, np.array([[0]]), np.array([[1.0]], np.float32), lambda e: held)
        assert len(device.waited) == waited + 3, "and only the first time"
        truth = {r: dequantize(a) if not isinstance(a, np.ndarray) else a for r, a in expert.arrays.items()}
        want = ReferenceBackend().routed_experts(x, np.array([[0]]), np.array([[1.0]], np.float32), lambda e: truth)
        np.testing.assert_allclose(out, want, atol=1e-5 * np.abs(want).max())


def test_the_lru_keeps_its_slots():
    backend, device = backend_and_device()
    tier = CudaDeviceTier(1, 2, backend)
    rng = np.random.default_rng(1)
    for e in range(3):
        tier.put(0, e, host_expert(rng, "q4"))
    assert tier.cached(0) == [1, 2] and tier.evictions == 1
    assert tier.resident_bytes == sum(tier.lookup(0, e).nbytes for e in (1, 2))
    assert device.uploads == 3
    tier.put(0, 2, host_expert(rng, "q4"))
    assert device.uploads == 3, "a held expert is not uploaded again"

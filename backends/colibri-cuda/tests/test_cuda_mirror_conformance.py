"""The CUDA backend's Python code, run on numpy with numpy mirrors of its kernels, through
the whole conformance kit: every dispatch (packed products by matrix-vector kernel or by
decode-then-GEMM, token slices, one token's experts in fused windows, attention by the
split kernel or by array operations) and every operation written in array code meets the
reference. What only a GPU can check (that the CUDA C computes what its mirror does) is
left to the same kit run on ``cuda`` (tests/test_backend_conformance.py, gpu_check.sh)."""

import numpy as np
import pytest

from colibri_core.compute.reference import ReferenceBackend
from colibri_core.formats.reference import dequantize
from colibri_core.testing.backend_kit import BackendConformanceSuite, pack
from colibri_cuda import geometry
from colibri_cuda.backend import CudaBackend
from colibri_cuda.layouts import PackedWeight
from cuda_stand_ins import MirrorKernels, NumpyDevice


def mirrored_backend() -> CudaBackend:
    device = NumpyDevice()
    return CudaBackend(device=device, kernels=MirrorKernels(device))


class TestCudaBackendOnNumpyMirrors(BackendConformanceSuite):
    def make_backend(self):
        return mirrored_backend()


@pytest.fixture
def backend():
    return mirrored_backend()


def test_packed_weights_stay_packed_and_take_the_kernel_paths(backend):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 130)).astype(np.float32)
    ref = ReferenceBackend()
    for kind in ("q4", "q8", "mxfp4", "fp8", "bf16"):
        prepared = backend.prepare_weight(pack(kind, w), "linear")
        assert isinstance(prepared, PackedWeight) and prepared.kind == kind
        truth = ref.prepare_weight(pack(kind, w))
        for rows in (1, geometry.GEMV_TOKEN_LIMIT, geometry.GEMV_TOKEN_LIMIT + 1):
            x = rng.standard_normal((rows, 130)).astype(np.float32)
            before = dict(backend.kernels.calls)
            y = backend.linear(x, prepared)
            path = "gemv" if rows <= geometry.GEMV_TOKEN_LIMIT else "dequantize"
            assert backend.kernels.calls.get(path, 0) == before.get(path, 0) + 1, (kind, rows)
            np.testing.assert_allclose(y, x @ truth.T, rtol=1e-5, atol=1e-5 * np.abs(x @ truth.T).max())
        # an embedding or an array is decoded to float32 once
        assert isinstance(backend.prepare_weight(pack(kind, w), "embedding"), np.ndarray)


def test_one_token_experts_run_fused_in_windows(backend):
    rng = np.random.default_rng(1)

    def expert():
        return {role: backend.prepare_weight(pack("q4", rng.standard_normal(shape).astype(np.float32) * 0.1))
                for role, shape in (("gate", (24, 96)), ("up", (24, 96)), ("down", (96, 24)))}

    experts = [expert() for _ in range(6)]
    x = backend.asarray(rng.standard_normal((1, 96)).astype(np.float32))
    indices, weights = np.array([[4, 1, 3]]), np.array([[0.5, 0.3, 0.2]], dtype=np.float32)
    outs = []
    for window in (1, 2, 8):
        before = backend.kernels.calls.get("experts_token", 0)
        outs.append(backend.routed_experts(x, indices, weights, lambda e: experts[e], window))
        assert backend.kernels.calls["experts_token"] - before == -(-3 // window)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_experts_of_mixed_layouts_fall_back_expert_by_expert(backend):
    rng = np.random.default_rng(2)
    prepared, truths = [], []
    for kind in ("q4", "q8"):
        packed = {role: pack(kind, rng.standard_normal(shape).astype(np.float32) * 0.1)
                  for role, shape in (("gate", (24, 96)), ("up", (24, 96)), ("down", (96, 24)))}
        prepared.append({role: backend.prepare_weight(w) for role, w in packed.items()})
        truths.append({role: dequantize(w) for role, w in packed.items()})
    x = rng.standard_normal((1, 96)).astype(np.float32)
    indices, weights = np.array([[1, 0]]), np.array([[0.6, 0.4]], dtype=np.float32)
    before = backend.kernels.calls.get("experts_token", 0)
    out = backend.routed_experts(x, indices, weights, lambda e: prepared[e])
    assert backend.kernels.calls.get("experts_token", 0) == before
    want = ReferenceBackend().routed_experts(x, indices, weights, lambda e: truths[e])
    np.testing.assert_allclose(out, want, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("s,t,start", [(3000, 1, 2999), (2500, 3, 1200), (70, 1, 40)])
def test_split_attention_over_long_sequences(backend, s, t, start):
    """Many splits, some wholly past what a query may see: the combine weighs them 0."""
    rng = np.random.default_rng(s)
    q = rng.standard_normal((t, 8, 32)).astype(np.float32)
    k = rng.standard_normal((2, s, 32)).astype(np.float32)
    v = rng.standard_normal((2, s, 16)).astype(np.float32)
    split = geometry.attention_split(s, 8, t, backend.device.multiprocessors)
    assert split.splits > 1 or s < 2 * geometry.ATTENTION_MIN_CHUNK
    want = ReferenceBackend().attention(q, k, v, start, 0.2)
    got = backend.attention(q, k, v, start, 0.2)
    np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max())


def test_attention_reads_the_kv_cache_views_without_copying(backend):
    """A KV cache's first S positions (a view into a larger capacity) reach the kernel as
    they are; other layouts are made contiguous first."""
    rng = np.random.default_rng(5)
    cache_k, cache_v = (rng.standard_normal((2, 256, d)).astype(np.float32) for d in (16, 8))
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    k, v = cache_k[:, :100], cache_v[:, :100]
    assert backend._kv_rows(k) is k and backend._kv_rows(v) is v
    transposed = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert backend._kv_rows(transposed) is not transposed and backend._kv_rows(transposed).flags.c_contiguous
    want = ReferenceBackend().attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v), 99, 0.25)
    np.testing.assert_allclose(backend.attention(q, k, v, 99, 0.25), want, atol=2e-6 * np.abs(want).max())

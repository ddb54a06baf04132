"""Launches of the CUDA C kernels (``kernels/*.cu``) through CuPy.

Each source is compiled by NVRTC the first time one of its kernels runs
(``cupy.RawModule``; CuPy caches the binary on disk, keyed by the expanded source) and
launched on CuPy's current stream. Shapes, grids and limits come from
``colibri_cuda.geometry``; the layouts from ``colibri_cuda.layouts``. The methods here
are the whole interface between the backend and its kernels: the tests replace this
class by numpy mirrors of the same arithmetic (tests/kernel_mirror.py) to check the
backend's own code without a GPU.

Arguments: arrays are passed as device pointers, ints as int32, floats as float32, an
absent array as a null pointer.
"""

from __future__ import annotations

import functools

import cupy
import numpy as np

from colibri_cuda import geometry
from colibri_cuda.layouts import PackedWeight
from colibri_cuda.sources import source

NULL = np.uint64(0)


@functools.lru_cache(maxsize=None)
def module(name: str) -> "cupy.RawModule":
    return cupy.RawModule(code=source(name), options=("--std=c++17",))


@functools.lru_cache(maxsize=None)
def kernel(file: str, name: str):
    return module(file).get_function(name)


def i32(v: int) -> np.int32:
    return np.int32(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def layout(w) -> tuple[str, object, object, int, int]:
    """(kernel suffix, data, scales or None, p0, p1) of a prepared weight."""
    if isinstance(w, PackedWeight):
        return w.kind, w.data, w.scales, w.p0, w.p1
    return "f32", w, None, 0, 0  # a float32 (N, K) device array


class CudaKernels:
    def __init__(self, device):
        self.device = device

    def _scales(self, scales):
        return NULL if scales is None else scales

    # -- products ----------------------------------------------------------------------
    def gemv(self, w, x):
        """x (T, K) float32 contiguous @ W.T -> (T, N), T <= geometry.GEMV_TOKEN_LIMIT."""
        kind, data, scales, p0, p1 = layout(w)
        n, k = w.shape
        t = x.shape[0]
        y = cupy.empty((t, n), dtype=cupy.float32)
        grid, block = geometry.gemv_grid(n)
        fn = kernel("gemv.cu", f"gemv_{kind}")
        for first, end in geometry.token_slices(t):
            fn(grid, block, (data, self._scales(scales), x[first:end], y[first:end], i32(n), i32(k), i32(p0), i32(p1),
                             i32(end - first)))
        return y

    def dequantize(self, w: PackedWeight):
        """W (N, K) float32 decoded on the device."""
        n, k = w.shape
        out = cupy.empty((n, k), dtype=cupy.float32)
        grid, block = geometry.elementwise_grid(n * k)
        kernel("gemv.cu", f"dequantize_{w.kind}")(grid, block, (w.data, self._scales(w.scales), out, i32(n), i32(k),
                                                                i32(w.p0), i32(w.p1)))
        return out

    def experts_token(self, x, experts: list, weights: np.ndarray, out) -> None:
        """out (1, H) += sum_e weights[e] * down_e(silu(gate_e(x)) * up_e(x)) for the
        experts of one token, in the order given; every expert's gate and up share one
        layout, every down another (``fused_layouts`` says whether they do)."""
        gate_kind, _, _, gp0, gp1 = layout(experts[0]["gate"])
        down_kind, _, _, dp0, dp1 = layout(experts[0]["down"])
        count = len(experts)
        inter, hidden = experts[0]["gate"].shape
        ptr = self.device.pointer
        table = []
        for role in ("gate", "up"):
            parts = [layout(e[role]) for e in experts]
            table += [ptr(p[1]) for p in parts] + [0 if p[2] is None else ptr(p[2]) for p in parts]
        down = [layout(e["down"]) for e in experts]
        down_table = [ptr(p[1]) for p in down] + [0 if p[2] is None else ptr(p[2]) for p in down]
        tables = cupy.asarray(np.array(table + down_table, dtype=np.uint64))
        h = cupy.empty((count, inter), dtype=cupy.float32)
        grid, block = geometry.gemv_grid(inter)
        kernel("experts.cu", f"experts_gate_up_{gate_kind}")(
            (grid[0], count, 1), block, (tables, x, h, i32(count), i32(inter), i32(hidden), i32(gp0), i32(gp1)))
        scale = cupy.asarray(np.ascontiguousarray(weights, dtype=np.float32))
        grid, block = geometry.gemv_grid(hidden)
        kernel("experts.cu", f"experts_down_{down_kind}")(
            grid, block, (tables[4 * count:], h, scale, out, i32(count), i32(hidden), i32(inter), i32(dp0), i32(dp1)))

    # -- attention and position ----------------------------------------------------------
    def attention(self, q, k, v, start: int, scale: float):
        """q contiguous; k, v (Hkv, S, D) with contiguous rows (``rows_contiguous``), as
        the KV cache's views are: passed with their head strides, not copied."""
        t, hq, d = q.shape
        hkv, s, dv = v.shape
        split = geometry.attention_split(s, hq, t, self.device.multiprocessors)
        partial_o = cupy.empty((t, hq, split.splits, dv), dtype=cupy.float32)
        partial_ml = cupy.empty((t, hq, split.splits, 2), dtype=cupy.float32)
        kernel("attention.cu", "attention_split")(
            (split.splits, hq, t), (geometry.ATTENTION_THREADS, 1, 1),
            (q, k, v, partial_o, partial_ml, i32(t), i32(hq), i32(hkv), i32(s), i32(d), i32(dv), i32(start),
             i32(split.chunk), f32(scale), np.int64(k.strides[0] // 4), np.int64(v.strides[0] // 4)))
        out = cupy.empty((t, hq, dv), dtype=cupy.float32)
        kernel("attention.cu", "attention_combine")(
            (hq, t, 1), (geometry.ATTENTION_THREADS, 1, 1), (partial_o, partial_ml, out, i32(hq), i32(dv),
                                                             i32(split.splits)))
        return out

    def rope(self, x, cos, sin, rotary_dim: int, interleaved: bool):
        t, h, dh = x.shape
        out = cupy.empty_like(x)
        grid, block = geometry.elementwise_grid(t * h * dh)
        name = "rope_interleaved" if interleaved else "rope_half"
        kernel("rope.cu", name)(grid, block, (x, cos, sin, out, i32(t), i32(h), i32(dh), i32(rotary_dim)))
        return out

    # -- recurrent layers -------------------------------------------------------------------
    def gated_delta_step(self, q, k, v, g, beta, state):
        """(out (T, Hv, Dv), the new state); ``state`` itself is left as it was."""
        t, hk, dk = q.shape
        hv, dv = v.shape[1], v.shape[2]
        new_state = state.copy()
        out = cupy.empty((t, hv, dv), dtype=cupy.float32)
        grid, block = geometry.delta_grid(hv, dv)
        kernel("delta.cu", "gated_delta_step")(grid, block, (q, k, v, g, beta, new_state, out, i32(t), i32(hk), i32(hv),
                                                             i32(dk), i32(dv)))
        return out, new_state

    # -- norms and the router --------------------------------------------------------------
    def rms_norm(self, x, weight, eps: float):
        rows, c = x.shape
        out = cupy.empty_like(x)
        kernel("norms.cu", "rms_norm")((rows, 1, 1), (geometry.NORM_THREADS, 1, 1),
                                       (x, NULL if weight is None else weight, out, i32(c), f32(eps)))
        return out

    def layer_norm(self, x, weight, bias, eps: float):
        rows, c = x.shape
        out = cupy.empty_like(x)
        kernel("norms.cu", "layer_norm")((rows, 1, 1), (geometry.NORM_THREADS, 1, 1),
                                         (x, NULL if weight is None else weight, NULL if bias is None else bias, out,
                                          i32(c), f32(eps)))
        return out

    def softmax_top_k(self, logits, k: int, renormalise: bool):
        """(T, 2, k) float32: the chosen experts' indices, then their weights."""
        rows, experts = logits.shape
        out = cupy.empty((rows, 2, k), dtype=cupy.float32)
        kernel("router.cu", "softmax_top_k")((rows, 1, 1), (geometry.ROUTER_THREADS, 1, 1),
                                             (logits, out, i32(experts), i32(k), i32(int(renormalise))))
        return out

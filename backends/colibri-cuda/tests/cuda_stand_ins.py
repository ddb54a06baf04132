"""numpy stand-ins for what needs a GPU, so the CUDA backend's own Python code (dispatch,
layouts, token slices, expert windows, the device tier) runs and is tested here:

- ``NumpyDevice``: ``colibri_cuda.device.CupyDevice`` on numpy (uploads copy, events are
  tokens, the waits are recorded);
- ``MirrorKernels``: ``colibri_cuda.kernels.CudaKernels`` in numpy, each method computing
  what its kernel computes the way the kernel computes it (the kernels' decodes from
  ``colibri_cuda.layouts``, the same token slices, the attention's splits and combine,
  the router's rounds, the experts' order and rounding).

Imported by the test modules (a conftest.py here would shadow the core tests' one)."""

from __future__ import annotations

import numpy as np

from colibri_cuda import geometry, layouts
from colibri_cuda.layouts import HostPacked, PackedWeight


class Event:
    def __init__(self, arrays):
        self.arrays = arrays


class NumpyDevice:
    xp = np
    multiprocessors = 4

    def __init__(self, memory: int = 24 << 30):
        self._memory = memory
        self.waited: list = []  # events the compute stream was made to wait for
        self.uploads = 0

    def upload(self, host):
        return np.array(host, copy=True)

    def to_host(self, x):
        return np.array(x, copy=True)

    def errstate(self):
        return np.errstate(over="ignore", divide="ignore", invalid="ignore")

    def memory(self):
        return self._memory

    def wait(self, event):
        self.waited.append(event)

    def upload_async(self, arrays):
        self.uploads += 1
        out = [np.array(a, copy=True) for a in arrays]
        return out, Event(out)


def host_packed(w) -> HostPacked:
    """A prepared weight's layout, back on the host, for the mirrored decode."""
    if isinstance(w, PackedWeight):
        return HostPacked(w.kind, w.shape, w.data, w.scales, w.p0, w.p1)
    return HostPacked("f32", tuple(w.shape), w, None)


def decoded(w) -> np.ndarray:
    p = host_packed(w)
    return p.data if p.kind == "f32" else layouts.decode(p)


class MirrorKernels:
    def __init__(self, device=None):
        self.device = device
        self.calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def gemv(self, w, x):
        self._count("gemv")
        assert x.dtype == np.float32 and x.flags.c_contiguous and x.shape[0] <= geometry.GEMV_TOKEN_LIMIT
        weight = decoded(w)
        y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
        for first, end in geometry.token_slices(x.shape[0]):
            y[first:end] = x[first:end] @ weight.T
        return y

    def dequantize(self, w):
        self._count("dequantize")
        return decoded(w)

    def experts_token(self, x, experts, weights, out):
        self._count("experts_token")
        assert x.shape[0] == 1 and out.shape == (1, experts[0]["down"].shape[0])
        h = []
        for e in experts:
            g = x[0] @ decoded(e["gate"]).T
            u = x[0] @ decoded(e["up"]).T
            with np.errstate(over="ignore"):
                h.append(g / (np.float32(1.0) + np.exp(-g)) * u)
        total = out[0].copy()
        for e, h_e, w in zip(experts, h, np.asarray(weights, dtype=np.float32)):
            total = total + (h_e @ decoded(e["down"]).T) * w  # two roundings, as __fadd_rn(__fmul_rn)
        out[0] = total

    def attention(self, q, k, v, start, scale):
        self._count("attention")
        t, hq, d = q.shape
        hkv, s, dv = v.shape
        split = geometry.attention_split(s, hq, t, self.device.multiprocessors if self.device else 4)
        out = np.empty((t, hq, dv), dtype=np.float32)
        for ti in range(t):
            end_visible = start + ti + 1
            for h in range(hq):
                kv = h // (hq // hkv)
                ms, ls, os_ = [], [], []
                for c in range(split.splits):
                    first, end = c * split.chunk, min(s, (c + 1) * split.chunk)
                    seen = min(end, end_visible)
                    if seen <= first:
                        ms.append(-np.inf), ls.append(np.float32(0)), os_.append(np.zeros(dv, np.float32))
                        continue
                    scores = (k[kv, first:seen] @ q[ti, h]) * np.float32(scale)
                    m = scores.max()
                    p = np.exp(scores - m)
                    ms.append(m), ls.append(p.sum(dtype=np.float32)), os_.append(p @ v[kv, first:seen])
                top = max(ms)
                weights = [np.exp(m - top) if l > 0 else np.float32(0) for m, l in zip(ms, ls)]
                total = sum(w * l for w, l in zip(weights, ls))
                out[ti, h] = sum(w * o for w, o in zip(weights, os_)) / total
        return out

    def rope(self, x, cos, sin, rotary_dim, interleaved):
        self._count("rope")
        half = rotary_dim // 2
        out = x.copy()
        c, s = cos[:, None, :], sin[:, None, :]
        if interleaved:
            first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
            out[..., :half] = first * c[..., :half] - second * s[..., :half]
            out[..., half:rotary_dim] = second * c[..., :half] + first * s[..., :half]
        else:
            out[..., :half] = x[..., :half] * c[..., :half] - x[..., half:rotary_dim] * s[..., :half]
            out[..., half:rotary_dim] = x[..., half:rotary_dim] * c[..., half:rotary_dim] + x[..., :half] * s[..., half:rotary_dim]
        return out

    def gated_delta_step(self, q, k, v, g, beta, state):
        self._count("gated_delta_step")
        t, hk, dk = q.shape
        hv = v.shape[1]
        s = state.copy()  # (Hv, Dk, Dv): the kernel's thread (h, j) owns s[h, :, j]
        out = np.empty((t, hv, v.shape[2]), dtype=np.float32)
        for ti in range(t):
            for h in range(hv):
                kh = h // (hv // hk)
                s[h] *= np.exp(g[ti, h])
                memory = k[ti, kh] @ s[h]
                delta = (v[ti, h] - memory) * beta[ti, h]
                s[h] += k[ti, kh][:, None] * delta[None, :]
                out[ti, h] = q[ti, kh] @ s[h]
        return out, s

    def rms_norm(self, x, weight, eps):
        self._count("rms_norm")
        y = x * (np.float32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)))
        return y * weight if weight is not None else y

    def layer_norm(self, x, weight, bias, eps):
        self._count("layer_norm")
        centred = x - np.mean(x, axis=-1, keepdims=True)
        y = centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + np.float32(eps))
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    def softmax_top_k(self, logits, k, renormalise):
        self._count("softmax_top_k")
        rows, experts = logits.shape
        assert geometry.router_fits(experts, k)
        out = np.empty((rows, 2, k), dtype=np.float32)
        for r in range(rows):
            e = np.exp(logits[r] - logits[r].max())
            probs = e / e.sum()
            kept = np.float32(0)
            for slot in range(k):
                index = int(np.argmax(probs))  # the first of equals: the lower index
                out[r, 0, slot], out[r, 1, slot] = index, probs[index]
                kept += probs[index]
                probs[index] = -1.0
            if renormalise:
                out[r, 1] /= kept
        return out


def mirrored_backend():
    """The CUDA backend's Python code on numpy, with mirrors of its kernels."""
    from colibri_cuda.backend import CudaBackend

    device = NumpyDevice()
    return CudaBackend(device=device, kernels=MirrorKernels(device))


class MirrorPlugin:
    """Registers ``mirrored_backend`` as backend "cuda-mirror" (in-process, for tests)."""

    from colibri_core import hookimpl

    @hookimpl
    def colibri_register_backends(self, register):
        from colibri_core.plugins.registry import BackendSpec

        register(BackendSpec("cuda-mirror", "cuda_stand_ins:mirrored_backend", device="cpu",
                             description="colibri-cuda's Python code on numpy with mirrors of its kernels (tests)"))

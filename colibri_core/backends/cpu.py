"""The numpy reference backend: float32 throughout, matmuls through BLAS."""

from __future__ import annotations

import numpy as np

from ..backend import Backend


class CpuBackend(Backend):
    name = "cpu"

    def asarray(self, host_f32):
        return np.ascontiguousarray(host_f32, dtype=np.float32)

    def to_numpy(self, x):
        return x

    def zeros(self, shape):
        return np.zeros(shape, dtype=np.float32)

    def embedding(self, table, ids):
        return table[np.asarray(ids, dtype=np.int64)]

    def linear(self, x, weight, bias=None):
        y = x @ weight.T
        if bias is not None:
            y += bias
        return y

    def rms_norm(self, x, weight, eps):
        variance = np.mean(np.square(x), axis=-1, keepdims=True)
        y = x * (1.0 / np.sqrt(variance + np.float32(eps)))
        return y * weight if weight is not None else y

    def rope(self, x, cos, sin, rotary_dim):
        cos = cos[:, None, :]
        sin = sin[:, None, :]
        rot = x[..., :rotary_dim]
        half = rotary_dim // 2
        rotated = np.concatenate((-rot[..., half:], rot[..., :half]), axis=-1)
        out = rot * cos + rotated * sin
        if rotary_dim == x.shape[-1]:
            return out
        return np.concatenate((out, x[..., rotary_dim:]), axis=-1)

    def attention(self, q, k, v, start, scale):
        t, hq, d = q.shape
        hkv, s, _ = k.shape
        group = hq // hkv
        qh = q.reshape(t, hkv, group, d).transpose(1, 2, 0, 3)  # (Hkv, G, T, D)
        scores = np.matmul(qh, k[:, None].transpose(0, 1, 3, 2)) * np.float32(scale)  # (Hkv, G, T, S)
        if t > 1 or start + t < s:
            # query i sits at position start + i and sees keys 0..start+i
            visible = np.arange(s)[None, :] <= (start + np.arange(t))[:, None]
            scores = np.where(visible, scores, np.float32(-np.inf))
        probs = self.softmax(scores)
        out = np.matmul(probs, v[:, None])  # (Hkv, G, T, Dv)
        return out.transpose(2, 0, 1, 3).reshape(t, hq, v.shape[-1])

    def clip(self, x, limit):
        return np.clip(x, -limit, limit)

    def silu_mul(self, gate, up):
        # silu(g) = g * sigmoid(g), written as g / (1 + exp(-g)); exp may overflow to inf
        # for very negative g, which correctly gives -0.
        with np.errstate(over="ignore"):
            return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def sigmoid(self, x):
        with np.errstate(over="ignore"):
            return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))

    def softmax(self, x):
        m = np.max(x, axis=-1, keepdims=True)
        e = np.exp(x - m)
        return e / np.sum(e, axis=-1, keepdims=True)

    def routed_experts(self, x, indices, weights, fetch):
        out = np.zeros_like(x)
        for e in np.unique(indices):  # ascending expert ids: a fixed reduction order
            rows, slots = np.nonzero(indices == e)
            w = fetch(int(e))
            y = self.swiglu_expert(x[rows], w["gate"], w["up"], w["down"])
            out[rows] += y * weights[rows, slots][:, None]
        return out

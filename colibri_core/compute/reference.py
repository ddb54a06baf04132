"""The reference backend: every operation of the contract in plain numpy float32.

It is the yardstick, not a product: the CPU backend is this plus compiled kernels
(``CpuBackend(kernels=False)`` computes exactly this), and the conformance kit checks
every backend against it op by op. Its arrays are numpy arrays, so ``to_host`` costs
nothing.
"""

from __future__ import annotations

import numpy as np

from colibri_core.compute import composites, host
from colibri_core.compute.backend import Backend, allocated_dtype
from colibri_core.formats.base import QuantTensor
from colibri_core.formats.reference import dequantize

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "uint8": np.uint8}


class ReferenceBackend(Backend):
    name = "reference"

    # -- memory ------------------------------------------------------------------------
    def asarray(self, host, dtype="float32"):
        return np.ascontiguousarray(host, dtype=allocated_dtype(NUMPY_DTYPES, dtype))

    def zeros(self, shape, dtype="float32"):
        return np.zeros(shape, dtype=allocated_dtype(NUMPY_DTYPES, dtype))

    def _to_host(self, x):
        return np.asarray(x)

    def prepare_weight(self, w, use="linear"):
        if isinstance(w, QuantTensor):  # the reference computes in float32: decode once
            return dequantize(w)
        return self.asarray(w)

    def weight_nbytes(self, kind, shape, stored_nbytes):
        return 4 * int(np.prod(shape, dtype=np.int64))

    # -- dense operations --------------------------------------------------------------
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

    def concat(self, arrays, axis):
        return np.concatenate(arrays, axis=axis)

    # -- primitives ----------------------------------------------------------------------
    def exp(self, x):
        with np.errstate(over="ignore"):
            return np.exp(x)

    def maximum(self, x, floor):
        return np.maximum(x, np.float32(floor))

    def matmul(self, a, b):
        return np.matmul(a, b)

    def reduce_sum(self, x):
        return np.sum(x, axis=-1, keepdims=True)

    def reduce_max(self, x):
        return np.max(x, axis=-1, keepdims=True)

    def take_rows(self, x, rows):
        return x[rows]

    def add_rows(self, out, rows, y, scale):
        out[rows] += y * scale[:, None]
        return out

    def softmax_top_k(self, x, weight, k, renormalise, bias=None):
        return host.softmax_top_k(self.router_logits(x, weight, bias), k, renormalise)

    def router_logits(self, x, weight, bias=None):
        return self.linear(x, weight, bias).astype(np.float32, copy=False)  # on the host already: no sync

    # -- MLA, DSA and interleaved RoPE ------------------------------------------------
    def layer_norm(self, x, weight, bias, eps):
        mean = np.mean(x, axis=-1, keepdims=True)
        centred = x - mean
        variance = np.mean(np.square(centred), axis=-1, keepdims=True)
        y = centred / np.sqrt(variance + np.float32(eps))
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    def rope_interleaved(self, x, cos, sin, rotary_dim):
        half = rotary_dim // 2
        cos = cos[:, None, :half]
        sin = sin[:, None, :half]
        first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out = np.concatenate((first * cos - second * sin, second * cos + first * sin), axis=-1)
        if rotary_dim == x.shape[-1]:
            return out
        return np.concatenate((out, x[..., rotary_dim:]), axis=-1)

    def mla_expand(self, q_nope, q_rot, latent, k_rot, kv_b, nope_dim, v_dim):
        t, h, _ = q_nope.shape
        s, rope = k_rot.shape
        kv = (latent @ kv_b.T).reshape(s, h, nope_dim + v_dim).transpose(1, 0, 2)  # (H, S, nope+v)
        keys = np.empty((h, s, nope_dim + rope), dtype=np.float32)
        keys[..., :nope_dim] = kv[..., :nope_dim]
        keys[..., nope_dim:] = k_rot[None]
        q = np.concatenate((q_nope, q_rot), axis=-1)
        return q, keys, np.ascontiguousarray(kv[..., nope_dim:])

    @staticmethod
    def _kv_b_heads(kv_b, n_heads, nope_dim, v_dim):
        return kv_b.reshape(n_heads, nope_dim + v_dim, kv_b.shape[-1])  # (H, nope+v, rank), a view

    def mla_absorb_query(self, q_nope, kv_b, nope_dim, v_dim):
        w = self._kv_b_heads(kv_b, q_nope.shape[1], nope_dim, v_dim)
        out = np.matmul(q_nope.transpose(1, 0, 2), w[:, :nope_dim, :])  # (H, T, rank)
        return np.ascontiguousarray(out.transpose(1, 0, 2))

    def mla_attention(self, q_lat, q_rot, latent, k_rot, start, scale, selected=None):
        t, h, rank = q_lat.shape
        s = latent.shape[0]
        scores = (np.matmul(q_lat, latent.T) + np.matmul(q_rot, k_rot.T)) * np.float32(scale)  # (T, H, S)
        visible = self._visible(t, s, start, selected)
        if visible is not None:
            scores = np.where(visible[:, None, :], scores, np.float32(-np.inf))
        return np.matmul(self.softmax(scores), latent)  # (T, H, rank)

    def mla_absorb_output(self, o_lat, kv_b, nope_dim, v_dim):
        w = self._kv_b_heads(kv_b, o_lat.shape[1], nope_dim, v_dim)
        out = np.matmul(o_lat.transpose(1, 0, 2), w[:, nope_dim:, :].transpose(0, 2, 1))  # (H, T, v)
        return np.ascontiguousarray(out.transpose(1, 0, 2))

    @staticmethod
    def _visible(t, s, start, selected=None):
        """(T, S) bool: what each query may see (causal, and the selection if any); None
        when every query sees every key."""
        return composites.causal_selected_visible(t, s, start, selected)  # the selection is a host array here

    def sparse_attention(self, q, k, v, start, scale, selected):
        t, hq, d = q.shape
        hkv, s, _ = k.shape
        group = hq // hkv
        qh = q.reshape(t, hkv, group, d).transpose(1, 2, 0, 3)  # (Hkv, G, T, D)
        scores = np.matmul(qh, k[:, None].transpose(0, 1, 3, 2)) * np.float32(scale)  # (Hkv, G, T, S)
        scores = np.where(self._visible(t, s, start, selected), scores, np.float32(-np.inf))
        out = np.matmul(self.softmax(scores), v[:, None])  # (Hkv, G, T, Dv)
        return out.transpose(2, 0, 1, 3).reshape(t, hq, v.shape[-1])

    def dsa_index_scores(self, q, k, weights, scale, start):
        t = q.shape[0]
        s = k.shape[0]
        per_head = np.maximum(np.matmul(q, k.T) * np.float32(scale), np.float32(0))  # (T, Hi, S)
        scores = np.matmul(weights[:, None, :], per_head)[:, 0, :]  # (T, S)
        visible = self._visible(t, s, start)
        if visible is not None:
            scores = np.where(visible, scores, np.float32(-np.inf))
        return scores

    def top_k(self, scores, k):
        return host.top_k_indices(scores, k)

    # -- recurrent (linear-attention) layers -------------------------------------------
    def silu(self, x):
        with np.errstate(over="ignore"):
            return x / (np.float32(1.0) + np.exp(-x))

    def softplus(self, x):
        with np.errstate(over="ignore"):
            return np.where(x > np.float32(20.0), x, np.log1p(np.exp(np.minimum(x, np.float32(20.0))))).astype(np.float32)

    def l2_norm(self, x, eps):
        return x * (np.float32(1.0) / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps)))

    def causal_conv1d(self, x, weight, state):
        t, width = x.shape[0], weight.shape[1]
        full = np.concatenate((state, x), axis=0)  # (K-1+T, C)
        out = full[0:t] * weight[:, 0]
        for j in range(1, width):
            out += full[j : j + t] * weight[:, j]
        return out, np.ascontiguousarray(full[t:])

    def gated_delta_chunked(self, q, k, v, g, beta, state, chunk_size):
        return host.delta_chunked(np, np.errstate(over="ignore"), q, k, v, g, beta, state, chunk_size)

    def gated_delta_step(self, q, k, v, g, beta, state):
        # one decay per head is the per-channel rule with the decay repeated over the key
        # channels: the same products, bit for bit
        g = np.broadcast_to(np.asarray(g, dtype=np.float32)[..., None], (*g.shape, k.shape[-1]))
        return host.delta_channel_step(q, k, v, g, beta, state)

    def gated_delta_channel_chunked(self, q, k, v, g, beta, state, chunk_size):
        return host.delta_channel_chunked(q, k, v, g, beta, state, chunk_size)

    def gated_delta_channel_step(self, q, k, v, g, beta, state):
        return host.delta_channel_step(q, k, v, g, beta, state)

    def attention_relative_bias(self, q, k, v, start, scale, rel, table, window=None):
        return host.relative_bias_attention(q, k, v, start, scale, rel, table, window)

    def sinkhorn(self, x, iters, eps):
        return host.sinkhorn(x, iters, eps)

    # the composites' plain numpy forms: the yardstick the kit checks composites against
    def windowed_attention(self, q, k, v, start, scale, window=None, sinks=None):
        if window is None and sinks is None:
            return self.attention(q, k, v, start, scale)
        return host.windowed_attention(q, k, v, start, scale, window, sinks)

    def masked_attention(self, q, k, v, scale, visible, sinks=None):
        return host.masked_attention(q, k, v, scale, visible, sinks)

    def grouped_linear(self, x, weight, groups):
        return host.grouped_linear(x, weight, groups)

    def gated_activation(self, gate, up, act):
        if act.plain:
            return self.silu_mul(gate, up)
        return host.gated_activation(gate, up, act)

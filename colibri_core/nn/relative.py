"""Attention with a hidden-state-conditioned relative position bias instead of RoPE
(Inkling, transformers: models/inkling ``InklingAttention``).

Per layer: q, k, v and r projections; k and v through short convolutions (``ShortConv``,
with their residual); q and k RMS-normalised per head; scores scaled by ``scale``
(Inkling: 1 / head_dim, q and k being normalised). Each token's r (Hq, R) mixes a learned
bank of bias-by-distance profiles ``table`` (R, E) into one bias per head and backward
distance 0..E-1 (zero beyond), added to the scores (``Backend.attention_relative_bias``).
Options: a sliding ``window`` (the cache keeps the last positions only,
``SlidingKVCache``) and log-length scaling (``log_scaling = (n_floor, alpha)``: query at
position p has q and its bias multiplied by tau = 1 + alpha * log(max((p + 1) / n_floor,
1)), computed in float32 as transformers does)."""

from __future__ import annotations

import numpy as np

from colibri_core.nn.cache import SlidingKVCache, attention_cache
from colibri_core.nn.layers import Linear, RMSNorm, Step
from colibri_core.nn.shortconv import ShortConv
from colibri_core.nn.weights import Param


class RelativeBiasAttention:
    """``table`` is the bank (R, E), read as an array by the attention op (which mixes it
    there, per sequence: a batched step computes each row's bias as a one-row step
    does). The layer's state slots: ``kv`` and those of the k and v convolutions."""

    def __init__(self, *, layer: int, q: Linear, k: Linear, v: Linear, r: Linear, o: Linear, n_heads: int,
                 n_kv_heads: int, head_dim: int, table: Param, q_norm: RMSNorm, k_norm: RMSNorm,
                 k_conv: ShortConv | None = None, v_conv: ShortConv | None = None, scale: float | None = None,
                 window: int | None = None, log_scaling: tuple[int, float] | None = None):
        if n_heads % n_kv_heads:
            raise ValueError(f"query heads {n_heads} are not a multiple of KV heads {n_kv_heads}")
        if window is not None and window < 1:
            raise ValueError(f"attention window must be >= 1, got {window}")
        self.layer = layer
        self.q, self.k, self.v, self.r, self.o = q, k, v, r, o
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.table, self.q_norm, self.k_norm = table, q_norm, k_norm
        self.k_conv, self.v_conv = k_conv, v_conv
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window, self.log_scaling = window, log_scaling

    def state_slots(self, backend, max_len: int) -> dict:
        slots = {"kv": attention_cache(backend, self.n_kv_heads, self.head_dim, self.head_dim, max_len, self.window)}
        for conv in (self.k_conv, self.v_conv):
            if conv is not None:
                slots.update(conv.state_slots(backend, max_len))
        return slots

    def __call__(self, x, step: Step):
        ops = step.ops
        t, h, hkv, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v, r = ops.linears(x, [p.weight.value for p in (self.q, self.k, self.v, self.r)])
        if self.k_conv is not None:
            k = self.k_conv(k, step)
        if self.v_conv is not None:
            v = self.v_conv(v, step)
        q = self.q_norm(q.reshape(t, h, d), step)
        k = self.k_norm(k.reshape(t, hkv, d), step)
        v = v.reshape(t, hkv, d)
        rel = r.reshape(t, h, r.shape[1] // h)
        if self.log_scaling is not None:  # tau scales the bias through its mixing weights
            tau = ops.asarray(log_scale(step.positions, *self.log_scaling).reshape(t, 1, 1))
            q, rel = q * tau, rel * tau
        state = step.cache.layers[self.layer]["kv"]
        keys, values = state.append(k, v)
        start = state.offset if isinstance(state, SlidingKVCache) else step.start
        out = ops.attention_relative_bias(q, keys, values, start, self.scale, rel, self.table.value, self.window)
        return self.o(out.reshape(t, h * d), step)


def log_scale(positions: np.ndarray, n_floor: int, alpha: float) -> np.ndarray:
    """tau per position, float32: 1 + alpha * log(max((p + 1) / n_floor, 1))."""
    n = (np.asarray(positions) + 1).astype(np.float32)
    return (np.float32(1.0) + np.float32(alpha) * np.log(np.maximum(n / np.float32(n_floor), np.float32(1.0)))).astype(np.float32)

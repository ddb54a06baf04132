"""Mamba-2: a selective state-space token mixer (Nemotron-H, Granite 4 hybrids).

Per token, ``in_proj`` gives a gate z (H*P), the conv input [x (H*P) | B (G*N) | C (G*N)]
and a time step dt (H). The conv input goes through a depthwise causal conv1d (+ bias)
and silu; dt = softplus(dt + dt_bias). Each head h (of H, P channels, reading the B and
C of group h // (H / G)) keeps a (P, N) state S:

    S = exp(dt * A) * S + (dt * x) B^T;   y = S C + D * x      (A = -exp(A_log) < 0)

then out_proj(grouped_rms_norm(y * silu(z)) * w) (transformers' RMSNormGated with
``norm_before_gate=False``: the gate first, then an RMS norm over each of the G groups
of H*P/G channels).

A prompt (several positions) goes through the chunked (SSD) form: within a chunk of
``chunk_size`` positions the outputs are a masked product, the state carried from chunk
to chunk, as transformers' torch chunk scan; dt is clamped to ``dt_limit`` there. A
single decoded token goes through the stepwise form, which, as transformers' (and
mamba_ssm's) selective_state_update, does not clamp dt. Both are the same recurrence to
float32 rounding, so a prompt fed in pieces gives the state fed at once. Everything is
composed of the contract's primitives (matmul, exp, softplus, ...): it runs on every
backend, on its device, without a host round trip.

The state of a sequence is a ``RecurrentState`` of fixed size: the conv's last K-1 inputs
("conv") and S per head ("ssm", (H, P, N)).
"""

from __future__ import annotations

import math

import numpy as np

from colibri_core.compute.composites import broadcast, swap_last
from colibri_core.nn.cache import RecurrentState
from colibri_core.nn.layers import Linear, Step
from colibri_core.nn.weights import Param


class Mamba2Mixer:
    """``in_proj`` (2*H*P + 2*G*N + H, hidden) -> [z | x, B, C | dt]; ``conv_weight``
    (H*P + 2*G*N, K) with optional ``conv_bias``; ``dt_bias``, ``a_neg`` (-exp(A_log)) and
    ``d`` per head (H,); ``norm_weight`` (H*P,) of the gated grouped RMS norm (``eps``);
    ``out_proj``. ``dt_limit``: (low, high) clamp of dt in the chunked form."""

    def __init__(self, *, layer: int, in_proj: Linear, conv_weight: Param, conv_bias: Param | None, dt_bias: Param,
                 a_neg: Param, d: Param, norm_weight: Param, out_proj: Linear, n_heads: int, head_dim: int,
                 n_groups: int, state_size: int, eps: float, chunk_size: int,
                 dt_limit: tuple[float, float] = (0.0, math.inf)):
        if n_heads % n_groups:
            raise ValueError(f"Mamba-2 heads {n_heads} are not a multiple of groups {n_groups}")
        if chunk_size < 1:
            raise ValueError(f"Mamba-2 chunk_size {chunk_size} is not positive")
        self.layer, self.in_proj, self.out_proj = layer, in_proj, out_proj
        self.conv_weight, self.conv_bias, self.dt_bias, self.a_neg, self.d = conv_weight, conv_bias, dt_bias, a_neg, d
        self.norm_weight, self.eps, self.chunk_size = norm_weight, float(eps), int(chunk_size)
        self.n_heads, self.head_dim, self.n_groups, self.state_size = n_heads, head_dim, n_groups, state_size
        self.inner = n_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))

    @property
    def conv_kernel(self) -> int:
        return self.conv_weight.shape[-1]

    def new_state(self, backend, max_len: int) -> RecurrentState:
        return RecurrentState(backend, {"conv": (self.conv_kernel - 1, self.conv_dim),
                                        "ssm": (self.n_heads, self.head_dim, self.state_size)})

    def __call__(self, x, step: Step):
        zxd = self.in_proj(x, step)
        return self._output(self._recur(zxd, step), zxd, step)

    def batched(self, x, step: Step):
        """A batched step: the projections and the norm on all rows, the conv and the
        recurrence per sequence."""
        zxd = self.in_proj(x, step)
        ys = [self._recur(zxd[a:b], seg) for seg, (a, b) in zip(step.segments, step.rows)]
        return self._output(ys[0] if len(ys) == 1 else step.ops.concat(ys, 0), zxd, step)

    def _output(self, y, zxd, step: Step):
        ops = step.ops
        t, g = y.shape[0], self.n_groups
        gated = y * ops.silu(zxd[:, : self.inner])
        normed = ops.rms_norm(gated.reshape(t * g, self.inner // g), None, self.eps).reshape(t, self.inner)
        return self.out_proj(normed * self.norm_weight.value, step)

    def _recur(self, zxd, step: Step):
        """One sequence's rows through the conv and the recurrence: y (T, H*P)."""
        ops = step.ops
        t, h, p, g, n = zxd.shape[0], self.n_heads, self.head_dim, self.n_groups, self.state_size
        state: RecurrentState = step.cache.layers[self.layer]
        xbc, conv = ops.causal_conv1d(zxd[:, self.inner : self.inner + self.conv_dim], self.conv_weight.value,
                                      state["conv"])
        if self.conv_bias is not None:
            xbc = xbc + self.conv_bias.value
        xbc = ops.silu(xbc)
        x = xbc[:, : self.inner].reshape(t, h, p)
        b = xbc[:, self.inner : self.inner + g * n].reshape(t, g, n)
        c = xbc[:, self.inner + g * n :].reshape(t, g, n)
        dt = ops.softplus(zxd[:, self.inner + self.conv_dim :] + self.dt_bias.value)  # (T, H)
        if t == 1 and state.length > 0:
            y, ssm = self._step(x, b, c, dt, state["ssm"], ops)
        else:
            y, ssm = self._chunked(x, b, c, self._clamped(dt, ops), state["ssm"], ops)
        state.update(t, conv=conv, ssm=ssm)
        return (y + x * self.d.value.reshape(1, h, 1)).reshape(t, h * p)

    def _clamped(self, dt, ops):
        low, high = self.dt_limit
        if low > 0.0:  # softplus is positive already: a floor of 0 changes nothing
            dt = ops.maximum(dt, low)
        if math.isfinite(high):
            dt = -ops.maximum(-dt, -high)
        return dt

    def _heads(self, a, ops):
        """(T, G, N) -> (T, H, N): each group's rows for its H / G heads."""
        t, g, n = a.shape
        r = self.n_heads // g
        return a.reshape(t, g, 1, n) if r == 1 else broadcast(ops, a.reshape(t, g, 1, n), (t, g, r, n))

    def _step(self, x, b, c, dt, ssm, ops):
        """One position (decode): S = exp(dt A) S + (dt x) B^T, y = S C."""
        h, p, n = self.n_heads, self.head_dim, self.state_size
        decay = ops.exp(dt.reshape(h) * self.a_neg.value).reshape(h, 1, 1)
        bh = self._heads(b, ops).reshape(h, 1, n)
        ch = self._heads(c, ops).reshape(h, n, 1)
        ssm = ssm * decay + ops.matmul((x * dt.reshape(1, h, 1)).reshape(h, p, 1), bh)
        return ops.matmul(ssm, ch).reshape(1, h, p), ssm

    def _chunked(self, x, b, c, dt, ssm, ops):
        """Positions chunk by chunk (prefill): each chunk's outputs as a masked product
        over its positions plus the carried state's part, then the state at its end."""
        t = x.shape[0]
        h, p, g, n = self.n_heads, self.head_dim, self.n_groups, self.state_size
        r = h // g
        log_decay = (dt * self.a_neg.value).transpose(1, 0)  # (H, T): dt * A per position
        xdt = (x * dt.reshape(t, h, 1)).transpose(1, 0, 2)  # (H, T, P)
        bg, cg = b.transpose(1, 0, 2), c.transpose(1, 0, 2)  # (G, T, N)
        ys = []
        for c0 in range(0, t, self.chunk_size):
            c1 = min(t, c0 + self.chunk_size)
            length = c1 - c0
            upper, mask = _chunk_constants(ops, length)
            cum = ops.matmul(log_decay[:, c0:c1], upper)  # (H, L): cumulative sums within the chunk
            # decay from position s to l (s <= l), exp(cum[l] - cum[s]); 0 above the diagonal
            within = ops.exp(cum.reshape(h, length, 1) - cum.reshape(h, 1, length) + mask)
            scores = ops.matmul(cg[:, c0:c1], swap_last(bg[:, c0:c1]))  # (G, L, L): C_l . B_s per group
            weights = (within.reshape(g, r, length, length) * scores.reshape(g, 1, length, length))
            xc = xdt[:, c0:c1]  # (H, L, P)
            y = ops.matmul(weights.reshape(h, length, length), xc)
            # the carried state's part: C_l . S (per group, its heads side by side), decayed to l
            carried = ops.matmul(cg[:, c0:c1], swap_last(ssm.reshape(g, r * p, n)))  # (G, L, R*P)
            carried = carried.reshape(g, length, r, p).transpose(0, 2, 1, 3).reshape(h, length, p)
            y = y + carried * ops.exp(cum).reshape(h, length, 1)
            ys.append(y.transpose(1, 0, 2))
            # the state at the chunk's end: S decayed over the chunk plus each position's
            # write decayed from there to the end
            last = cum[:, length - 1 :]  # (H, 1)
            writes = (xc * ops.exp(last - cum).reshape(h, length, 1)).reshape(g, r, length, p)
            writes = ops.matmul(writes.transpose(0, 1, 3, 2).reshape(g, r * p, length), bg[:, c0:c1])  # (G, R*P, N)
            ssm = ssm * ops.exp(last).reshape(h, 1, 1) + writes.reshape(h, p, n)
        return (ys[0] if len(ys) == 1 else ops.concat(ys, 0)), ssm


def _chunk_constants(ops, length: int):
    """(L, L) float32 on the backend: ones on and above the diagonal (a cumulative sum as a
    product) and the additive mask of 0 on and below it, -inf above."""
    upper = np.triu(np.ones((length, length), dtype=np.float32))
    mask = np.where(upper.T > 0, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
    return ops.asarray(upper), ops.asarray(mask)

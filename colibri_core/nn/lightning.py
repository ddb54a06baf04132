"""Lightning attention: linear attention with a fixed exponential decay per head
(MiniMax-Text-01, MiniMax-M1; transformers' ``MiniMaxLightningAttention``).

Per token, ``qkv_proj`` gives, per head h (of H, D channels each, laid out head by head
as [q | k | v]), silu-activated q, k, v. Each head keeps a (D_k, D_v) state S with a
constant decay rate s_h (``lightning_slopes``: ALiBi-like rates shrinking with depth):

    S = exp(-s_h) S + k^T v;   o = q S          (q, k unscaled; the current token included)

then out_proj(rms_norm(o) * w * sigmoid(output_gate(x))), the RMS norm over all H * D
features of a position.

A prompt (several positions) goes through the block form, as transformers' prefill:
blocks of ``block_size`` positions, each block's outputs the intra-block part
((q k^T) * decay mask) v, the mask exp(-s (i - j)) for j <= i, plus the inter-block part
(q * exp(-s (i + 1))) S_prev; S carried from block to block as
S = exp(-s L) S + (k * exp(-s (L - 1 - j)))^T v. A single decoded token goes through the
stepwise form. Both are the same recurrence to float32 rounding (every factor is a decay
below 1, so neither form can overflow), and a prompt fed in pieces gives the state fed at
once. The decays are computed on the backend (exp) from -s per head and a few constants
of the block length (positions, the gap i - j, the causal mask) that every layer shares.
Everything is the contract's primitives (matmul, exp, silu, sigmoid, rms_norm,
elementwise): it runs on every backend, on its device.

Mamba-2's chunked scan (``nn.mamba``) is the same recurrence with dt = 1, B = k, C = q,
but its code is bound to Mamba's dt, groups and (P, N) state layout and recomputes the
decays from per-position cumulative sums; a constant decay needs none of that. The gated
delta rule with beta 0 writes nothing, so it is not this either.

The state of a sequence is a ``RecurrentState`` of fixed size: S per head ("kv",
(H, D_k, D_v)).
"""

from __future__ import annotations

import numpy as np

from colibri_core.compute.composites import swap_last
from colibri_core.nn.cache import RecurrentState
from colibri_core.nn.layers import Linear, RMSNorm, Step

NORM_EPS = 1e-6  # transformers' MiniMaxRMSNorm default: the lightning norm ignores rms_norm_eps


def lightning_slopes(n_heads: int, layer: int, n_layers: int) -> np.ndarray:
    """The decay rate of each head of layer ``layer`` of ``n_layers``, float32 as
    transformers' ``get_slope_rate`` computes it: (2 ** (-8 / H)) ** (h + 1) times
    1 - layer / (n_layers - 1 + 1e-5) + 1e-5."""
    if n_heads < 1 or n_layers < 1 or not 0 <= layer < n_layers:
        raise ValueError(f"lightning slopes: heads {n_heads}, layer {layer} of {n_layers}")
    base = 1 / (2 ** (8 / n_heads))
    rate = (np.float32(base) ** np.arange(1, n_heads + 1, dtype=np.float32)).astype(np.float32)
    factor = 1 - layer / (n_layers - 1 + 1e-5) + 1e-5
    return (rate * np.float32(factor)).astype(np.float32)


class LightningAttention:
    """``qkv_proj`` (3*H*D, hidden) -> per head [q | k | v]; ``output_gate`` (H*D, hidden);
    ``norm`` an RMS norm over H*D features; ``out_proj`` (hidden, H*D); ``slopes`` the
    decay rate of each head (H,) (``lightning_slopes``); ``block_size`` the prompt form's
    block length."""

    def __init__(self, *, layer: int, qkv_proj: Linear, output_gate: Linear, norm: RMSNorm, out_proj: Linear,
                 slopes: np.ndarray, n_heads: int, head_dim: int, block_size: int):
        slopes = np.asarray(slopes, dtype=np.float32).reshape(-1)
        if slopes.shape != (n_heads,):
            raise ValueError(f"lightning attention: {slopes.shape[0]} slopes for {n_heads} heads")
        if not (slopes >= 0).all():
            raise ValueError("lightning attention: decay rates must be >= 0")
        if block_size < 1:
            raise ValueError(f"lightning attention: block_size {block_size} is not positive")
        self.layer, self.qkv_proj, self.output_gate, self.norm, self.out_proj = layer, qkv_proj, output_gate, norm, out_proj
        self.slopes, self.n_heads, self.head_dim, self.block_size = slopes, n_heads, head_dim, int(block_size)
        self._constants: dict = {}  # the backend and its -s, exp(-s) per head

    def new_state(self, backend, max_len: int) -> RecurrentState:
        return RecurrentState(backend, {"kv": (self.n_heads, self.head_dim, self.head_dim)})

    def __call__(self, x, step: Step):
        qkv = step.ops.silu(self.qkv_proj(x, step))
        return self._output(self._recur(qkv, step), x, step)

    def batched(self, x, step: Step):
        """A batched step: the projections, norm and gate on all rows, the recurrence per
        sequence."""
        qkv = step.ops.silu(self.qkv_proj(x, step))
        outs = [self._recur(qkv[a:b], seg) for seg, (a, b) in zip(step.segments, step.rows)]
        return self._output(outs[0] if len(outs) == 1 else step.ops.concat(outs, 0), x, step)

    def _output(self, o, x, step: Step):
        gate = step.ops.sigmoid(self.output_gate(x, step))
        return self.out_proj(self.norm(o, step) * gate, step)

    def _recur(self, qkv, step: Step):
        """One sequence's rows through the recurrence: o (T, H*D)."""
        ops = step.ops
        t, h, d = qkv.shape[0], self.n_heads, self.head_dim
        parts = qkv.reshape(t, h, 3, d).transpose(2, 1, 0, 3)  # (3, H, T, D)
        q, k, v = (parts[i : i + 1].reshape(h, t, d) for i in range(3))
        state: RecurrentState = step.cache.layers[self.layer]
        if t == 1:
            o, kv = self._step(q, k, v, state["kv"], ops)
        else:
            o, kv = self._blocks(q, k, v, state["kv"], ops)
        state.update(t, kv=kv)
        return o.transpose(1, 0, 2).reshape(t, h * d)

    def _step(self, q, k, v, kv, ops):
        """One position (decode): S = exp(-s) S + k^T v, o = q S."""
        kv = kv * self._rates(ops)[1] + ops.matmul(swap_last(k), v)  # (H, D, 1) @ (H, 1, D)
        return ops.matmul(q, kv), kv

    def _blocks(self, q, k, v, kv, ops):
        """Positions block by block (prefill): each block's outputs as the masked product
        within it plus the carried state's part, then the state at its end."""
        t, outs = q.shape[1], []
        neg = self._rates(ops)[0]  # -s (H, 1, 1)
        for b0 in range(0, t, self.block_size):
            b1 = min(t, b0 + self.block_size)
            length = b1 - b0
            steps, rest, gap, mask = _block_constants(ops, length)
            within = ops.exp(neg * gap + mask)  # exp(-s (i - j)), 0 above the diagonal (H, L, L)
            qb, kb, vb = q[:, b0:b1], k[:, b0:b1], v[:, b0:b1]
            intra = ops.matmul(ops.matmul(qb, swap_last(kb)) * within, vb)
            outs.append(ops.matmul(qb * ops.exp(neg * steps), kv) + intra)  # the state decayed i + 1 steps
            # the state decayed over the block plus each key's write decayed L - 1 - j steps
            kv = kv * ops.exp(neg * float(length)) + ops.matmul(swap_last(kb * ops.exp(neg * rest)), vb)
        return (outs[0] if len(outs) == 1 else ops.concat(outs, 1)), kv

    def _rates(self, ops):
        """-s and exp(-s) per head, (H, 1, 1) float32 on the backend, made once."""
        if self._constants.get("ops") is not ops:
            neg = (-self.slopes).reshape(-1, 1, 1).astype(np.float32)
            self._constants = {"ops": ops, "rates": (ops.asarray(neg), ops.asarray(np.exp(neg).astype(np.float32)))}
        return self._constants["rates"]


_BLOCKS: dict = {}  # (backend id, length) -> (backend, constants): the few block lengths in use
_KEPT_LENGTHS = 8


def _block_constants(ops, length: int):
    """A block of ``length`` positions' float32 constants on the backend, shared by every
    layer: i + 1 and L - 1 - i (1, L, 1), the gap max(i - j, 0) and the additive mask of 0
    on and below the diagonal, -inf above (1, L, L). Only the last few lengths are kept
    (a prompt's last block has its own)."""
    key = (id(ops), length)
    found = _BLOCKS.get(key)
    if found is not None and found[0] is ops:
        return found[1]
    i = np.arange(length, dtype=np.float32)
    gap = i[:, None] - i[None, :]
    mask = np.where(gap >= 0, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
    host = ((i + 1).reshape(1, length, 1), (length - 1 - i).reshape(1, length, 1),
            np.maximum(gap, 0).reshape(1, length, length), mask.reshape(1, length, length))
    arrays = tuple(ops.asarray(np.ascontiguousarray(a, dtype=np.float32)) for a in host)
    while len(_BLOCKS) >= _KEPT_LENGTHS:
        _BLOCKS.pop(next(iter(_BLOCKS)))
    _BLOCKS[key] = (ops, arrays)
    return arrays

"""Gated DeltaNet: linear attention with a recurrent state (Qwen3-Next, Qwen3.5), and
its per-channel-decay form, Kimi Delta Attention (KDA, Kimi Linear).

Per token, the layer projects the input to q, k, v (passed through a depthwise causal
conv1d and silu), an output gate z, a write strength beta = sigmoid(b) and a decay
g = -exp(A_log) * softplus(a + dt_bias). q and k are L2-normalised (q also scaled by
1/sqrt(d_k)); each value head keeps a (d_k, d_v) matrix S updated by the gated delta
rule (see ``Backend.gated_delta_chunked``); the output, RMS-normalised and gated by
silu(z), goes through out_proj.

The state of a sequence is a ``RecurrentState`` of fixed size: the conv's last K-1
inputs and S per value head. Prompts (several positions) go through the chunked form of
the rule, single decoded tokens through the stepwise form, as in transformers; the two
agree to float32 rounding, so a prompt fed in pieces gives the state fed at once.

KDA (``gate_per_channel``) is the same layer with a decay per key channel: a is
(Hv * Dk), g = -exp(A_log[h]) * softplus(a + dt_bias) decays row d of each head's S by
exp(g[h, d]) (``Backend.gated_delta_channel_chunked`` / ``_step``); its output norm gates
with sigmoid instead of silu (``GatedRMSNorm(activation="sigmoid")``), and its a and z
come through low-rank pairs of projections (``LowRank``).

``gate_lower_bound`` (GLM-5 Next's KDA, per channel): the decay is bounded below instead,
g = lower_bound * sigmoid(exp(A_log[h]) * (a + dt_bias)), in (lower_bound, 0).
"""

from __future__ import annotations

import numpy as np

from colibri_core.nn.cache import RecurrentState
from colibri_core.nn.layers import Linear, Step
from colibri_core.nn.norms import GatedRMSNorm
from colibri_core.nn.weights import Param

CHUNK_SIZE = 64  # transformers' torch_chunk_gated_delta_rule default
L2_EPS = 1e-6  # transformers' l2norm (use_qk_l2norm_in_kernel)


class LowRank:
    """Two projections in a row, second(first(x)): KDA's f_a/f_b and g_a/g_b pairs."""

    def __init__(self, first: Linear, second: Linear):
        self.first, self.second = first, second

    @property
    def out_features(self) -> int:
        return self.second.out_features

    def __call__(self, x, step: Step):
        return self.second(self.first(x, step), step)


class GatedDeltaNet:
    """``projections``: blocks (``Linear``, ``LowRank``) whose outputs, concatenated, are
    [q (Hk*Dk), k (Hk*Dk), v (Hv*Dv) | z (Hv*Dv) | b (Hv) | a (Hv, or Hv*Dk with
    ``gate_per_channel``)]; a group may span several projections (KDA: q_proj, k_proj,
    v_proj) or one projection several groups, e.g. [in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a] (Qwen3.5) or [in_proj_qkvz, in_proj_ba] with rows regrouped at load
    (Qwen3-Next). ``conv_weight`` is (Hk*Dk*2 + Hv*Dv, K), or a list of Params whose rows,
    concatenated, are (KDA's q_conv1d, k_conv1d, v_conv1d); ``a_neg`` holds -exp(A_log)
    per value head (Hv,)."""

    def __init__(self, *, layer: int, projections: list, conv_weight: Param | list[Param], a_neg: Param,
                 dt_bias: Param, norm: GatedRMSNorm, out: Linear, n_k_heads: int, n_v_heads: int, k_head_dim: int,
                 v_head_dim: int, chunk_size: int = CHUNK_SIZE, gate_per_channel: bool = False,
                 gate_lower_bound: float | None = None):
        if n_v_heads % n_k_heads:
            raise ValueError(f"value heads {n_v_heads} are not a multiple of key heads {n_k_heads}")
        self.layer = layer
        self.projections, self.a_neg, self.dt_bias = projections, a_neg, dt_bias
        self.conv_weights = list(conv_weight) if isinstance(conv_weight, (list, tuple)) else [conv_weight]
        self.norm, self.out = norm, out
        self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim = n_k_heads, n_v_heads, k_head_dim, v_head_dim
        self.key_dim, self.value_dim = n_k_heads * k_head_dim, n_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.chunk_size = chunk_size
        self.gate_per_channel = gate_per_channel
        if gate_lower_bound is not None and not gate_per_channel:
            raise ValueError("gate_lower_bound is the per-channel (KDA) decay's option")
        self.gate_lower_bound = gate_lower_bound
        self.sizes = (self.conv_dim, self.value_dim, n_v_heads, n_v_heads * (k_head_dim if gate_per_channel else 1))
        self._conv = None  # the conv weights as one (conv_dim, K) array, once loaded

    @property
    def conv_kernel(self) -> int:
        return self.conv_weights[0].info.shape[-1]

    @property
    def conv_weight(self) -> Param:
        """The conv weight Param (one; a list of Params: the first)."""
        return self.conv_weights[0]

    def _conv_weight(self, ops):
        if len(self.conv_weights) == 1:
            return self.conv_weights[0].value
        if self._conv is None:  # joined once: the parts are tiny (K floats per channel)
            self._conv = ops.concat([p.value for p in self.conv_weights], 0)
        return self._conv

    def new_state(self, backend, max_len: int) -> RecurrentState:
        return RecurrentState(backend, {
            "conv": (self.conv_kernel - 1, self.conv_dim),
            "recurrent": (self.n_v_heads, self.k_head_dim, self.v_head_dim),
        })

    def _project(self, x, step: Step):
        """[qkv, z, b, a] sliced (and, where a group spans projections, joined) from the
        projections' outputs."""
        parts, sizes, pending, need = [], list(self.sizes), [], 0
        for proj in self.projections:
            y, start = proj(x, step), 0
            while start < y.shape[1]:
                if not need:
                    if not sizes:
                        raise ValueError("GatedDeltaNet projections do not split into qkv, z, b, a")
                    need = sizes.pop(0)
                take = min(need, y.shape[1] - start)
                pending.append(y[:, start : start + take])
                start, need = start + take, need - take
                if not need:
                    parts.append(pending[0] if len(pending) == 1 else step.ops.concat(pending, 1))
                    pending = []
        if sizes or need or len(parts) != 4:
            raise ValueError("GatedDeltaNet projections do not split into qkv, z, b, a")
        return parts

    def __call__(self, x, step: Step):
        qkv, z, b, a = self._project(x, step)
        out = self._recur(qkv, b, a, step)
        return self._output(out, z, step)

    def batched(self, x, step: Step):
        """A batched step: projections, norm and out_proj on all rows, the recurrence per
        sequence."""
        qkv, z, b, a = self._project(x, step)
        outs = [self._recur(qkv[r0:r1], b[r0:r1], a[r0:r1], seg) for seg, (r0, r1) in zip(step.segments, step.rows)]
        return self._output(outs[0] if len(outs) == 1 else step.ops.concat(outs, 0), z, step)

    def _output(self, out, z, step: Step):
        t, hv, dv = out.shape
        out = self.norm(out.reshape(t * hv, dv), z.reshape(t * hv, dv), step)
        return self.out(out.reshape(t, hv * dv), step)

    def _recur(self, qkv, b, a, step: Step):
        """One sequence's rows through the conv and the gated delta rule: (T, Hv, Dv)."""
        ops = step.ops
        t = qkv.shape[0]
        hk, hv, dk, dv = self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim
        state: RecurrentState = step.cache.layers[self.layer]
        qkv, conv = ops.causal_conv1d(qkv, self._conv_weight(ops), state["conv"])
        qkv = ops.silu(qkv)
        q = ops.l2_norm(qkv[:, : self.key_dim].reshape(t, hk, dk), L2_EPS) * (dk**-0.5)
        k = ops.l2_norm(qkv[:, self.key_dim : 2 * self.key_dim].reshape(t, hk, dk), L2_EPS)
        v = qkv[:, 2 * self.key_dim :].reshape(t, hv, dv)
        beta = ops.sigmoid(b)
        if self.gate_per_channel and self.gate_lower_bound is not None:  # bounded below (GLM-5 Next)
            rate = -self.a_neg.value.reshape(hv, 1)  # exp(A_log)
            g = ops.sigmoid(rate * (a + self.dt_bias.value).reshape(t, hv, dk)) * float(self.gate_lower_bound)
            step_op, chunked_op = ops.gated_delta_channel_step, ops.gated_delta_channel_chunked
        elif self.gate_per_channel:  # KDA: a decay per (value head, key channel)
            g = self.a_neg.value.reshape(hv, 1) * ops.softplus((a + self.dt_bias.value).reshape(t, hv, dk))
            step_op, chunked_op = ops.gated_delta_channel_step, ops.gated_delta_channel_chunked
        else:
            g = self.a_neg.value * ops.softplus(a + self.dt_bias.value)
            step_op, chunked_op = ops.gated_delta_step, ops.gated_delta_chunked
        if t == 1 and state.length > 0:
            out, recurrent = step_op(q, k, v, g, beta, state["recurrent"])
        else:
            out, recurrent = chunked_op(q, k, v, g, beta, state["recurrent"], self.chunk_size)
        state.update(t, conv=conv, recurrent=recurrent)
        return out


def conv_weight_2d(w):
    """Load transform: a Conv1d weight (C, 1, K) as (C, K)."""
    return np.ascontiguousarray(w.reshape(w.shape[0], w.shape[-1]))


def neg_exp(w):
    """Load transform: A_log -> -exp(A_log) (float32, as transformers computes it)."""
    return -np.exp(w.astype(np.float32))


def neg_exp_flat(w):
    """Load transform: A_log of any shape holding one value per head (KDA's (1, 1, H, 1))
    -> -exp(A_log) as (H,)."""
    return np.ascontiguousarray(neg_exp(w).reshape(-1))

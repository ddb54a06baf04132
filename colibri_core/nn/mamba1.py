"""Mamba (v1): a selective state-space token mixer with a per-channel state (Jamba).

Per token, ``in_proj`` gives the mixer's input x and a gate z (D channels each). x goes
through a depthwise causal conv1d (+ bias) and silu; ``x_proj`` maps it to a low-rank time
step (R), B and C (N each), each through its own RMS norm where the model has them
(Jamba's ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``); dt = softplus(dt_proj(dt))
(D, with dt_proj's bias). Each channel c keeps N states s:

    s = exp(dt A) * s + dt x B;   y = s . C + D x      (A = -exp(A_log), (D, N), < 0)

then out_proj(y * silu(z)). This is transformers' slow path (modeling_jamba,
``mamba_selective_scan`` and ``mamba_selective_state_update``) and mamba_ssm's kernels.

A prompt (several positions) is scanned position by position, the decay exp(dt A) and the
write dt x B computed for a block of ``block`` positions at once and the states of a
block contracted with C in one product; a decoded token takes one step. Both are the same
operations in the same order, so a prompt fed in pieces gives the state fed at once.
Everything is composed of the contract's primitives (matmul, exp, softplus, rms_norm, ...):
it runs on every backend, on its device, without a host round trip.

The state of a sequence is a ``RecurrentState`` of fixed size: the conv's last K-1 inputs
("conv", (K-1, D)) and the states ("ssm", (D, N)).
"""

from __future__ import annotations

from colibri_core.nn.cache import RecurrentState
from colibri_core.nn.layers import Linear, Step
from colibri_core.nn.weights import Param

# positions whose decay and write are computed at once in a prompt: bounds the (block, D, N)
# temporaries (Jamba 1.5 Mini: 8192 x 16 channels x 64 positions, 32 MiB each)
BLOCK = 64


class Mamba1Mixer:
    """``in_proj`` (2*D, hidden) -> [x | z]; ``conv_weight`` (D, K) with optional
    ``conv_bias``; ``x_proj`` (R + 2N, D) -> [dt | B | C]; optional RMS norm weights
    ``dt_norm`` (R,), ``b_norm`` and ``c_norm`` (N,) (``eps``); ``dt_proj`` (D, R) with
    its bias; ``a_neg`` (-exp(A_log), (D, N)); ``d`` (D,); ``out_proj``."""

    def __init__(self, *, layer: int, in_proj: Linear, conv_weight: Param, conv_bias: Param | None, x_proj: Linear,
                 dt_proj: Linear, a_neg: Param, d: Param, out_proj: Linear, inner: int, state_size: int, dt_rank: int,
                 dt_norm: Param | None = None, b_norm: Param | None = None, c_norm: Param | None = None,
                 eps: float = 1e-6, block: int = BLOCK):
        if block < 1:
            raise ValueError(f"Mamba block {block} is not positive")
        self.layer, self.in_proj, self.x_proj, self.dt_proj, self.out_proj = layer, in_proj, x_proj, dt_proj, out_proj
        self.conv_weight, self.conv_bias, self.a_neg, self.d = conv_weight, conv_bias, a_neg, d
        self.dt_norm, self.b_norm, self.c_norm, self.eps = dt_norm, b_norm, c_norm, float(eps)
        self.inner, self.state_size, self.dt_rank, self.block = inner, state_size, dt_rank, int(block)

    @property
    def conv_kernel(self) -> int:
        return self.conv_weight.shape[-1]

    def new_state(self, backend, max_len: int) -> RecurrentState:
        return RecurrentState(backend, {"conv": (self.conv_kernel - 1, self.inner),
                                        "ssm": (self.inner, self.state_size)})

    def __call__(self, x, step: Step):
        xz = self.in_proj(x, step)
        return self._output(self._recur(xz, step), xz, step)

    def batched(self, x, step: Step):
        """A batched step: the projections and the gate on all rows, the conv and the
        recurrence per sequence."""
        xz = self.in_proj(x, step)
        ys = [self._recur(xz[a:b], seg) for seg, (a, b) in zip(step.segments, step.rows)]
        return self._output(ys[0] if len(ys) == 1 else step.ops.concat(ys, 0), xz, step)

    def _output(self, y, xz, step: Step):
        return self.out_proj(y * step.ops.silu(xz[:, self.inner :]), step)

    def _norm(self, x, weight: Param | None, ops):
        return x if weight is None else ops.rms_norm(x, weight.value, self.eps)

    def _recur(self, xz, step: Step):
        """One sequence's rows through the conv and the recurrence: y (T, D), before the gate."""
        ops = step.ops
        t, r, n = xz.shape[0], self.dt_rank, self.state_size
        state: RecurrentState = step.cache.layers[self.layer]
        x, conv = ops.causal_conv1d(xz[:, : self.inner], self.conv_weight.value, state["conv"])
        if self.conv_bias is not None:
            x = x + self.conv_bias.value
        x = ops.silu(x)
        dbc = self.x_proj(x, step)
        dt = self._norm(dbc[:, :r], self.dt_norm, ops)
        b = self._norm(dbc[:, r : r + n], self.b_norm, ops)
        c = self._norm(dbc[:, r + n :], self.c_norm, ops)
        dt = ops.softplus(self.dt_proj(dt, step))  # (T, D)
        y, ssm = self._scan(x, dt, b, c, state["ssm"], ops)
        state.update(t, conv=conv, ssm=ssm)
        return y + x * self.d.value

    def _scan(self, x, dt, b, c, ssm, ops):
        """Positions one after another from state ``ssm`` (D, N): the outputs s . C (T, D)
        and the last state. A block's decays and writes are computed at once, its states
        contracted with C at once."""
        t, d, n = x.shape[0], self.inner, self.state_size
        a = self.a_neg.value.reshape(1, d, n)
        ys = []
        for p0 in range(0, t, self.block):
            p1 = min(t, p0 + self.block)
            length = p1 - p0
            decay = ops.exp(dt[p0:p1].reshape(length, d, 1) * a)  # (L, D, N)
            writes = (dt[p0:p1] * x[p0:p1]).reshape(length, d, 1) * b[p0:p1].reshape(length, 1, n)
            states = []
            for i in range(length):
                ssm = ssm * decay[i] + writes[i]
                states.append(ssm.reshape(1, d, n))
            stacked = states[0] if length == 1 else ops.concat(states, 0)
            ys.append(ops.matmul(stacked, c[p0:p1].reshape(length, n, 1)).reshape(length, d))
        return (ys[0] if len(ys) == 1 else ops.concat(ys, 0)), ssm

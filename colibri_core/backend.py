"""The compute-backend interface.

The shared building blocks in ``colibri_core.nn`` do their array work through a backend,
so a family written once runs on every backend. Arrays are the backend's own (numpy
arrays on the CPU backend); arithmetic operators (+, *) must work on them. A backend
implements the operations below; ``colibri_core.testing`` holds a suite that checks a
backend op by op against the CPU reference.
"""

from __future__ import annotations

from typing import Any

Array = Any


class Backend:
    name = "base"

    # -- memory ------------------------------------------------------------------------
    def asarray(self, host_f32) -> Array:
        """Take a float32 numpy array and return the backend's array."""
        raise NotImplementedError

    def to_numpy(self, x: Array):
        raise NotImplementedError

    def zeros(self, shape: tuple[int, ...]) -> Array:
        raise NotImplementedError

    def nbytes(self, x: Array) -> int:
        return int(x.nbytes)

    # -- operations --------------------------------------------------------------------
    def embedding(self, table: Array, ids) -> Array:
        """Rows of ``table`` for integer ``ids`` (numpy int array)."""
        raise NotImplementedError

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        """x (T, in) @ weight.T, weight stored (out, in) as in PyTorch checkpoints."""
        raise NotImplementedError

    def rms_norm(self, x: Array, weight: Array | None, eps: float) -> Array:
        raise NotImplementedError

    def rope(self, x: Array, cos: Array, sin: Array, rotary_dim: int) -> Array:
        """Rotate-half RoPE on the first ``rotary_dim`` features of x (T, heads, head_dim);
        cos/sin are (T, rotary_dim)."""
        raise NotImplementedError

    def attention(self, q: Array, k: Array, v: Array, start: int, scale: float) -> Array:
        """Causal attention. q (T, Hq, D); k, v (Hkv, S, D) hold every cached position,
        the T queries sitting at positions start..start+T-1 of those S. Returns (T, Hq, Dv)."""
        raise NotImplementedError

    def clip(self, x: Array, limit: float) -> Array:
        """Clamp to [-limit, limit]."""
        raise NotImplementedError

    def silu_mul(self, gate: Array, up: Array) -> Array:
        raise NotImplementedError

    def sigmoid(self, x: Array) -> Array:
        raise NotImplementedError

    def softmax(self, x: Array) -> Array:
        """Softmax over the last axis."""
        raise NotImplementedError

    def swiglu_expert(self, x: Array, gate: Array, up: Array, down: Array) -> Array:
        """down(silu(gate(x)) * up(x)) for one expert's matrices."""
        return self.linear(self.silu_mul(self.linear(x, gate), self.linear(x, up)), down)

    def routed_experts(self, x: Array, indices, weights, fetch) -> Array:
        """Apply the routed SwiGLU experts of one MoE layer.

        ``indices`` and ``weights`` (host arrays, (T, k)) say which experts each token
        uses and with what weight; ``fetch(e)`` returns expert e's matrices. Each expert
        is fetched once for all its tokens (batch-union), and outputs must be summed in
        ascending expert order: the reduction order may never depend on placement.
        """
        raise NotImplementedError

    # -- recurrent (linear-attention) layers -------------------------------------------
    def silu(self, x: Array) -> Array:
        """x * sigmoid(x), elementwise."""
        raise NotImplementedError

    def softplus(self, x: Array) -> Array:
        """log(1 + exp(x)) elementwise; x itself above 20 (PyTorch's threshold)."""
        raise NotImplementedError

    def l2_norm(self, x: Array, eps: float) -> Array:
        """x / sqrt(sum(x^2) + eps) over the last axis."""
        raise NotImplementedError

    def causal_conv1d(self, x: Array, weight: Array, state: Array) -> tuple[Array, Array]:
        """Depthwise causal convolution over time, without bias or activation.

        x (T, C) are the new positions, weight (C, K) one filter per channel, state (K-1, C)
        the inputs of the K-1 positions before x (zeros at the start of a sequence).
        Returns the output (T, C), out[t, c] = sum_j weight[c, j] * [state; x][t + j, c],
        and the new state: the last K-1 rows of [state; x]."""
        raise NotImplementedError

    def gated_delta_chunked(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                            chunk_size: int) -> tuple[Array, Array]:
        """The gated delta rule over T positions, computed chunk by chunk (prefill).

        q, k (T, Hk, Dk) (already normalised and scaled), v (T, Hv, Dv), g (T, Hv) the
        log-decay (<= 0), beta (T, Hv) the write strength, state (Hv, Dk, Dv) the recurrent
        state before the first position. Key head h serves value heads h*r .. h*r+r-1
        (r = Hv / Hk). Per position and value head:
            S = exp(g) * S;  S += k (beta * (v - k^T S))^T;  out = q^T S
        Positions are grouped in chunks of ``chunk_size`` counted from the first of these T
        (the WY/UT form of transformers' torch_chunk_gated_delta_rule); mathematically
        identical to ``gated_delta_step``. Returns out (T, Hv, Dv) and the new state."""
        raise NotImplementedError

    def gated_delta_step(self, q: Array, k: Array, v: Array, g: Array, beta: Array,
                         state: Array) -> tuple[Array, Array]:
        """The gated delta rule position by position (decode); same arguments, results and
        recurrence as ``gated_delta_chunked`` (transformers' torch_recurrent_gated_delta_rule)."""
        raise NotImplementedError

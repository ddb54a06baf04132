"""The compute-backend interface.

The shared building blocks in ``colibri_core.nn`` do their array work through a backend,
so a family written once runs on every backend. Arrays are the backend's own (numpy
arrays on the CPU backend); arithmetic operators (+, *) must work on them. A backend
implements the operations below. The CPU backend's numpy path (``CpuBackend(kernels=False)``)
is the reference: the compiled kernels are tested against it op by op
(tests/test_quant_formats.py), and every family against transformers.
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

    def has_kernel(self, kind: str) -> bool:
        """Whether ``linear`` computes directly with weights kept in this stored form
        (a ``colibri_core.quant.QuantTensor`` of that kind: "q8", "q4", "mxfp4", "fp8",
        "bf16"). Weights whose kind has no kernel are decoded to float32 at load."""
        return False

    def placed(self, packed: bool) -> None:
        """Called once the model's weights are placed; ``packed`` says whether any weight
        is kept in a packed form (so the backend's kernels will do most of the work)."""

    def keeps_stored(self, kind: str, use: str) -> bool:
        """Whether a weight of this stored kind stays packed for this use: "linear"
        (``linear`` has the kernel), "embedding" (``embedding`` can decode looked-up rows
        too), never "array"."""
        return use == "linear" and self.has_kernel(kind)

    # -- operations --------------------------------------------------------------------
    def embedding(self, table: Array, ids) -> Array:
        """Rows of ``table`` for integer ``ids`` (numpy int array)."""
        raise NotImplementedError

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        """x (T, in) @ weight.T, weight stored (out, in) as in PyTorch checkpoints; the
        weight may be a QuantTensor of a kind ``has_kernel`` accepts."""
        raise NotImplementedError

    def linears(self, x: Array, weights: list, biases: list | None = None) -> list:
        """Several projections of the same x (e.g. q, k and v); a backend may compute
        them together."""
        biases = biases or [None] * len(weights)
        return [self.linear(x, w, b) for w, b in zip(weights, biases)]

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

    def softmax_top_k(self, x: Array, weight: Array, k: int, renormalise: bool):
        """The router of most MoE layers: probabilities softmax(x @ weight.T) over the
        experts, the k largest of each row (largest first; of equal ones the lower index)
        and their probabilities, renormalised to sum 1 when asked. Returns host arrays:
        indices (T, k) int64 and weights (T, k) float32."""
        from .nn.layers import softmax_top_k

        logits = self.to_numpy(self.linear(x, weight)).astype("float32", copy=False)
        return softmax_top_k(logits, k, renormalise)

    def swiglu_expert(self, x: Array, gate: Array, up: Array, down: Array) -> Array:
        """down(silu(gate(x)) * up(x)) for one expert's matrices."""
        return self.linear(self.silu_mul(self.linear(x, gate), self.linear(x, up)), down)

    def routed_experts(self, x: Array, indices, weights, fetch, window: int = 8, ready=None) -> Array:
        """Apply the routed SwiGLU experts of one MoE layer.

        ``indices`` and ``weights`` (host arrays, (T, k)) say which experts each token
        uses and with what weight; ``fetch(e)`` returns expert e's matrices. Each expert
        is fetched once for all its tokens (batch-union), and outputs must be summed in
        ascending expert order: the reduction order may never depend on placement. At
        most ``window`` fetched experts may be held at once beyond the store's own (the
        store reserves that much of its budget for them). ``ready(e)``, when given, says
        whether fetching e would answer at once (a backend computing experts in batches
        computes what it holds before waiting for a read).
        """
        raise NotImplementedError

    # -- MLA, DSA and interleaved RoPE (DeepSeek V3 / V3.2, Kimi K2, GLM) --------------
    def layer_norm(self, x: Array, weight: Array | None, bias: Array | None, eps: float) -> Array:
        """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias
        (biased variance, as torch.nn.LayerNorm)."""
        raise NotImplementedError

    def rope_interleaved(self, x: Array, cos: Array, sin: Array, rotary_dim: int) -> Array:
        """RoPE on the first ``rotary_dim`` features of x (T, heads, dim) laid out as
        interleaved pairs (x0, x1), (x2, x3), ...; pair i turns by the angle of column i of
        cos/sin (T, rotary_dim, the usual cat(freqs, freqs) tables). The rotated features
        come out de-interleaved (all first members, then all second members), exactly as
        transformers' ``apply_rotary_pos_emb_interleave``; q and k rotated alike keep their
        dot products."""
        raise NotImplementedError

    def mla_expand(self, q_nope: Array, q_rot: Array, latent: Array, k_rot: Array, kv_b: Array,
                   nope_dim: int, v_dim: int) -> tuple[Array, Array, Array]:
        """Multi-head latent attention, expanded form (prefill). q_nope (T, H, nope_dim) and
        q_rot (T, H, rope_dim) are the query parts; latent (S, rank) and k_rot (S, rope_dim)
        are every cached position. ``kv_b`` (H * (nope_dim + v_dim), rank) expands the
        latent into per-head no-rope keys and values. Returns q (T, H, nope+rope), keys
        (H, S, nope+rope) with k_rot shared by all heads, values (H, S, v_dim): the inputs
        of ``attention`` / ``sparse_attention``."""
        raise NotImplementedError

    def mla_absorb_query(self, q_nope: Array, kv_b: Array, nope_dim: int, v_dim: int) -> Array:
        """Fold the key up-projection into the query (absorbed MLA): for each head h,
        q_nope[t, h] @ W_uk[h], where W_uk[h] (nope_dim, rank) are head h's key rows of
        ``kv_b``. (T, H, nope_dim) -> (T, H, rank)."""
        raise NotImplementedError

    def mla_attention(self, q_lat: Array, q_rot: Array, latent: Array, k_rot: Array, start: int, scale: float,
                      selected=None) -> Array:
        """Causal attention in the latent space (absorbed MLA decode): score(t, h, s) =
        (q_lat[t, h] . latent[s] + q_rot[t, h] . k_rot[s]) * scale, softmax over the
        positions query t sees, output sum_s p * latent[s]. q_lat (T, H, rank), q_rot
        (T, H, rope), latent (S, rank), k_rot (S, rope); the T queries sit at positions
        start..start+T-1. ``selected`` (host int array (T, K), or None for all) restricts
        each query to those key positions (DSA); causality still applies.
        Returns (T, H, rank)."""
        raise NotImplementedError

    def mla_absorb_output(self, o_lat: Array, kv_b: Array, nope_dim: int, v_dim: int) -> Array:
        """Apply the value up-projection after latent attention: for each head h,
        W_uv[h] @ o_lat[t, h], where W_uv[h] (v_dim, rank) are head h's value rows of
        ``kv_b``. (T, H, rank) -> (T, H, v_dim)."""
        raise NotImplementedError

    def sparse_attention(self, q: Array, k: Array, v: Array, start: int, scale: float, selected) -> Array:
        """``attention`` restricted to selected keys: query t sees the key positions in
        ``selected[t]`` (host int array (T, K)) that causality allows."""
        raise NotImplementedError

    def dsa_index_scores(self, q: Array, k: Array, weights: Array, scale: float, start: int) -> Array:
        """The DSA lightning indexer's scores: score(t, s) = sum_h weights[t, h] *
        relu(scale * q[t, h] . k[s]), with q (T, Hi, D), cached index keys k (S, D) and
        per-head weights (T, Hi); positions a query cannot see are -inf. Returns (T, S)."""
        raise NotImplementedError

    def top_k(self, scores: Array, k: int):
        """Indices (host int64 array (T, k)) of the k largest scores of each row, largest
        first; among equal scores the lower index comes first."""

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

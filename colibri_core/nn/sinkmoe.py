"""A MoE whose router also weighs the shared experts (Inkling, transformers:
``InklingTopkRouter`` / ``InklingMoE``).

The router has a row per routed and per shared expert. Routed experts are chosen by
sigmoid(logit) + ``e_score_correction_bias`` (top k, ties to the lower index); the k
chosen and the shared experts' logits then share one normalisation, weight_i =
sigmoid(l_i) / sum of the sigmoids of all k + n_shared (the softmax of their
log-sigmoids, computed that way in float32), times ``route_scale`` and the router's
learned ``global_scale``. So the shared experts act as a sink: each is weighted per token
by its share. Routing happens on the host from the router's logits (one sync per layer,
as every router)."""

from __future__ import annotations

import numpy as np

from colibri_core.compute.host import top_k_indices
from colibri_core.nn.layers import Linear, RoutedExperts, SparseMoE, Step
from colibri_core.nn.weights import Param


class SigmoidSinkRouter:
    """``gate`` (n_routed + n_shared, hidden): the routed experts' rows, then the shared ones'."""

    def __init__(self, gate: Linear, top_k: int, n_shared: int, *, bias: Param | None, global_scale: Param | None,
                 route_scale: float):
        n_routed = gate.out_features - n_shared
        if n_shared < 1 or n_routed < 1:
            raise ValueError(f"a sink router needs routed and shared experts, got {n_routed} and {n_shared}")
        if not 1 <= top_k <= n_routed:
            raise ValueError(f"top_k {top_k} must be within 1..{n_routed}")
        self.gate, self.top_k, self.n_shared, self.n_routed = gate, top_k, n_shared, n_routed
        gate.weight.role = "router"  # routing decisions stay at the stored precision
        self.bias, self.global_scale, self.route_scale = bias, global_scale, route_scale
        self._host = None  # (bias, global scale) on the host, copied at the first call

    def route(self, x, step: Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Routed expert ids (T, k), their weights (T, k) and the shared experts' (T, n_shared)."""
        ops = step.ops
        if self._host is None:
            bias = np.zeros(self.n_routed, np.float32) if self.bias is None else ops.to_host(self.bias.value)
            scale = np.float32(1.0) if self.global_scale is None else ops.to_host(self.global_scale.value).reshape(-1)[0]
            self._host = (np.asarray(bias, np.float32), np.float32(scale))
        bias, global_scale = self._host
        logits = ops.router_logits(x, self.gate.weight.value)
        routed = logits[:, : self.n_routed]
        with np.errstate(over="ignore"):
            scores = np.float32(1.0) / (np.float32(1.0) + np.exp(-routed))
        indices = top_k_indices(scores + bias, self.top_k)
        chosen = np.concatenate([np.take_along_axis(routed, indices, axis=-1), logits[:, self.n_routed :]], axis=-1)
        log_probs = np.minimum(chosen, np.float32(0.0)) - np.log1p(np.exp(-np.abs(chosen)))  # logsigmoid, stable
        top = log_probs.max(axis=-1, keepdims=True)
        log_norm = top + np.log(np.exp(log_probs - top).sum(axis=-1, keepdims=True))
        weights = np.exp(log_probs - log_norm) * np.float32(self.route_scale) * global_scale
        weights = weights.astype(np.float32)
        return indices, weights[:, : self.top_k], weights[:, self.top_k :]

    def __call__(self, x, step: Step) -> tuple[np.ndarray, np.ndarray]:
        indices, weights, _ = self.route(x, step)
        return indices, weights


class WeightedSharedExperts:
    """n SwiGLU experts stacked, each output weighted per token: sum_s w[t, s] *
    down_s(silu(gate_s(x)) * up_s(x)). ``gate`` / ``up`` are (n * inter, hidden), ``down``
    (hidden, n * inter): one product each (see ``stack_rows`` / ``stack_columns``)."""

    def __init__(self, gate: Param, up: Param, down: Param, n: int, inter: int):
        self.gate, self.up, self.down, self.n, self.inter = gate, up, down, n, inter

    def __call__(self, x, weights: np.ndarray, step: Step):
        ops = step.ops
        act = ops.silu_mul(ops.linear(x, self.gate.value), ops.linear(x, self.up.value))
        per_column = ops.asarray(np.ascontiguousarray(np.repeat(weights, self.inter, axis=1), dtype=np.float32))
        return ops.linear(act * per_column, self.down.value)


class SinkMoE(SparseMoE):
    """Routed experts plus shared experts weighted by a ``SigmoidSinkRouter``."""

    def __init__(self, router: SigmoidSinkRouter, experts: RoutedExperts, shared: WeightedSharedExperts):
        super().__init__(router, experts)
        self.weighted_shared = shared

    def __call__(self, x, step: Step):
        indices, weights, shared_weights = self.router.route(x, step)
        return self.experts(x, indices, weights, step) + self.weighted_shared(x, shared_weights, step)


def stack_rows(w):
    """Load transform: (n, out, in) -> (n * out, in)."""
    return np.ascontiguousarray(np.asarray(w).reshape(-1, w.shape[-1]))


def stack_columns(w):
    """Load transform: (n, out, in) -> (out, n * in), expert s in columns s*in .. (s+1)*in - 1."""
    n, out, inner = w.shape
    return np.ascontiguousarray(np.asarray(w).transpose(1, 0, 2).reshape(out, n * inner))

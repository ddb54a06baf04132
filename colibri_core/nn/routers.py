"""Routers beyond softmax top-k: the sigmoid, group-limited router of DeepSeek-V3
(``topk_method: noaux_tc``), also used by Kimi K2 and the GLM-4.5+ MoE models."""

from __future__ import annotations

import numpy as np

from colibri_core.nn.layers import Linear, Step
from colibri_core.nn.weights import Param


class SigmoidGroupedTopKRouter:
    """Sigmoid expert scores; ``e_score_correction_bias`` is added for *choosing* experts
    only, never to the weights. Experts form ``n_group`` groups; a group's score is the
    sum of its two best (biased) scores; only experts of the ``topk_group`` best groups
    compete for the ``top_k`` slots. The chosen (unbiased) scores are renormalised to
    sum to one when ``norm_topk_prob``, then multiplied by ``routed_scaling_factor``.

    The backend computes it (``Backend.sigmoid_grouped_top_k``); the reference does it
    on the host in float32, like transformers' router.
    """

    def __init__(self, gate: Linear, top_k: int, *, bias: Param | None = None, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
        n_experts = gate.out_features
        if n_group < 1 or n_experts % n_group:
            raise ValueError(f"{n_experts} experts cannot form {n_group} equal groups")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group {topk_group} must be within 1..n_group ({n_group})")
        if n_group > 1 and n_experts // n_group < 2:
            raise ValueError(f"groups of {n_experts // n_group} expert cannot be scored by their two best")
        if not 1 <= top_k <= topk_group * (n_experts // n_group):
            raise ValueError(f"top_k {top_k} exceeds the {topk_group * (n_experts // n_group)} experts of {topk_group} groups")
        self.gate, self.bias, self.top_k = gate, bias, top_k
        gate.weight.role = "router"  # routing decisions stay at the stored precision
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self._host_bias: np.ndarray | None = None  # the bias on the host, copied at the first call

    def __call__(self, x, step: Step) -> tuple[np.ndarray, np.ndarray]:
        if self.bias is not None and self._host_bias is None:  # once: choosing experts happens on the host
            self._host_bias = step.ops.to_host(self.bias.value).astype(np.float32)
        bias = self._host_bias
        return step.ops.sigmoid_grouped_top_k(x, self.gate.weight.value, bias, self.top_k, self.n_group, self.topk_group,
                                              self.norm_topk_prob, self.routed_scaling_factor)

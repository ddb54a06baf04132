"""Routers beyond softmax top-k: the sigmoid, group-limited router of DeepSeek-V3
(``topk_method: noaux_tc``), also used by Kimi K2 and the GLM-4.5+ MoE models; the
softmax routers of DeepSeek-V2 (group-limited, scaled) and ERNIE 4.5 (a choice bias);
DeepSeek-V4's; Phi-MoE's sparsemixer."""

from __future__ import annotations

import numpy as np

from colibri_core.nn.layers import Linear, Step
from colibri_core.nn.weights import Param


class SigmoidGroupedTopKRouter:
    """Sigmoid expert scores; ``e_score_correction_bias`` is added for *choosing* experts
    only, never to the weights. Experts form ``n_group`` groups; a group's score is the
    sum of its two best (biased) scores; only experts of the ``topk_group`` best groups
    compete for the ``top_k`` slots. The chosen (unbiased) scores are renormalised to
    sum to one when ``norm_topk_prob``, then multiplied by ``routed_scaling_factor``;
    ``norm_eps``: what the sum gets before dividing (DeepSeek's 1e-20; LFM2's 1e-6, applied
    on the host to the backend's unrenormalised choice).

    The backend computes it (``Backend.sigmoid_grouped_top_k``); the reference does it
    on the host in float32, like transformers' router.
    """

    def __init__(self, gate: Linear, top_k: int, *, bias: Param | None = None, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 norm_eps: float = 1e-20):
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
        self.norm_eps = norm_eps
        self._host_bias: np.ndarray | None = None  # the bias on the host, copied at the first call

    def __call__(self, x, step: Step) -> tuple[np.ndarray, np.ndarray]:
        if self.bias is not None and self._host_bias is None:  # once: choosing experts happens on the host
            self._host_bias = step.ops.to_host(self.bias.value).astype(np.float32)
        bias = self._host_bias
        if self.norm_topk_prob and self.norm_eps != 1e-20:  # the backend's choice, renormalised here
            indices, weights = step.ops.sigmoid_grouped_top_k(x, self.gate.weight.value, bias, self.top_k, self.n_group,
                                                              self.topk_group, False, 1.0)
            weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(self.norm_eps))
            return indices, (weights * np.float32(self.routed_scaling_factor)).astype(np.float32)
        return step.ops.sigmoid_grouped_top_k(x, self.gate.weight.value, bias, self.top_k, self.n_group, self.topk_group,
                                              self.norm_topk_prob, self.routed_scaling_factor)


class SoftmaxGroupedTopKRouter:
    """Softmax routers beyond ``SoftmaxTopKRouter``: probabilities over all experts, then

    - DeepSeek-V2 (``topk_method`` ``greedy`` or ``group_limited_greedy``): with
      ``n_group`` > 1 only the experts of the ``topk_group`` groups with the highest best
      probability compete for the ``top_k`` slots; the chosen probabilities are not
      renormalised, only multiplied by ``routed_scaling_factor``;
    - ERNIE 4.5: ``bias`` (its e_score_correction_bias) added to the probabilities for
      choosing only; the chosen ones divided by max(their sum, ``norm_min``)
      (``renormalise``).

    Without a bias and groups it is the backend's ``softmax_top_k``, scaled on the host;
    otherwise the backend computes the logits (at the router's precision) and the host
    chooses (``colibri_core.compute.host.softmax_grouped_top_k``, the reference): one
    synchronisation per call, as every router.
    """

    def __init__(self, gate: Linear, top_k: int, *, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, bias: Param | None = None, renormalise: bool = False,
                 norm_min: float = 0.0):
        n_experts = gate.out_features
        if n_group < 1 or n_experts % n_group:
            raise ValueError(f"{n_experts} experts cannot form {n_group} equal groups")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group {topk_group} must be within 1..n_group ({n_group})")
        if not 1 <= top_k <= topk_group * (n_experts // n_group):
            raise ValueError(f"top_k {top_k} exceeds the {topk_group * (n_experts // n_group)} experts of {topk_group} groups")
        self.gate, self.top_k, self.bias = gate, top_k, bias
        gate.weight.role = "router"  # routing decisions stay at the stored precision
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.renormalise, self.norm_min = renormalise, norm_min
        self._host_bias: np.ndarray | None = None  # the bias on the host, copied at the first call

    def __call__(self, x, step: Step) -> tuple[np.ndarray, np.ndarray]:
        from colibri_core.compute import host

        ops = step.ops
        plain = not self.renormalise or self.norm_min * self.gate.out_features <= 1.0
        if self.n_group == 1 and self.bias is None and plain:
            # the top k of softmax probabilities: each is >= 1 / n_experts, so their sum
            # never falls below norm_min (a tiny floor against division by zero)
            indices, weights = ops.softmax_top_k(x, self.gate.weight.value, self.top_k, self.renormalise, None)
            if self.routed_scaling_factor != 1.0:
                weights = (weights * np.float32(self.routed_scaling_factor)).astype(np.float32)
            return indices, weights
        if self.bias is not None and self._host_bias is None:  # once: choosing experts happens on the host
            self._host_bias = ops.to_host(self.bias.value).astype(np.float32).reshape(-1)
        logits = ops.router_logits(x, self.gate.weight.value)
        return host.softmax_grouped_top_k(logits, self.top_k, self.n_group, self.topk_group, self.routed_scaling_factor,
                                          self._host_bias, self.renormalise, self.norm_min)


class SparseMixerRouter:
    """Phi-MoE's sparsemixer router (top 2), as transformers runs it in eval mode
    (deterministic: training's Gumbel sampling and jitter do not run): see
    ``colibri_core.compute.host.sparsemixer_top2``. The backend computes the logits (at
    the router's precision), the host chooses: one synchronisation per call, as every
    router."""

    top_k = 2

    def __init__(self, gate: Linear, jitter_eps: float):
        if gate.out_features < 2:
            raise ValueError(f"the sparsemixer router chooses 2 experts, the gate has {gate.out_features}")
        self.gate, self.jitter_eps = gate, float(jitter_eps)
        gate.weight.role = "router"  # routing decisions stay at the stored precision

    def __call__(self, x, step: Step) -> tuple[np.ndarray, np.ndarray]:
        from colibri_core.compute import host

        ops = step.ops
        bias = None if self.gate.bias is None else self.gate.bias.value
        logits = ops.router_logits(x, self.gate.weight.value, bias)
        return host.sparsemixer_top2(logits, self.jitter_eps)


class ScoredTopKRouter:
    """DeepSeek-V4's router (``Backend.scored_top_k``): expert scores f(x @ gate.T), f
    ``scoring`` ("sqrtsoftplus" or "sigmoid"); the ``top_k`` best of score + ``bias``
    (``e_score_correction_bias``, for choosing only) over all experts (no groups); their
    unbiased scores divided by their sum and multiplied by ``routed_scaling_factor``."""

    def __init__(self, gate: Linear, top_k: int, *, scoring: str, bias: Param | None = None,
                 routed_scaling_factor: float = 1.0):
        from colibri_core.compute.host import ROUTER_SCORINGS

        if scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router scoring {scoring!r} is not one of {ROUTER_SCORINGS}")
        if not 1 <= top_k <= gate.out_features:
            raise ValueError(f"top_k {top_k} must be within 1..{gate.out_features} experts")
        self.gate, self.top_k, self.scoring, self.bias = gate, top_k, scoring, bias
        self.routed_scaling_factor = routed_scaling_factor
        gate.weight.role = "router"  # routing decisions stay at the stored precision
        self._host_bias: np.ndarray | None = None

    def __call__(self, x, step: Step) -> tuple[np.ndarray, np.ndarray]:
        if self.bias is not None and self._host_bias is None:  # once: choosing experts happens on the host
            self._host_bias = step.ops.to_host(self.bias.value).astype(np.float32)
        return step.ops.scored_top_k(x, self.gate.weight.value, self._host_bias, self.top_k, self.scoring,
                                     self.routed_scaling_factor)


class HashRouter(ScoredTopKRouter):
    """DeepSeek-V4's hash-routed layers: each token's experts are a fixed function of its
    id (``tid2eid``, (vocab, top_k)), known before the layer runs, so a prefetcher can
    read them exactly (``experts_for``); the gate's scores still weight them as
    ``ScoredTopKRouter`` does. Reads the step's token ids (``Step.ids``)."""

    def __init__(self, gate: Linear, tid2eid: Param, *, scoring: str, routed_scaling_factor: float = 1.0):
        vocab, k = tid2eid.shape
        super().__init__(gate, k, scoring=scoring, routed_scaling_factor=routed_scaling_factor)
        self.tid2eid = tid2eid
        self._table: np.ndarray | None = None

    def table(self, ops) -> np.ndarray:
        """The host (vocab, top_k) int64 token -> experts table, checked once."""
        if self._table is None:
            table = ops.to_host(self.tid2eid.value)
            ids = table.astype(np.int64)
            n = self.gate.out_features
            if not np.array_equal(ids, table) or ids.min(initial=0) < 0 or ids.max(initial=0) >= n:
                from colibri_core.errors import ModelFormatError

                raise ModelFormatError(f"tensor {self.tid2eid.name!r} must hold expert ids 0..{n - 1}")
            ordered = np.sort(ids, axis=1)
            if (ordered[:, 1:] == ordered[:, :-1]).any():  # the store computes each expert once per token
                from colibri_core.errors import ModelFormatError

                raise ModelFormatError(f"tensor {self.tid2eid.name!r} routes a token to one expert twice")
            self._table = ids
        return self._table

    def experts_for(self, ids: np.ndarray, ops) -> np.ndarray:
        """The experts of tokens ``ids``: (T, top_k) host int64."""
        return self.table(ops)[np.asarray(ids, dtype=np.int64)]

    def __call__(self, x, step: Step) -> tuple[np.ndarray, np.ndarray]:
        if step.ids is None or len(step.ids) != x.shape[0]:
            raise ValueError("a hash-routed MoE layer needs the step's token ids, one per row")
        return step.ops.scored_top_k(x, self.gate.weight.value, None, self.top_k, self.scoring,
                                     self.routed_scaling_factor, self.experts_for(step.ids, step.ops))


class SigmoidTopKRouter:
    """Llama 4's router: the ``top_k`` experts of the highest logits x @ gate.T (of equal
    ones the lower index), each weighted by the sigmoid of its logit, not renormalised
    (transformers' ``Llama4Router``). The backend computes the logits (at the router's
    precision), the host chooses: one synchronisation per call, as every router. Llama 4
    applies the weights to the experts' inputs: ``SparseMoE(weight_inputs=True)``."""

    def __init__(self, gate: Linear, top_k: int):
        if not 1 <= top_k <= gate.out_features:
            raise ValueError(f"top_k {top_k} must be within 1..{gate.out_features} experts")
        self.gate, self.top_k = gate, top_k
        gate.weight.role = "router"  # routing decisions stay at the stored precision

    def __call__(self, x, step: Step) -> tuple[np.ndarray, np.ndarray]:
        from colibri_core.compute import host

        ops = step.ops
        bias = None if self.gate.bias is None else self.gate.bias.value
        logits = ops.router_logits(x, self.gate.weight.value, bias)
        indices = host.top_k_indices(logits, self.top_k)
        chosen = np.take_along_axis(logits, indices, axis=-1)
        return indices, (np.float32(1.0) / (np.float32(1.0) + np.exp(-chosen))).astype(np.float32)

"""Norm variants beyond the plain ``RMSNorm`` of ``layers.py``.

A norm that scales by (1 + w) (Qwen3-Next, Gemma) is a plain ``RMSNorm`` whose weight
gets 1 added at load: ``Weights.rms_norm(prefix, dim, eps, offset=True)``.
"""

from __future__ import annotations

from colibri_core.nn.layers import Step
from colibri_core.nn.weights import Param


class GatedRMSNorm:
    """RMSNorm(x) * w * silu(gate), over the last axis (the output norm of Gated DeltaNet,
    transformers' ``Qwen3NextRMSNormGated``: norm first, then the gate)."""

    def __init__(self, weight: Param, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x, gate, step: Step):
        ops = step.ops
        return ops.silu(gate) * ops.rms_norm(x, self.weight.value, self.eps)

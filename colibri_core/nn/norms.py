"""Norm variants beyond the plain ``RMSNorm`` of ``layers.py``.

A norm that scales by (1 + w) (Qwen3-Next, Gemma) is a plain ``RMSNorm`` whose weight
gets 1 added at load: ``Weights.rms_norm(prefix, dim, eps, offset=True)``.
"""

from __future__ import annotations

from colibri_core.nn.layers import Step
from colibri_core.nn.weights import Param


class GatedRMSNorm:
    """RMSNorm(x) * w * act(gate), over the last axis (the output norm of Gated DeltaNet,
    transformers' ``Qwen3NextRMSNormGated``: norm first, then the gate). ``activation``:
    "silu" (Gated DeltaNet) or "sigmoid" (Kimi Delta Attention's ``o_norm``)."""

    ACTIVATIONS = ("silu", "sigmoid")

    def __init__(self, weight: Param, eps: float, activation: str = "silu"):
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"GatedRMSNorm activation {activation!r} is not one of {self.ACTIVATIONS}")
        self.weight, self.eps, self.activation = weight, eps, activation

    def __call__(self, x, gate, step: Step):
        ops = step.ops
        act = ops.silu if self.activation == "silu" else ops.sigmoid
        return act(gate) * ops.rms_norm(x, self.weight.value, self.eps)

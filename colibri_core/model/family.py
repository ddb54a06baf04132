"""The family interface: how a plugin describes an architecture to the core.

A family is a class with ``build(config, weights) -> CausalLM``. It parses config.json
into its typed ``ModelArgs`` (``from_dict`` range-checks every size), declares its
weights through ``weights`` (``param``, ``linear``, ``rms_norm``, ``expert_layer``) and
composes the shared blocks of ``colibri_core.nn``. The core owns everything else:
loading, placement, the expert store, the generation loop, sampling and statistics.
"""

from __future__ import annotations

from typing import Any

from colibri_core.nn.layers import CausalLM
from colibri_core.nn.weights import Weights


class Family:
    """Base class; subclasses set ``name`` and implement ``build``."""

    name = "base"

    def build(self, config: dict[str, Any], weights: Weights) -> CausalLM:
        raise NotImplementedError

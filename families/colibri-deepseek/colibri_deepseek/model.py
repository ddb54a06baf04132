"""DeepSeek-V3 and V3.2 on colibri's shared blocks (transformers: models/deepseek_v3,
models/deepseek_v32). MLA, the DSA indexer, the sigmoid grouped router, the fp8 format
and the layer assembly (``colibri_core.nn.builders``) are colibri_core's; this file
only sets DeepSeek's config defaults and its rope layout."""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.model.config import bounded
from colibri_core.model.family import Family
from colibri_core.nn.builders import DSAArgs, MLAArgs, Names, build_mla_model

__all__ = ["DeepseekV3", "DeepseekV32", "DeepseekV3Args", "DeepseekV32Args", "Names", "build_deepseek"]


@dataclass(kw_only=True)
class DeepseekV3Args(MLAArgs):
    """DeepSeek-V3's defaults (transformers' DeepseekV3Config) on the shared MLA fields."""

    n_group: int = bounded(1, 1 << 10, default=8)
    topk_group: int = bounded(1, 1 << 10, default=4)
    routed_scaling_factor: float = bounded(0.0, 1e6, default=2.5)
    first_k_dense_replace: int = bounded(0, 1 << 10, default=3)


@dataclass(kw_only=True)
class DeepseekV32Args(DeepseekV3Args, DSAArgs):
    """DeepSeek-V3.2: V3's defaults plus the DSA indexer fields."""


def build_deepseek(a: DeepseekV3Args, config: dict, w, names: Names = Names(), *, interleave: bool | None = None,
                   **lm_kwargs):
    """The DeepSeek-V3 text model (also V3.2 when ``a`` has index fields, and Kimi K2)."""
    return build_mla_model(a, config, w, names, interleave=interleave, **lm_kwargs)


class DeepseekV3(Family):
    name = "deepseek-v3"

    def build(self, config, w):
        return build_deepseek(DeepseekV3Args.from_dict(config, w.config_source), config, w)


class DeepseekV32(Family):
    name = "deepseek-v32"

    def build(self, config, w):
        # V3.2's MLA always uses interleaved rope (transformers has no rope_interleave for it);
        # its indexer uses the half-split layout.
        return build_deepseek(DeepseekV32Args.from_dict(config, w.config_source), config, w, interleave=True)

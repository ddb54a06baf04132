"""DeepSeek-V3 and V3.2 on colibri's shared blocks (transformers: models/deepseek_v3,
models/deepseek_v32). MLA, the DSA indexer, the sigmoid grouped router, the fp8 format,
DeepSeek-V3's config defaults (``colibri_core.model.builders``) and the decoder assembly
(``colibri_core.nn.assembly``) are colibri_core's; this file only adds V3.2's index
fields and its rope layout."""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.model.builders import DeepseekV3Args, DSAArgs, MLAMoEFamily


@dataclass(kw_only=True)
class DeepseekV32Args(DeepseekV3Args, DSAArgs):
    """DeepSeek-V3.2: V3's defaults plus the DSA indexer fields."""


class DeepseekV3(MLAMoEFamily):
    name, args = "deepseek-v3", DeepseekV3Args


class DeepseekV32(MLAMoEFamily):
    name, args = "deepseek-v32", DeepseekV32Args
    # V3.2's MLA always uses interleaved rope (transformers has no rope_interleave for it);
    # its indexer uses the half-split layout.
    mixer_options = {"interleave": True}

"""colibri-xiaomi: Xiaomi's MiMo-V2-Flash family (Hugging Face model_type ``mimo_v2_flash``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="mimo_v2_flash", model_types=("mimo_v2_flash",), architectures=("MiMoV2FlashForCausalLM",),
               impl="colibri_xiaomi.model:MiMoV2Flash",
               description="MiMo-V2-Flash: grouped-query attention with value heads narrower than q/k heads and "
                           "scaled values, partial RoPE of a theta per layer type, sliding-window layers with twice "
                           "the KV heads and attention sinks beside full layers, a sigmoid router with a correction "
                           "bias, a dense first layer"),
)

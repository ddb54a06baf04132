"""colibri-liquid: Liquid AI's LFM2-MoE family (Hugging Face model_type ``lfm2_moe``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="lfm2_moe", model_types=("lfm2_moe",), architectures=("Lfm2MoeForCausalLM",),
               impl="colibri_liquid.model:Lfm2Moe",
               description="LFM2-MoE: gated short-convolution layers beside GQA layers with per-head q/k RMSNorm, "
                           "sigmoid router with an expert bias, dense first layers"),
)

"""colibri-arcee: Arcee's AFMoE family (Hugging Face model_type ``afmoe``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="afmoe", model_types=("afmoe",), architectures=("AfmoeForCausalLM",),
               impl="colibri_arcee.model:Afmoe",
               description="AFMoE (Trinity): norms before and after attention and MLP, gated GQA with per-head q/k "
                           "RMSNorm, sliding layers with RoPE beside global NoPE layers, sigmoid router with an "
                           "expert bias, shared experts, dense first layers"),
)

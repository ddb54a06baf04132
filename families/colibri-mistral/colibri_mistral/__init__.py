"""colibri-mistral: Mistral AI's MoE family (Hugging Face model_type ``mixtral``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="mixtral", model_types=("mixtral",),
               architectures=("MixtralForCausalLM",),
               impl="colibri_mistral.model:Mixtral",
               description="Mixtral: GQA with RoPE (optional sliding window), softmax top-k router renormalised, "
                           "SwiGLU experts (w1/w3/w2 or fused)"),
)

"""colibri-olmoe: the OLMoE family (Hugging Face model_type ``olmoe``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="olmoe", model_types=("olmoe",),
               architectures=("OlmoeForCausalLM",),
               impl="colibri_olmoe.model:Olmoe",
               description="OLMoE: softmax top-k router, q/k RMSNorm over the full projection, optional qkv clipping"),
)

"""colibri-olmoe: the OLMoE family (Hugging Face model_type ``olmoe``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="olmoe", model_types=("olmoe",),
               architectures=("OlmoeForCausalLM",),
               impl="colibri_olmoe.model:Olmoe",
               description="OLMoE: softmax top-k router, q/k RMSNorm over the full projection, optional qkv clipping"),
    # colibri-olmoe's other families (not in colibri new-family's template)
    FamilySpec(name="flex_olmo", model_types=("flex_olmo",), architectures=("FlexOlmoForCausalLM",),
               impl="colibri_olmoe.flex_olmo:FlexOlmo",
               description="FlexOlmo: OLMo 2 layers (norms after attention and MLP, q/k RMSNorm over the full "
                           "projection), softmax top-k router"),
)

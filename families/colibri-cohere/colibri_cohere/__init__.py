"""colibri-cohere: Cohere's MoE family (Hugging Face model_type ``cohere2_moe``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="cohere2_moe", model_types=("cohere2_moe",), architectures=("Cohere2MoeForCausalLM",),
               impl="colibri_cohere.model:Cohere2Moe",
               description="Cohere 2 MoE: parallel attention and MLP on one norm, sliding layers with interleaved "
                           "RoPE beside global NoPE layers, softmax or sigmoid top-k router, shared experts summed "
                           "or averaged, scaled logits"),
)

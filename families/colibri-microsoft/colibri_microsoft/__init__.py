"""colibri-microsoft: Microsoft's Phi-MoE family (Hugging Face model_type ``phimoe``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="phimoe", model_types=("phimoe",), architectures=("PhimoeForCausalLM", "PhiMoEForCausalLM"),
               impl="colibri_microsoft.model:PhiMoe",
               description="Phi-MoE (Phi-3.5-MoE): LayerNorm decoders with biases, GQA, the sparsemixer top-2 "
                           "router, LongRoPE"),
)

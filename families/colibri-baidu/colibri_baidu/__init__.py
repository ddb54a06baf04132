"""colibri-baidu: Baidu's ERNIE 4.5 MoE family (Hugging Face model_type ``ernie4_5_moe``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="ernie4_5_moe", model_types=("ernie4_5_moe",), architectures=("Ernie4_5_MoeForCausalLM",),
               impl="colibri_baidu.model:Ernie4_5Moe",
               description="ERNIE 4.5 MoE: GQA with interleaved-pair RoPE, softmax router choosing with a score "
                           "correction bias, renormalised, shared experts, dense first layers"),
)

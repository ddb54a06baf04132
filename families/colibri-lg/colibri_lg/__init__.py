"""colibri-lg: LG AI Research's K-EXAONE family (Hugging Face model_type ``exaone_moe``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="exaone_moe", model_types=("exaone_moe",), architectures=("ExaoneMoeForCausalLM",),
               impl="colibri_lg.model:ExaoneMoe",
               description="K-EXAONE: GQA with per-head q/k RMSNorm, sliding-window layers with RoPE beside global "
                           "NoPE layers, sigmoid group-limited router with a choice bias, shared experts, dense "
                           "first layers"),
)

"""colibri-rednote: rednote-hilab's dots.llm1 family (Hugging Face model_type ``dots1``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="dots1", model_types=("dots1",), architectures=("Dots1ForCausalLM",),
               impl="colibri_rednote.model:Dots1",
               description="dots.llm1: GQA with per-head q/k RMSNorm (optional sliding layers), DeepSeek-V3's "
                           "sigmoid group-limited router with a choice bias, shared experts, dense first layers"),
)

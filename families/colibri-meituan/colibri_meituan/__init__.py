"""colibri-meituan: Meituan's LongCat-Flash family (Hugging Face model_type ``longcat_flash``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="longcat_flash", model_types=("longcat_flash",), architectures=("LongcatFlashForCausalLM",),
               impl="colibri_meituan.model:LongcatFlash",
               description="LongCat-Flash: layers of two MLA attention sublayers with their dense MLPs and a shortcut "
                           "MoE whose output joins after the second; a softmax router with a correction bias over "
                           "routed experts and zero-computation (identity) experts that are never read"),
)

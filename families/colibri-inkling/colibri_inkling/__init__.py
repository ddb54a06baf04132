"""colibri-inkling: Inkling (model_type ``inkling_text``) and the text model of the
multimodal ``inkling_mm_model`` checkpoint (image, audio and video input refused).
"""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="inkling", model_types=("inkling_text", "inkling_mm_model"),
               architectures=("InklingForCausalLM", "InklingForConditionalGeneration"),
               impl="colibri_inkling.model:Inkling",
               description="Inkling: relative-bias attention (sliding + full), short convolutions, sigmoid MoE with "
                           "router-weighted shared experts; the multimodal checkpoint's text model (media refused)"),
)

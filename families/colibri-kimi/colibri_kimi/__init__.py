"""colibri-kimi: Kimi K2 (model_type ``kimi_k2``) and the text model of Kimi K2.5
(``kimi_k25``), both the DeepSeek-V3 architecture, and Kimi Linear (``kimi_linear``):
Kimi Delta Attention beside NoPE MLA.
"""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="kimi", model_types=("kimi_k2", "kimi_k25"),
               architectures=("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"),
               impl="colibri_kimi.model:Kimi",
               description="Kimi K2 / K2.5 text model (DeepSeek-V3 architecture); K2.5 image and video input refused"),
    FamilySpec(name="kimi_linear", model_types=("kimi_linear",),
               architectures=("KimiLinearForCausalLM",),
               impl="colibri_kimi.linear:KimiLinear",
               description="Kimi Linear: Kimi Delta Attention (per-channel gated delta rule) + NoPE MLA, sigmoid MoE"),
)

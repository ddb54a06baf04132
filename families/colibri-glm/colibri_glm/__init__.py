"""colibri-glm: GLM-4.5/4.6 (model_type ``glm4_moe``), GLM-4.7-Flash (``glm4_moe_lite``),
GLM-5 (``glm_moe_dsa``) and GLM-5 Next (``glm5_next``, its text model).
"""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="glm4-moe", model_types=("glm4_moe",),
               architectures=("Glm4MoeForCausalLM",),
               impl="colibri_glm.model:Glm4Moe",
               description="GLM-4.5/4.6: grouped-query attention with partial rotary and q/k norm, sigmoid router, shared experts"),
    FamilySpec(name="glm4-moe-lite", model_types=("glm4_moe_lite",),
               architectures=("Glm4MoeLiteForCausalLM",),
               impl="colibri_glm.model:Glm4MoeLite",
               description="GLM-4.7-Flash: MLA with a latent KV cache and the GLM sigmoid router"),
    FamilySpec(name="glm-moe-dsa", model_types=("glm_moe_dsa",),
               architectures=("GlmMoeDsaForCausalLM",),
               impl="colibri_glm.model:GlmMoeDsa",
               description="GLM-5: MLA plus DSA sparse attention (interleaved-rope indexer, shared indexer layers)"),
    FamilySpec(name="glm5-next", model_types=("glm5_next",),
               architectures=("Glm5NextForConditionalGeneration",),
               impl="colibri_glm.glm5_next:Glm5Next",
               description="GLM-5 Next (text model): KDA linear attention with a bounded decay beside NoPE MLA with a "
                           "pooled DSA indexer, clamped SwiGLU MoE, manifold hyper-connections"),
)

"""colibri-hunyuan: Tencent's Hunyuan MoE families (Hugging Face model_types ``hunyuan_v1_moe``, ``hy_v3``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="hunyuan_v1_moe", model_types=("hunyuan_v1_moe",), architectures=("HunYuanMoEV1ForCausalLM",),
               impl="colibri_hunyuan.model:HunYuanMoeV1",
               description="Hunyuan MoE (Hunyuan-A13B): GQA with per-head q/k RMSNorm after RoPE, NTK-alpha RoPE, "
                           "renormalised softmax router (top-k per layer), a shared MLP in every layer"),
    FamilySpec(name="hy_v3", model_types=("hy_v3",), architectures=("HYV3ForCausalLM",),
               impl="colibri_hunyuan.hy_v3:HYV3",
               description="Hy3: GQA with per-head q/k RMSNorm before RoPE, dense layers by mlp_layer_types, "
                           "sigmoid router with a choice-only expert bias (renormalised, scaled), a shared MLP"),
)

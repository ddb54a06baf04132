"""colibri-hunyuan: Tencent's Hunyuan MoE family (Hugging Face model_type ``hunyuan_v1_moe``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="hunyuan_v1_moe", model_types=("hunyuan_v1_moe",), architectures=("HunYuanMoEV1ForCausalLM",),
               impl="colibri_hunyuan.model:HunYuanMoeV1",
               description="Hunyuan MoE (Hunyuan-A13B): GQA with per-head q/k RMSNorm after RoPE, NTK-alpha RoPE, "
                           "renormalised softmax router (top-k per layer), a shared MLP in every layer"),
)

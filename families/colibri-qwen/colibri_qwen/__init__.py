"""colibri-qwen: the Qwen MoE families (Hugging Face model_type ``qwen2_moe``,
``qwen3_moe``, ``qwen3_next``, ``qwen3_5_moe``, ``qwen3_5_moe_text`` and ``qwen3_vl_moe``).

Imports only colibri_core's light modules: the architectures load when a model runs.
"""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="qwen2_moe", model_types=("qwen2_moe",), architectures=("Qwen2MoeForCausalLM",),
               impl="colibri_qwen.model:Qwen2Moe",
               description="Qwen1.5/Qwen2 MoE: GQA with q/k/v bias, shared expert with a sigmoid gate, dense mlp_only_layers"),
    FamilySpec(name="qwen3_moe", model_types=("qwen3_moe",), architectures=("Qwen3MoeForCausalLM",),
               impl="colibri_qwen.model:Qwen3Moe",
               description="Qwen3 MoE: GQA with per-head q/k RMSNorm, norm_topk_prob"),
    FamilySpec(name="qwen3_next", model_types=("qwen3_next",), architectures=("Qwen3NextForCausalLM",),
               impl="colibri_qwen.model:Qwen3Next",
               description="Qwen3-Next: Gated DeltaNet + gated full attention (3:1), (1+w) RMSNorms, shared expert"),
    FamilySpec(name="qwen3_5_moe", model_types=("qwen3_5_moe",), architectures=("Qwen3_5MoeForConditionalGeneration",),
               impl="colibri_qwen.model:Qwen3_5Moe",
               description="Qwen3.5/3.6 MoE: the text model of the vision-language checkpoint (images refused)"),
    FamilySpec(name="qwen3_5_moe_text", model_types=("qwen3_5_moe_text",), architectures=("Qwen3_5MoeForCausalLM",),
               impl="colibri_qwen.model:Qwen3_5MoeText",
               description="Qwen3.5/3.6 MoE's text model saved on its own (flat config, model.* weights)"),
    FamilySpec(name="qwen3_vl_moe", model_types=("qwen3_vl_moe",), architectures=("Qwen3VLMoeForConditionalGeneration",),
               impl="colibri_qwen.model:Qwen3VLMoe",
               description="Qwen3-VL MoE: the text model (Qwen3-MoE layers, MRoPE as plain RoPE for text; images refused)"),
)


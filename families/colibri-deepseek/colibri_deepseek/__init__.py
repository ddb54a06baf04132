"""colibri-deepseek: DeepSeek-V2, DeepSeek-V3, DeepSeek-V3.2 and DeepSeek-V4 (model_type
``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``, ``deepseek_v4``).
"""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="deepseek-v2", model_types=("deepseek_v2",),
               architectures=("DeepseekV2ForCausalLM",),
               impl="colibri_deepseek.model:DeepseekV2",
               description="DeepSeek-V2 / V2-Lite: MLA, softmax router (greedy or group-limited, scaled), shared experts"),
    FamilySpec(name="deepseek-v3", model_types=("deepseek_v3",),
               architectures=("DeepseekV3ForCausalLM",),
               impl="colibri_deepseek.model:DeepseekV3",
               description="DeepSeek-V3: MLA with a latent KV cache, sigmoid group-limited router, shared experts"),
    FamilySpec(name="deepseek-v32", model_types=("deepseek_v32",),
               architectures=("DeepseekV32ForCausalLM",),
               impl="colibri_deepseek.model:DeepseekV32",
               description="DeepSeek-V3.2: DeepSeek-V3 plus DSA sparse attention (lightning indexer)"),
    FamilySpec(name="deepseek-v4", model_types=("deepseek_v4",),
               architectures=("DeepseekV4ForCausalLM",),
               impl="colibri_deepseek.v4:DeepseekV4",
               description="DeepSeek-V4: hyper-connections, sliding-window + compressed (CSA/HCA) attention with sinks, "
                           "hash and sqrt-softplus routed MoE"),
)

"""colibri-minimax: MiniMax's MiniMax-M2 family (Hugging Face model_type ``minimax_m2``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="minimax_m2", model_types=("minimax_m2",), architectures=("MiniMaxM2ForCausalLM",),
               impl="colibri_minimax.model:MiniMaxM2",
               description="MiniMax-M2: GQA with q/k RMSNorm over the full projection and partial RoPE, sigmoid "
                           "top-k router choosing with a score correction bias, renormalised, every layer MoE"),
)

"""colibri-minimax: MiniMax's families, MiniMax-M2 (Hugging Face model_type ``minimax_m2``) and
MiniMax-Text-01 / MiniMax-M1 (``minimax``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="minimax_m2", model_types=("minimax_m2",), architectures=("MiniMaxM2ForCausalLM",),
               impl="colibri_minimax.model:MiniMaxM2",
               description="MiniMax-M2: GQA with q/k RMSNorm over the full projection and partial RoPE, sigmoid "
                           "top-k router choosing with a score correction bias, renormalised, every layer MoE"),
    FamilySpec(name="minimax", model_types=("minimax",), architectures=("MiniMaxForCausalLM",),
               impl="colibri_minimax.text01:MiniMax",
               description="MiniMax-Text-01 / M1: lightning attention (linear, a fixed decay per head) "
                           "interleaved with GQA softmax attention, residuals from the normalised input scaled, "
                           "softmax top-k router renormalised, every layer MoE"),
)

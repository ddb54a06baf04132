"""colibri-ibm: IBM's Granite MoE families (Hugging Face model_type ``granitemoe``,
``granitemoeshared`` and ``granitemoehybrid``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="granitemoe", model_types=("granitemoe",), architectures=("GraniteMoeForCausalLM",),
               impl="colibri_ibm.model:GraniteMoe",
               description="Granite 3.0/3.1 MoE: GQA with RoPE, muP multipliers (embedding, attention, residual, "
                           "logits), softmax over the top-k router logits, fused SwiGLU experts"),
    FamilySpec(name="granitemoeshared", model_types=("granitemoeshared",),
               architectures=("GraniteMoeSharedForCausalLM",), impl="colibri_ibm.model:GraniteMoe",
               description="Granite MoE with a dense shared SwiGLU expert beside the routed ones"),
    FamilySpec(name="granitemoehybrid", model_types=("granitemoehybrid",),
               architectures=("GraniteMoeHybridForCausalLM",), impl="colibri_ibm.model:GraniteMoeHybrid",
               description="Granite 4 hybrid MoE: Mamba-2 layers beside GQA layers (NoPE, or RoPE), muP multipliers, "
                           "softmax over the top-k router logits, SwiGLU experts with a dense shared SwiGLU"),
)

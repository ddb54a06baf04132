"""colibri-ibm: IBM's Granite MoE families (Hugging Face model_type ``granitemoe`` and
``granitemoeshared``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="granitemoe", model_types=("granitemoe",), architectures=("GraniteMoeForCausalLM",),
               impl="colibri_ibm.model:GraniteMoe",
               description="Granite 3.0/3.1 MoE: GQA with RoPE, muP multipliers (embedding, attention, residual, "
                           "logits), softmax over the top-k router logits, fused SwiGLU experts"),
    FamilySpec(name="granitemoeshared", model_types=("granitemoeshared",),
               architectures=("GraniteMoeSharedForCausalLM",), impl="colibri_ibm.model:GraniteMoe",
               description="Granite MoE with a dense shared SwiGLU expert beside the routed ones"),
)

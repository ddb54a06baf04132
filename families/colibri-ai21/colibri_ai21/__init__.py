"""colibri-ai21: AI21's Jamba hybrids (Hugging Face model_type ``jamba``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="jamba", model_types=("jamba",), architectures=("JambaForCausalLM",),
               impl="colibri_ai21.model:Jamba",
               description="Jamba / Jamba 1.5 / 1.6 / 1.7: Mamba (v1) layers with dt/B/C RMS norms beside NoPE GQA "
                           "layers, SwiGLU MoE (softmax top-k, not renormalised) every other layer, dense SwiGLU "
                           "between"),
)

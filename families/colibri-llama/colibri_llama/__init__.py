"""colibri-llama: Meta's Llama 4 MoE family (Hugging Face model_type ``llama4_text``, and
the text model of the multimodal ``llama4`` checkpoints)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="llama4_text", model_types=("llama4_text",), architectures=("Llama4ForCausalLM",),
               impl="colibri_llama.model:Llama4Text",
               description="Llama 4: chunked attention with RoPE (interleaved pairs, L2 q/k norm) beside NoPE layers "
                           "(attention temperature tuning), dense and MoE layers interleaved, a top-k router whose "
                           "sigmoid weights scale the experts' inputs, a shared expert"),
    FamilySpec(name="llama4", model_types=("llama4",), architectures=("Llama4ForConditionalGeneration",),
               impl="colibri_llama.model:Llama4",
               description="Llama 4: the text model of the multimodal checkpoint (images refused)"),
)

"""colibri-gpt-oss: OpenAI's gpt-oss (Hugging Face model_type ``gpt_oss``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="gpt_oss", model_types=("gpt_oss",),
               architectures=("GptOssForCausalLM",),
               impl="colibri_gpt_oss.model:GptOss",
               description="gpt-oss: sliding and full attention with learned sinks, biased router and experts, clamped SwiGLU"),
)

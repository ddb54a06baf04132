"""colibri-nvidia: NVIDIA's Nemotron-H hybrids (Hugging Face model_type ``nemotron_h``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="nemotron_h", model_types=("nemotron_h",), architectures=("NemotronHForCausalLM",),
               impl="colibri_nvidia.model:NemotronH",
               description="Nemotron-H / Nemotron 3: Mamba-2, NoPE GQA attention, squared-ReLU MLP and MoE layers "
                           "(one mixer per layer), sigmoid group-limited router with a correction bias, "
                           "a squared-ReLU shared expert"),
)

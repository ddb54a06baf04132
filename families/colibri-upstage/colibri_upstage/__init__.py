"""colibri-upstage: Upstage's Solar Open family (Hugging Face model_type ``solar_open``)."""

from colibri_core.plugins.registry import FamilySpec, family_hook

colibri_register_families = family_hook(
    FamilySpec(name="solar_open", model_types=("solar_open",), architectures=("SolarOpenForCausalLM",),
               impl="colibri_upstage.model:SolarOpen",
               description="Solar Open: GQA with RoPE, every layer MoE: sigmoid group-limited router with a "
                           "choice bias, shared experts"),
)

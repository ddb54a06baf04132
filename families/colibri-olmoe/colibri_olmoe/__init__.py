"""colibri-olmoe: the OLMoE family (Hugging Face model_type ``olmoe``).

Imports only colibri_core's light modules: the architecture loads when a model runs.
"""

from colibri_core.plugins.registry import FamilySpec, family_hook

__version__ = "0.1.0"

colibri_register_families = family_hook(
    FamilySpec(name="olmoe", model_types=("olmoe",),
               architectures=("OlmoeForCausalLM",),
               impl="colibri_olmoe.model:Olmoe",
               description="OLMoE: softmax top-k router, q/k RMSNorm over the full projection, optional qkv clipping"),
)

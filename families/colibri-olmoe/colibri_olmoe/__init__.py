"""colibri-olmoe: the OLMoE family (Hugging Face model_type ``olmoe``).

Imports only colibri_core's light modules: the architecture loads when a model runs.
"""

from colibri_core import hookimpl
from colibri_core.plugins.registry import FamilySpec

__version__ = "0.1.0"


@hookimpl
def colibri_register_families(register):
    register(
        FamilySpec(
            name="olmoe",
            model_types=("olmoe",),
            architectures=("OlmoeForCausalLM",),
            impl="colibri_olmoe.model:Olmoe",
            description="OLMoE: softmax top-k router, q/k RMSNorm over the full projection, optional qkv clipping",
        )
    )

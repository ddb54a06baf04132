"""colibri-ray: the ``ray`` compute tier (routed experts computed by Ray actors, each
owning a shard of the experts) and its options (``--ray``, ``--ray-workers``, ...) on
the commands that load or plan a model.

Imports only colibri_core's registry at import time: Ray loads when a model is loaded
with ``--ray``.
"""

from colibri_core import hookimpl
from colibri_core.plugins.registry import LoadOptionsSpec, TierSpec

__version__ = "0.1.0"


@hookimpl
def colibri_register_tiers(register):
    register(TierSpec("ray", "colibri_ray.tier:RayTier",
                      "routed experts computed by Ray actors on other machines, each owning a shard (rendezvous hashing "
                      "over their RAM) with its own RAM tier and disk; the coordinator's disk path covers a failed worker",
                      role="compute"))


@hookimpl
def colibri_register_load_options(register):
    register(LoadOptionsSpec("ray", "colibri_ray.options:RayOptions",
                             "--ray ADDRESS|local, --ray-workers N, --ray-worker-ram, --ray-timeout"))

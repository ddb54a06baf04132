"""colibri-vulkan: the Vulkan compute backend (``--backend vulkan``).

The plugin module (``colibri_vulkan.plugin``) and the probe (``colibri_vulkan.probe``)
import neither the ``vulkan`` binding nor numpy; the backend (``colibri_vulkan.backend``)
loads when a model runs on it.
"""

__version__ = "0.1.0"

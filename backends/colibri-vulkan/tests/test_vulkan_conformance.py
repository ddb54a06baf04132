"""The conformance kit on the Vulkan backend (every shader, against the numpy reference)."""

import pytest

from colibri_core.testing.backend_kit import BackendConformanceSuite
from colibri_vulkan import probe

REASON = probe.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no Vulkan here: {REASON}")


class TestVulkanBackend(BackendConformanceSuite):
    # float32 in every shader; products sum in another order than numpy (and packed weights
    # are decoded exactly), so the kit's defaults hold
    def make_backend(self):
        from colibri_vulkan.backend import VulkanBackend

        return VulkanBackend()

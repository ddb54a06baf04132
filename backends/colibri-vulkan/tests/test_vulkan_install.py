"""colibri-vulkan as a user installs it: into a fresh venv beside colibri-core and a family,
listed with the physical device it found and run to the cpu backend's tokens through the
device tier; without a Vulkan driver, or without the binding, it is listed as unavailable
with the reason, ``--backend vulkan`` is a one-line error and cpu still runs; uninstalled,
it is gone (``BackendInstallSuite``)."""

import pytest

from colibri_core.testing.install import Absence, BackendInstallSuite
from colibri_vulkan import probe

REASON = probe.unavailable_reason()
NO_DRIVER = "/nonexistent/no-driver.json"  # the loader finds no driver where these point


@pytest.mark.skipif(REASON is not None, reason=f"no Vulkan here: {REASON}")
class TestVulkanInstall(BackendInstallSuite):
    backend = "vulkan"
    num_experts = 8
    # a device tier holding a quarter of the experts: hits and misses both happen
    run_options = ("--ram", "160K", "--vram", "26K")
    absences = (Absence("found no driver", env={"VK_ICD_FILENAMES": NO_DRIVER, "VK_DRIVER_FILES": NO_DRIVER}),
                Absence("vulkan Python binding is not installed", uninstall=("vulkan",)))

    def check_installed(self, installed):
        assert installed.listed()["device"] == probe.chosen_device().describe()

    def check_run(self, output):
        assert output["stats"]["hits_device"] > 0, output["stats"]

"""colibri-mlx as a user installs it: into a fresh venv beside colibri-core and a family,
listed with its device and run to the cpu backend's tokens; without mlx it is listed as
unavailable and everything else works; uninstalled, it is gone (``BackendInstallSuite``)."""

from colibri_core.testing.install import Absence, BackendInstallSuite


class TestMlxInstall(BackendInstallSuite):
    backend = "mlx"
    extras = "cpu"  # mlx's CPU build: the test runs on Linux too
    absences = (Absence("mlx is not installed", uninstall=("mlx-cpu", "mlx")),)

    def check_installed(self, installed):
        listed = installed.listed()
        assert listed["available"] and listed["device"] in ("cpu", "gpu"), listed

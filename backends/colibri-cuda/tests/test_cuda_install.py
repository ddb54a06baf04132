"""colibri-cuda as a user installs it (``pip install colibri-core colibri-olmoe
colibri-cuda``, no extra): into a fresh venv, from the built distributions, it pulls
CuPy's CUDA 12 build and the CUDA libraries it loads, so that on a machine with an NVIDIA
driver ``--backend cuda`` works as installed. Here (no driver) the backend is listed as
unavailable for the driver's reason, not CuPy's, ``colibri doctor`` names the CUDA
runtime and NVRTC it found, ``--backend cuda`` is refused in one line and everything else
is unchanged; uninstalled, it is gone (``BackendInstallSuite``)."""

import json

from colibri_core.testing.install import BackendInstallSuite


class TestCudaInstall(BackendInstallSuite):
    backend = "cuda"
    always_available = False  # a machine without an NVIDIA driver or GPU, as CI's, lists it unavailable

    def check_installed(self, installed):
        venv = installed.venv
        assert venv.imports("cupy"), "pip install colibri-cuda brings CuPy"
        package_sources = venv.python.parent.parent / "lib"
        assert {p.name for p in package_sources.glob("python3*/site-packages/colibri_cuda/kernels/*.cu")} >= {
            "gemv.cu", "experts.cu", "attention.cu"}, "the kernels' sources come with the package"
        assert venv.backends()["cpu"]["available"]

        doctor = venv.colibri("doctor", "--model", installed.model, "--json")
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        cuda = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}["CUDA"]
        # CuPy's CUDA 12 runtime and the NVRTC that compiles the kernels are there without a CUDA toolkit
        assert "CUDA runtime 12." in cuda["detail"] and "cupy-cuda12x" in cuda["detail"] and "NVRTC 12." in cuda["detail"], cuda
        listed = installed.listed()
        if not listed["available"]:  # the driver's reason, not CuPy's
            assert listed["reason"].startswith(("no CUDA driver", "no CUDA device", "the CUDA driver")), listed
            assert cuda["status"] == "warn"

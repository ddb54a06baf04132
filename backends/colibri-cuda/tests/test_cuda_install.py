"""colibri-cuda as a user installs it (``pip install colibri-core colibri-olmoe
colibri-cuda``, no extra): into a fresh venv, from the built distributions, it pulls
CuPy's CUDA 12 build and the CUDA libraries it loads, so that on a machine with an NVIDIA
driver ``--backend cuda`` works as installed. Here (no driver) the backend is listed as
unavailable for the driver's reason, not CuPy's, ``colibri doctor`` names the CUDA
runtime and NVRTC it found, ``--backend cuda`` is refused in one line and everything else
is unchanged; uninstalled, it is gone."""

import json
from pathlib import Path

import pytest

from colibri_core.testing.venv import fresh_venv

REPO = Path(__file__).resolve().parents[3]


def tiny_olmoe(path: Path) -> Path:
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    config = OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, eos_token_id=None)
    OlmoeForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


@pytest.mark.slow
def test_fresh_venv_install_pulls_cupy_and_lists_cuda_by_the_drivers_reason(tmp_path):
    model = tiny_olmoe(tmp_path / "olmoe")
    venv = fresh_venv(REPO, tmp_path, "colibri-olmoe", paths=("backends/colibri-cuda",))
    assert venv.imports("cupy"), "pip install colibri-cuda brings CuPy"
    package_sources = venv.python.parent.parent / "lib"
    assert {p.name for p in package_sources.glob("python3*/site-packages/colibri_cuda/kernels/*.cu")} >= {
        "gemv.cu", "experts.cu", "attention.cu"}, "the kernels' sources come with the package"
    listed = venv.backends()
    assert listed["cuda"]["plugin"] == "colibri-cuda"
    assert listed["cpu"]["available"]

    doctor = venv.colibri("doctor", "--model", model, "--json")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    cuda = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}["CUDA"]
    # CuPy's CUDA 12 runtime and the NVRTC that compiles the kernels are there without a CUDA toolkit
    assert "CUDA runtime 12." in cuda["detail"] and "cupy-cuda12x" in cuda["detail"] and "NVRTC 12." in cuda["detail"], cuda

    def run(backend):
        return venv.colibri("run", "--model", model, "--token-ids", "1,2,3", "--max-tokens", "6", "--ignore-eos",
                            "--history", "off", "--backend", backend, "--json")

    if not listed["cuda"]["available"]:  # a machine without an NVIDIA driver or GPU, as CI's
        reason = listed["cuda"]["reason"]
        assert reason.startswith(("no CUDA driver", "no CUDA device", "the CUDA driver")), listed["cuda"]
        assert cuda["status"] == "warn"
        refused = run("cuda")
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and "backend 'cuda' is not available" in refused.stderr
        assert reason in refused.stderr
    on_cpu = run("cpu")
    assert on_cpu.returncode == 0 and len(json.loads(on_cpu.stdout)["token_ids"]) == 6

    venv.uninstall("colibri-cuda")
    assert "cuda" not in venv.backends()
    assert "colibri-cuda" not in venv.plugin_names()

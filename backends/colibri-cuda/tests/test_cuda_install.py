"""colibri-cuda as a user installs it, on a machine without CuPy (this one; the extras
cuda12 / cuda13 bring it): into a fresh venv beside colibri-core and a family, listed as
unavailable with the reason, ``--backend cuda`` refused in one line, everything else
unchanged; uninstalled, it is gone."""

import json
from pathlib import Path

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


def test_fresh_venv_without_cupy_lists_cuda_as_unavailable_and_runs_cpu(tmp_path):
    model = tiny_olmoe(tmp_path / "olmoe")
    venv = fresh_venv(REPO, tmp_path, "colibri-olmoe", paths=("backends/colibri-cuda",))
    assert not venv.imports("cupy")
    package_sources = venv.python.parent.parent / "lib"
    assert {p.name for p in package_sources.glob("python3*/site-packages/colibri_cuda/kernels/*.cu")} >= {
        "gemv.cu", "experts.cu", "attention.cu"}, "the kernels' sources come with the package"
    listed = venv.backends()
    assert listed["cuda"]["plugin"] == "colibri-cuda"
    assert not listed["cuda"]["available"] and listed["cuda"]["reason"].startswith("cupy is not installed"), listed["cuda"]
    assert listed["cpu"]["available"]

    def run(backend):
        return venv.colibri("run", "--model", model, "--token-ids", "1,2,3", "--max-tokens", "6", "--ignore-eos",
                            "--history", "off", "--backend", backend, "--json")

    refused = run("cuda")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "backend 'cuda' is not available" in refused.stderr
    assert "cupy is not installed" in refused.stderr
    on_cpu = run("cpu")
    assert on_cpu.returncode == 0 and len(json.loads(on_cpu.stdout)["token_ids"]) == 6

    venv.uninstall("colibri-cuda")
    assert "cuda" not in venv.backends()
    assert "colibri-cuda" not in venv.plugin_names()

"""colibri-mlx as a user installs it: into a fresh venv beside colibri-core and a family,
listed with its device; without mlx it is listed as unavailable and everything else
works; uninstalled, it is gone."""

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


@pytest.mark.slow  # a fresh venv: pip installs the distributions
def test_fresh_venv_lists_mlx_runs_it_and_survives_its_absence(tmp_path):
    model = tiny_olmoe(tmp_path / "olmoe")
    venv = fresh_venv(REPO, tmp_path, "colibri-olmoe", paths=("backends/colibri-mlx[cpu]",))
    listed = venv.backends()
    assert listed["mlx"]["available"] and listed["mlx"]["device"] in ("cpu", "gpu"), listed["mlx"]
    assert listed["mlx"]["plugin"] == "colibri-mlx"

    def run(backend):
        return venv.colibri("run", "--model", model, "--token-ids", "1,2,3", "--max-tokens", "6", "--ignore-eos",
                            "--history", "off", "--backend", backend, "--json")

    on_cpu, on_mlx = run("cpu"), run("mlx")
    assert on_cpu.returncode == 0 and on_mlx.returncode == 0, on_mlx.stderr[-2000:]
    assert json.loads(on_mlx.stdout)["token_ids"] == json.loads(on_cpu.stdout)["token_ids"]

    venv.uninstall("mlx-cpu")
    venv.uninstall("mlx")
    listed = venv.backends()
    assert not listed["mlx"]["available"] and "mlx is not installed" in listed["mlx"]["reason"]
    refused = run("mlx")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "backend 'mlx' is not available" in refused.stderr
    assert run("cpu").returncode == 0  # everything else works without mlx

    venv.uninstall("colibri-mlx")
    assert "mlx" not in venv.backends()
    assert "colibri-mlx" not in venv.plugin_names()

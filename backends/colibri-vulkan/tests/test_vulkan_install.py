"""colibri-vulkan as a user installs it: into a fresh venv beside colibri-core and a family,
listed with the physical device it found and run to the cpu backend's tokens through the
device tier; without a Vulkan driver, or without the binding, it is listed as unavailable
with the reason, ``--backend vulkan`` is a one-line error and cpu still runs; uninstalled,
it is gone."""

import json
from pathlib import Path

import pytest

from colibri_core.testing import venv as venv_module
from colibri_core.testing.venv import fresh_venv
from colibri_vulkan import probe

REPO = Path(__file__).resolve().parents[3]
REASON = probe.unavailable_reason()


def tiny_olmoe(path: Path) -> Path:
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    config = OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, eos_token_id=None)
    OlmoeForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


@pytest.mark.slow  # a fresh venv: pip installs the distributions
@pytest.mark.skipif(REASON is not None, reason=f"no Vulkan here: {REASON}")
def test_fresh_venv_lists_vulkan_runs_it_and_survives_its_absence(tmp_path, monkeypatch):
    model = tiny_olmoe(tmp_path / "olmoe")
    venv = fresh_venv(REPO, tmp_path, "colibri-olmoe", paths=("backends/colibri-vulkan",))
    listed = venv.backends()
    assert listed["vulkan"]["available"], listed["vulkan"]
    assert listed["vulkan"]["device"] == probe.chosen_device().describe()
    assert listed["vulkan"]["plugin"] == "colibri-vulkan"

    def run(backend, *extra):
        return venv.colibri("run", "--model", model, "--token-ids", "1,2,3", "--max-tokens", "6", "--ignore-eos",
                            "--history", "off", "--backend", backend, "--json", *extra)

    on_cpu = run("cpu")
    # a device tier holding a quarter of the experts: hits and misses both happen
    on_vulkan = run("vulkan", "--ram", "160K", "--vram", "26K")
    assert on_cpu.returncode == 0 and on_vulkan.returncode == 0, on_vulkan.stderr[-2000:]
    vulkan_out = json.loads(on_vulkan.stdout)
    assert vulkan_out["token_ids"] == json.loads(on_cpu.stdout)["token_ids"]
    assert vulkan_out["stats"]["hits_device"] > 0, vulkan_out["stats"]

    # no Vulkan driver: the loader finds none
    monkeypatch.setitem(venv_module.ENV, "VK_ICD_FILENAMES", str(tmp_path / "no-driver.json"))
    monkeypatch.setitem(venv_module.ENV, "VK_DRIVER_FILES", str(tmp_path / "no-driver.json"))
    listed = venv.backends()
    assert not listed["vulkan"]["available"] and "found no driver" in listed["vulkan"]["reason"]
    refused = run("vulkan")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "backend 'vulkan' is not available" in refused.stderr
    assert run("cpu").returncode == 0  # everything else works without Vulkan
    monkeypatch.delitem(venv_module.ENV, "VK_ICD_FILENAMES")
    monkeypatch.delitem(venv_module.ENV, "VK_DRIVER_FILES")

    venv.uninstall("vulkan")
    listed = venv.backends()
    assert not listed["vulkan"]["available"] and "vulkan Python binding is not installed" in listed["vulkan"]["reason"]
    assert run("cpu").returncode == 0

    venv.uninstall("colibri-vulkan")
    assert "vulkan" not in venv.backends()
    assert "colibri-vulkan" not in venv.plugin_names()

"""The committed SPIR-V is what its GLSL sources compile to: byte for byte with glslc, and
the manifest's source hashes match the sources even where glslc is absent."""

import json

import pytest

from colibri_vulkan.shaders import build

MANIFEST = json.loads((build.SPIRV / "manifest.json").read_text())


def test_manifest_lists_every_program_with_its_current_source():
    assert set(MANIFEST["programs"]) == set(build.PROGRAMS)
    for name, entry in MANIFEST["programs"].items():
        assert entry["source_sha256"] == build.source_hash(name), \
            f"{entry['source']} changed since spirv/{name}.spv was built: run python -m colibri_vulkan.shaders.build"
        assert (build.SPIRV / f"{name}.spv").exists()


@pytest.mark.skipif(build.glslc() is None, reason="glslc is not installed (Debian: apt-get install glslc)")
def test_recompiling_reproduces_every_binary_byte_for_byte():
    assert build.drift() == []


@pytest.mark.skipif(build.glslc() is None, reason="glslc is not installed (Debian: apt-get install glslc)")
def test_the_check_fails_on_a_stale_binary(tmp_path, monkeypatch):
    for name in build.PROGRAMS:
        (tmp_path / f"{name}.spv").write_bytes((build.SPIRV / f"{name}.spv").read_bytes())
    (tmp_path / "rows.spv").write_bytes((build.SPIRV / "rope.spv").read_bytes())
    monkeypatch.setattr(build, "SPIRV", tmp_path)
    assert build.drift() == ["rows"]

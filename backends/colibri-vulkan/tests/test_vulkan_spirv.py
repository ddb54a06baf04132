"""The committed SPIR-V is what its GLSL sources compile to: byte for byte with glslc, and
the manifest's source hashes match the sources even where glslc is absent."""

import json

import pytest

from colibri_vulkan.shaders import build

MANIFEST = json.loads((build.SPIRV / "manifest.json").read_text())


def test_manifest_lists_every_program_with_its_current_source():
    assert set(MANIFEST["programs"]) == set(build.PROGRAMS)
    for name, entry in MANIFEST["programs"].items():
        source, defines, target = build.PROGRAMS[name]
        assert (entry["source"], entry["defines"], entry["target"]) == (source, defines, target), name
        assert entry["source_sha256"] == build.source_hash(name), \
            f"{entry['source']} changed since spirv/{name}.spv was built: run python -m colibri_vulkan.shaders.build"
        assert (build.SPIRV / f"{name}.spv").exists()


@pytest.mark.skipif(build.glslc() is None, reason="glslc is not installed (Debian: apt-get install glslc)")
def test_recompiling_reproduces_every_binary_byte_for_byte():
    assert build.drift() == []


@pytest.mark.skipif(build.glslc() is None, reason="glslc is not installed (Debian: apt-get install glslc)")
def test_the_check_fails_on_a_stale_binary(tmp_path, monkeypatch):
    names = ["rope", "rows", "linear_q4", "linear_q4_subgroup", "linear_q4_subgroup_8bit"]
    for name in names:
        (tmp_path / f"{name}.spv").write_bytes((build.SPIRV / f"{name}.spv").read_bytes())
    (tmp_path / "rows.spv").write_bytes((build.SPIRV / "rope.spv").read_bytes())
    # a variant compiled without its define (the plain shader in its place)
    (tmp_path / "linear_q4_subgroup_8bit.spv").write_bytes((build.SPIRV / "linear_q4_subgroup.spv").read_bytes())
    monkeypatch.setattr(build, "SPIRV", tmp_path)
    assert build.drift(names) == ["rows", "linear_q4_subgroup_8bit"]


def test_variants_are_distinct_binaries_with_their_targets():
    """Each variant of linear.comp is its own SPIR-V (its defines took effect), and the
    subgroup variants target Vulkan 1.1 (SPIR-V 1.3), the plain ones Vulkan 1.0 (SPIR-V 1.0)."""
    linear = {n: (build.SPIRV / f"{n}.spv").read_bytes() for n in build.PROGRAMS if n.startswith("linear_")}
    assert len(set(linear.values())) == len(linear)
    for name, code in linear.items():
        version = int.from_bytes(code[4:8], "little")
        assert version == (0x10300 if "_subgroup" in name else 0x10000), (name, hex(version))

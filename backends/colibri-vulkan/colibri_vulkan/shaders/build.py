"""Compile the GLSL compute shaders to the SPIR-V committed beside them (``../spirv``).

    python -m colibri_vulkan.shaders.build           # rewrite spirv/*.spv and spirv/manifest.json
    python -m colibri_vulkan.shaders.build --check   # exit 1 if any committed .spv differs

The SPIR-V is committed so installing colibri-vulkan needs no shader compiler; the check
(run by tests/test_vulkan_spirv.py) recompiles every shader with glslc and compares byte
for byte, and the manifest records each source's SHA-256 so a stale binary is caught even
where glslc is absent. One source may give several binaries: ``linear.comp`` per weight kind
and per device-feature variant (plain, Vulkan 1.0 with no optional feature; ``_subgroup``,
Vulkan 1.1 subgroup operations; ``_subgroup_8bit`` / ``_subgroup_16bit``, reading the packed
bytes through 8-bit or 16-bit storage), each with its own target environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHADERS = Path(__file__).resolve().parent
SPIRV = SHADERS.parent / "spirv"
FLAGS = ("-O",)
VULKAN_1_0, VULKAN_1_1 = "vulkan1.0", "vulkan1.1"
LINEAR_KINDS = ("f32", "bf16", "q8", "q4", "mxfp4", "fp8")  # KIND 0..5 in linear.comp
# the narrow-storage variant each packed kind has (float32 weights have none)
NARROW = {"bf16": "16bit", "q8": "8bit", "q4": "8bit", "mxfp4": "8bit", "fp8": "8bit"}
# binary name -> (source, preprocessor definitions, target environment)
PROGRAMS = {
    "eltwise": ("eltwise.comp", {}, VULKAN_1_0),
    "rows": ("rows.comp", {}, VULKAN_1_0),
    "rope": ("rope.comp", {}, VULKAN_1_0),
    "attention": ("attention.comp", {}, VULKAN_1_0),
    "bmm": ("bmm.comp", {}, VULKAN_1_0),
    "gather": ("gather.comp", {}, VULKAN_1_0),
    "dsa": ("dsa.comp", {}, VULKAN_1_0),
    "delta": ("delta.comp", {}, VULKAN_1_0),
    **{f"linear_{kind}": ("linear.comp", {"KIND": str(i)}, VULKAN_1_0) for i, kind in enumerate(LINEAR_KINDS)},
    **{f"linear_{kind}_subgroup": ("linear.comp", {"KIND": str(i), "SUBGROUP": "1"}, VULKAN_1_1)
       for i, kind in enumerate(LINEAR_KINDS)},
    **{f"linear_{kind}_subgroup_{NARROW[kind]}": ("linear.comp", {"KIND": str(i), "SUBGROUP": "1", "NARROW": "1"},
                                                  VULKAN_1_1)
       for i, kind in enumerate(LINEAR_KINDS) if kind in NARROW},
}


def glslc() -> str | None:
    return shutil.which("glslc")


def compile_program(name: str, out: Path) -> None:
    source, defines, target = PROGRAMS[name]
    cmd = [glslc(), *FLAGS, f"--target-env={target}", *(f"-D{k}={v}" for k, v in defines.items()),
           str(SHADERS / source), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def source_hash(name: str) -> str:
    return hashlib.sha256((SHADERS / PROGRAMS[name][0]).read_bytes()).hexdigest()


def build() -> None:
    if glslc() is None:
        sys.exit("glslc is not installed (Debian: apt-get install glslc)")
    SPIRV.mkdir(exist_ok=True)
    manifest = {}
    for name in PROGRAMS:
        compile_program(name, SPIRV / f"{name}.spv")
        manifest[name] = {"source": PROGRAMS[name][0], "defines": PROGRAMS[name][1], "target": PROGRAMS[name][2],
                          "source_sha256": source_hash(name),
                          "spirv_sha256": hashlib.sha256((SPIRV / f"{name}.spv").read_bytes()).hexdigest()}
    version = subprocess.run([glslc(), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    (SPIRV / "manifest.json").write_text(json.dumps({"glslc": version, "flags": list(FLAGS), "programs": manifest},
                                                    indent=1, sort_keys=True) + "\n")


def drift(names=None) -> list[str]:
    """Binaries (of ``names``, default all) that do not match their sources: recompiled byte
    for byte (needs glslc), a few compilers at a time."""
    names = list(PROGRAMS if names is None else names)
    with tempfile.TemporaryDirectory() as tmp:
        def stale(name: str) -> bool:
            fresh = Path(tmp) / f"{name}.spv"
            compile_program(name, fresh)
            committed = SPIRV / f"{name}.spv"
            return not committed.exists() or committed.read_bytes() != fresh.read_bytes()

        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            return [name for name, wrong in zip(names, pool.map(stale, names)) if wrong]


if __name__ == "__main__":
    if "--check" in sys.argv:
        stale = drift()
        if stale:
            sys.exit(f"SPIR-V differs from its GLSL source: {', '.join(stale)} (run python -m colibri_vulkan.shaders.build)")
    else:
        build()

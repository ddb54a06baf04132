"""Compile the GLSL compute shaders to the SPIR-V committed beside them (``../spirv``).

    python -m colibri_vulkan.shaders.build           # rewrite spirv/*.spv and spirv/manifest.json
    python -m colibri_vulkan.shaders.build --check   # exit 1 if any committed .spv differs

The SPIR-V is committed so installing colibri-vulkan needs no shader compiler; the check
(run by tests/test_vulkan_spirv.py) recompiles every shader with glslc and compares byte
for byte, and the manifest records each source's SHA-256 so a stale binary is caught even
where glslc is absent. One source may give several binaries (``linear.comp`` per weight kind).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHADERS = Path(__file__).resolve().parent
SPIRV = SHADERS.parent / "spirv"
FLAGS = ("-O", "--target-env=vulkan1.0")
# binary name -> (source, preprocessor definitions)
PROGRAMS = {
    "eltwise": ("eltwise.comp", {}),
    "rows": ("rows.comp", {}),
    "rope": ("rope.comp", {}),
    "attention": ("attention.comp", {}),
    "bmm": ("bmm.comp", {}),
    "gather": ("gather.comp", {}),
    "dsa": ("dsa.comp", {}),
    "delta": ("delta.comp", {}),
    **{f"linear_{kind}": ("linear.comp", {"KIND": str(i)})
       for i, kind in enumerate(("f32", "bf16", "q8", "q4", "mxfp4", "fp8"))},
}


def glslc() -> str | None:
    return shutil.which("glslc")


def compile_program(name: str, out: Path) -> None:
    source, defines = PROGRAMS[name]
    cmd = [glslc(), *FLAGS, *(f"-D{k}={v}" for k, v in defines.items()), str(SHADERS / source), "-o", str(out)]
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
        manifest[name] = {"source": PROGRAMS[name][0], "defines": PROGRAMS[name][1], "source_sha256": source_hash(name),
                          "spirv_sha256": hashlib.sha256((SPIRV / f"{name}.spv").read_bytes()).hexdigest()}
    version = subprocess.run([glslc(), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    (SPIRV / "manifest.json").write_text(json.dumps({"glslc": version, "flags": list(FLAGS), "programs": manifest},
                                                    indent=1, sort_keys=True) + "\n")


def drift() -> list[str]:
    """Binaries that do not match their sources: recompiled byte for byte (needs glslc)."""
    wrong = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in PROGRAMS:
            fresh = Path(tmp) / f"{name}.spv"
            compile_program(name, fresh)
            committed = SPIRV / f"{name}.spv"
            if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
                wrong.append(name)
    return wrong


if __name__ == "__main__":
    if "--check" in sys.argv:
        stale = drift()
        if stale:
            sys.exit(f"SPIR-V differs from its GLSL source: {', '.join(stale)} (run python -m colibri_vulkan.shaders.build)")
    else:
        build()

"""Every CUDA C source compiles with nvcc for sm_80 (Ampere) and sm_90 (Hopper) with no
error and no warning (ptxas' included), as it is in the package and in the self-contained
form NVRTC receives; the sources include no system header (NVRTC has none); the limits
colibri_cuda.geometry assumes are the sources' own. Runs in CI; skipped only where nvcc
is absent."""

import re
import shutil
import subprocess

import pytest

from colibri_cuda import geometry
from colibri_cuda.sources import KERNEL_DIR, kernel_files, source

ARCHES = ("sm_80", "sm_90")
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here (CUDA toolkit)")
# every diagnostic an error: the front end's warnings, and ptxas' (spills are reported, not warned)
STRICT = ["-Werror", "all-warnings", "-Xptxas", "-Werror", "--std=c++17"]


def test_there_are_sources():
    names = {p.name for p in kernel_files()}
    assert {"gemv.cu", "experts.cu", "attention.cu", "rope.cu", "norms.cu", "router.cu", "delta.cu"} <= names


def compile_cubin(path, arch, tmp_path, include=True):
    out = tmp_path / f"{path.stem}-{arch}.cubin"
    command = [NVCC, f"-arch={arch}", "-cubin", *STRICT, "-o", str(out), str(path)]
    if include:
        command[1:1] = ["-I", str(KERNEL_DIR)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return run, out


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", [p.name for p in kernel_files()])
def test_compiles_without_warnings(tmp_path, name, arch):
    run, out = compile_cubin(KERNEL_DIR / name, arch, tmp_path)
    assert run.returncode == 0 and out.stat().st_size > 0, f"nvcc {arch} {name}:\n{run.stderr}"
    assert "warning" not in run.stderr.lower(), run.stderr


@needs_nvcc
@pytest.mark.parametrize("name", [p.name for p in kernel_files()])
def test_the_text_nvrtc_receives_compiles_alone(tmp_path, name):
    """What RawModule gets (headers expanded) compiles with no include path."""
    expanded = tmp_path / name
    expanded.write_text(source(name))
    run, out = compile_cubin(expanded, "sm_90", tmp_path, include=False)
    assert run.returncode == 0 and out.stat().st_size > 0, f"nvcc {name} expanded:\n{run.stderr}"


def test_a_broken_kernel_fails_the_check(tmp_path):
    """The check can fail: an unused variable is a warning, hence an error."""
    if NVCC is None:
        pytest.skip("nvcc is not installed here (CUDA toolkit)")
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "common.cuh"\nextern "C" __global__ void f(float* y) { int unused = 3; y[0] = 1.0f; }\n')
    run, _ = compile_cubin(bad, "sm_80", tmp_path)
    assert run.returncode != 0


@pytest.mark.parametrize("name", [p.name for p in kernel_files()])
def test_sources_are_self_contained(name):
    text = source(name)
    assert "#include" not in text, "NVRTC gets the headers expanded"
    assert "pragma once" not in text
    assert text.count("__device__ __forceinline__ float warp_sum") == 1, "each header once"


def test_no_system_headers():
    for path in sorted(KERNEL_DIR.iterdir()):
        if path.suffix in (".cu", ".cuh"):
            assert not re.search(r"#\s*include\s*<", path.read_text()), f"{path.name} includes a system header"


def defines() -> dict[str, int]:
    found = {}
    for path in KERNEL_DIR.iterdir():
        for name, value in re.findall(r"^#define (\w+) (\d+)\s*$", path.read_text(), re.M):
            found[name] = int(value)
    return found


def test_geometry_matches_the_sources():
    d = defines()
    for name in ("WARP", "GEMV_MAX_TOKENS", "ROWS_PER_BLOCK", "ATTENTION_THREADS", "ATTENTION_MAX_CHUNK",
                 "ATTENTION_MAX_DIM", "NORM_THREADS", "ROUTER_THREADS", "ROUTER_MAX_EXPERTS", "DELTA_THREADS"):
        assert d[name] == getattr(geometry, name), name


def test_every_kernel_the_host_launches_exists():
    """Each name colibri_cuda.kernels launches is an extern "C" kernel of its file."""
    launched = {("gemv.cu", f"gemv_{k}") for k in ("f32", "bf16", "q8", "q4", "mxfp4", "fp8")}
    launched |= {("gemv.cu", f"dequantize_{k}") for k in ("bf16", "q8", "q4", "mxfp4", "fp8")}
    launched |= {("experts.cu", f"experts_{part}_{k}") for part in ("gate_up", "down")
                 for k in ("f32", "bf16", "q8", "q4", "mxfp4", "fp8")}
    launched |= {("attention.cu", "attention_split"), ("attention.cu", "attention_combine"),
                 ("rope.cu", "rope_half"), ("rope.cu", "rope_interleaved"), ("norms.cu", "rms_norm"),
                 ("norms.cu", "layer_norm"), ("router.cu", "softmax_top_k"), ("delta.cu", "gated_delta_step")}
    for file, name in launched:
        text = source(file)
        macro_made = re.search(r"(\w+)##name", text) and any(
            name == f"{prefix}{suffix}" for prefix in re.findall(r"(\w+_)##name", text)
            for suffix in re.findall(r"^\w+_KERNELS?\((\w+),", text, re.M))
        plain = re.search(rf'extern "C" __global__ void (__launch_bounds__\(\w+\)\s*)?{name}\(', text)
        assert macro_made or plain, f"{file} has no kernel {name}"

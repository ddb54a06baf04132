"""Whole models through the CUDA backend's Python code (on numpy, with mirrors of its
kernels, registered as "cuda-mirror"): OLMoE (attention, softmax router, fused one-token
experts), a Qwen3-Next hybrid (gated delta step, shared experts) and DeepSeek-V3.2 (MLA,
DSA, the grouped sigmoid router) and DeepSeek-V4 (sliding window with sinks, compressed
entries, the grouped output projection, hash routing) give transformers' tokens through their family's oracle
suite, every placement included. The backend reports device memory, so the placements
put experts in colibri-cuda's own device tier: uploads through the stand-in's
asynchronous path, waited for before use. Each suite is its family's own, restricted to
one case and to this backend."""

import sys
from pathlib import Path

import pytest

from colibri_core.plugins.discovery import reset_manager
from colibri_core.testing import registered_plugin
from colibri_core.testing.packed_models import packed_and_decoded, packed_olmoe_oracle
from cuda_stand_ins import MirrorPlugin

FAMILIES = Path(__file__).resolve().parents[3] / "families"
for family in ("colibri-olmoe", "colibri-qwen", "colibri-deepseek"):
    if str(FAMILIES / family / "tests") not in sys.path:  # their test modules import helpers by name
        sys.path.append(str(FAMILIES / family / "tests"))

pytest.importorskip("transformers")
pytest.importorskip("colibri_olmoe")
import test_deepseek_v32_oracle as deepseek  # noqa: E402
import test_deepseek_v4_oracle as deepseek_v4  # noqa: E402
import test_olmoe_oracle as olmoe  # noqa: E402
import test_qwen_oracle as qwen  # noqa: E402


@pytest.fixture(autouse=True)
def mirror_registered():
    reset_manager()
    with registered_plugin(MirrorPlugin(), "colibri-cuda-mirror"):
        yield
    reset_manager()


def on_mirror(suite, case: str):
    return type(f"{suite.__name__}OnCudaMirror", (suite,), {"cases": {case: suite.cases[case]},
                                                             "backends": ("cuda-mirror",), "__module__": __name__})


TestOlmoeOnCudaMirror = on_mirror(olmoe.TestOlmoeOracle, "sharded_gqa_norm_topk")
TestQwen3NextOnCudaMirror = on_mirror(qwen.TestQwen3NextOracle, "hybrid_dense_layer")
TestDeepseekV32OnCudaMirror = on_mirror(deepseek.TestDeepseekV32Oracle, "sparse_top4")
TestDeepseekV4OnCudaMirror = on_mirror(deepseek_v4.TestDeepseekV4Oracle, "mixed")


@pytest.fixture(scope="module")
def olmoe_model(tmp_path_factory):
    return packed_olmoe_oracle(tmp_path_factory.mktemp("olmoe") / "f32", new_tokens=12)


def test_experts_live_in_the_cuda_device_tier_and_run_fused(olmoe_model):
    import colibri_core
    from colibri_cuda.tier import CudaDeviceTier

    with colibri_core.load(olmoe_model.path, backend="cuda-mirror", history=False, vram=2 * 3 * 64 * 128 * 4 * 3) as model:
        assert isinstance(model.store.device, CudaDeviceTier) and model.store.device.slots == 3
        result = model.generate(token_ids=olmoe_model.prompt, max_tokens=len(olmoe_model.tokens), ignore_eos=True)
        backend = model.backend
    assert result.token_ids == olmoe_model.tokens
    assert backend.device.uploads > 0 and len(backend.device.waited) >= 3 * backend.device.uploads
    assert backend.kernels.calls["experts_token"] > 0 and backend.kernels.calls["attention"] > 0
    assert backend.kernels.calls["softmax_top_k"] > 0 and backend.kernels.calls["rms_norm"] > 0


@pytest.mark.parametrize("target", ["int4", "mxfp4", "int8", "bf16"])
def test_packed_containers_compute_their_decoded_numbers(olmoe_model, tmp_path, target):
    """Packed products through the matrix-vector and decode paths give the tokens, and
    the logits within float32 rounding, of float32 products with the container's decoded
    weights (the same container converted to f32, on the CPU backend's BLAS)."""
    import numpy as np

    import colibri_core
    from colibri_cuda.layouts import PackedWeight

    container, decoded = packed_and_decoded(olmoe_model, tmp_path, target)
    runs = {}
    for name, path, backend in (("packed", container, "cuda-mirror"), ("decoded", decoded, "cpu")):
        with colibri_core.load(path, backend=backend, cap=2, history=False) as model:
            if name == "packed":
                assert isinstance(model.lm.layers[0].attn.q.weight.value, PackedWeight)
            result = model.generate(token_ids=olmoe_model.prompt, max_tokens=len(olmoe_model.tokens), ignore_eos=True,
                                    return_logits=True)
            long = model.logits(list(range(1, 41)))  # 40 tokens at once: the decode-then-cuBLAS path
            runs[name] = (result.token_ids, np.stack(result.logits), long, model.backend)
    assert runs["packed"][0] == runs["decoded"][0]
    assert np.abs(runs["packed"][1] - runs["decoded"][1]).max() <= 1e-4
    assert np.abs(runs["packed"][2] - runs["decoded"][2]).max() <= 1e-4
    calls = runs["packed"][3].kernels.calls
    assert calls["gemv"] > 0 and calls["dequantize"] > 0

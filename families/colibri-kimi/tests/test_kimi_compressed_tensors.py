"""Kimi K2.5 with its routed experts in compressed-tensors ``pack-quantized`` int4 (as
the published K2.5 / K2-Thinking checkpoints ship them), read natively: greedy tokens
identical to transformers running the same model dequantised, and ``colibri convert``
of it."""

import json

import numpy as np
import pytest

import colibri_core
from colibri_core.model.blueprint import inspect_model
from colibri_core.testing.backends import backend_params
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.compressed_tensors import ct_int4_rewrite
from colibri_core.testing.oracle import OracleCase, oracle_fixture, random_correction_bias

from kimi_configs import k25

def expert_formats(path) -> set[str]:
    bp = inspect_model(path)
    try:
        return {bp.resolver.format_for(i).name for d in bp.moe for i in d.matrices[0].values()}
    finally:
        bp.close()


MODEL_CLASS = "Kimi_K25ForConditionalGeneration"
# moe_intermediate_size 16: down_proj rows of 16 inputs, half a scale group (the packed
# rows are padded to whole groups for the kernel)
CASE = OracleCase(k25(tie_word_embeddings=False), seed=4, prepare=random_correction_bias(),
                  rewrite=ct_int4_rewrite(config_key="text_config"))
# the CPU kernels quantise activations to int8 per 64 inputs for 4-bit weights
# (docs/formats.md): logits then differ from float32 by up to this share of their
# magnitude, tokens not at all
PACKED_LOGITS = 2e-2


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "oracles"
    root.mkdir(exist_ok=True)
    return oracle_fixture("kimi-k25-ct-int4", "experts", CASE, MODEL_CLASS, root)


def test_the_checkpoint_is_in_the_published_layout(oracle):
    index = json.loads((oracle.path / "model.safetensors.index.json").read_text())["weight_map"] \
        if (oracle.path / "model.safetensors.index.json").exists() else None
    from colibri_core.io.checkpoint import Checkpoint

    with Checkpoint(oracle.path) as ck:
        names = set(ck.tensors)
    expert = "language_model.model.blocks.1.mlp.experts.3.down_proj"
    assert {expert + s for s in (".weight_packed", ".weight_scale", ".weight_shape")} <= names
    assert expert + ".weight" not in names and index is None
    qc = json.loads((oracle.path / "config.json").read_text())["text_config"]["quantization_config"]
    assert qc["format"] == "pack-quantized" and "language_model.lm_head" in qc["ignore"]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("options", [{"history": False}, {"cap": 1, "history": False}], ids=["resident", "cap1"])
def test_greedy_tokens_match_transformers_on_the_dequantised_model(oracle, backend, options):
    with colibri_core.load(oracle.path, backend=backend, **options) as model:
        result = model.generate(token_ids=oracle.prompt, max_tokens=len(oracle.tokens), ignore_eos=True,
                                return_logits=True)
        # the CPU kernels' integer path (AVX2); their float path stays within 1e-4
        rounded = model.backend.has_kernel("q4g32") and getattr(getattr(model.backend, "kernels", None),
                                                                "INT4_INTEGER_PATH", 0)
        bound = max(model.backend.logits_tolerance, 1e-4)
    if rounded:
        bound = max(bound, PACKED_LOGITS * float(np.abs(oracle.step_logits).max()))
    assert expert_formats(oracle.path) == {"ct-int4-g32"}
    assert len(oracle.tokens) >= 32 and result.token_ids == oracle.tokens
    worst = float(np.abs(np.stack(result.logits) - oracle.step_logits).max())
    assert worst < bound, f"logits differ by {worst:.2e}"


def test_convert_reads_the_layout(oracle, tmp_path):
    keep = tmp_path / "keep"
    done = run_colibri("convert", "--model", oracle.path, "--out", keep, "--experts", "keep", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "quantization_config" in json.loads((keep / "config.json").read_text())["text_config"]
    int4 = tmp_path / "int4"
    done = run_colibri("convert", "--model", oracle.path, "--out", int4, "--experts", "int4", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "quantization_config" not in json.loads((int4 / "config.json").read_text())["text_config"]
    with colibri_core.load(keep, history=False) as a, colibri_core.load(int4, history=False) as b:
        assert a.generate(token_ids=oracle.prompt, max_tokens=len(oracle.tokens), ignore_eos=True).token_ids == oracle.tokens
        x = a.logits(oracle.prompt + oracle.tokens[:-1])
        y = b.logits(oracle.prompt + oracle.tokens[:-1])
    assert expert_formats(int4) == {"int4-gs64"}
    names = json.loads((int4 / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.blocks.1.mlp.experts.3.down_proj.weight" in names  # written under the unpacked names
    assert not [n for n in names if "weight_packed" in n or "weight_shape" in n or "weight_scale" in n]
    cosine = np.sum(x * y, axis=1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    assert cosine.min() > 0.99  # int4 again, from int4 values: close, not exact

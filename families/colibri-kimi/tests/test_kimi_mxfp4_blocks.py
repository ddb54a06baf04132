"""Kimi K2.5 with its routed experts stored as gpt-oss ships MXFP4, fused
``experts.gate_up_proj_blocks`` / ``_scales`` and ``experts.down_proj_blocks`` /
``_scales``, read natively one expert's slice at a time: greedy tokens identical to
transformers running the same model dequantised, and ``colibri convert --experts keep``."""

import json

import numpy as np
import pytest

import colibri_core
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.mxfp4 import mxfp4_rewrite
from colibri_core.testing.oracle import OracleCase, random_correction_bias

from kimi_configs import k25
from kimi_packed import check_greedy_tokens, expert_slices, on_every_backend, packed_oracle, resident_or_cap1

# every expert matrix's inputs a multiple of 32 (MXFP4 blocks hold whole groups)
CASE = OracleCase(k25(tie_word_embeddings=False, moe_intermediate_size=32), seed=5, prepare=random_correction_bias(),
                  rewrite=mxfp4_rewrite(config_key="text_config"))


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return packed_oracle("kimi-k25-mxfp4", CASE, tmp_path_factory)


@on_every_backend
@resident_or_cap1
def test_greedy_tokens_match_transformers_on_the_dequantised_model(oracle, backend, options):
    slices = expert_slices(oracle.path)
    assert {f for f, _ in slices} == {"mxfp4-hub"}
    assert "language_model.model.blocks.1.mlp.experts.gate_up_proj_blocks[7][1/2]" in {n for _, n in slices}
    check_greedy_tokens(oracle, backend, options, "mxfp4pair")


def test_convert_keeps_the_layout_or_converts_the_fused_experts(oracle, tmp_path):
    keep = tmp_path / "keep"
    done = run_colibri("convert", "--model", oracle.path, "--out", keep, "--experts", "keep", timeout=300)
    assert done.returncode == 0, done.stderr
    qc = json.loads((keep / "config.json").read_text())["text_config"]["quantization_config"]
    assert qc["quant_method"] == "mxfp4"
    with colibri_core.load(keep, history=False) as model:
        assert model.generate(token_ids=oracle.prompt, max_tokens=len(oracle.tokens), ignore_eos=True).token_ids \
            == oracle.tokens
    # to float32, one expert's blocks at a time (MXFP4 values are exact in float32): the same model
    exact = tmp_path / "f32"
    done = run_colibri("convert", "--model", oracle.path, "--out", exact, "--experts", "f32", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "quantization_config" not in json.loads((exact / "config.json").read_text())["text_config"]
    with colibri_core.load(exact, cap=1, history=False) as model:
        result = model.generate(token_ids=oracle.prompt, max_tokens=len(oracle.tokens), ignore_eos=True, return_logits=True)
    assert result.token_ids == oracle.tokens
    assert float(np.abs(np.stack(result.logits) - oracle.step_logits).max()) < 1e-4
    # requantised to int4 (fused int4-gs64 tensors): it loads and runs
    done = run_colibri("convert", "--model", oracle.path, "--out", tmp_path / "int4", "--experts", "int4", timeout=300)
    assert done.returncode == 0 and "requantised" in done.stderr, done.stderr
    assert {f for f, _ in expert_slices(tmp_path / "int4")} == {"int4-gs64"}
    with colibri_core.load(tmp_path / "int4", cap=1, history=False) as model:
        assert len(model.generate(token_ids=oracle.prompt, max_tokens=8, ignore_eos=True).token_ids) == 8

"""Kimi K2.5 with its routed experts in compressed-tensors ``pack-quantized`` int4 (as
the published K2.5 / K2-Thinking checkpoints ship them), read natively: greedy tokens
identical to transformers running the same model dequantised, and ``colibri convert``
of it."""

import json

import numpy as np
import pytest

import colibri_core
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.compressed_tensors import ct_int4_rewrite
from colibri_core.testing.oracle import OracleCase, random_correction_bias

from kimi_configs import k25
from kimi_packed import check_greedy_tokens, expert_slices, on_every_backend, packed_oracle, resident_or_cap1

# moe_intermediate_size 16: down_proj rows of 16 inputs, half a scale group (the packed
# rows are padded to whole groups for the kernel)
CASE = OracleCase(k25(tie_word_embeddings=False), seed=4, prepare=random_correction_bias(),
                  rewrite=ct_int4_rewrite(config_key="text_config"))


def expert_formats(path) -> set[str]:
    return {f for f, _ in expert_slices(path)}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return packed_oracle("kimi-k25-ct-int4", CASE, tmp_path_factory)


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


@on_every_backend
@resident_or_cap1
def test_greedy_tokens_match_transformers_on_the_dequantised_model(oracle, backend, options):
    assert expert_formats(oracle.path) == {"ct-int4-g32"}
    check_greedy_tokens(oracle, backend, options, "q4g32")


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

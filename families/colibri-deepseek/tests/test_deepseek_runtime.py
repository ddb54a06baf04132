"""DeepSeek beyond token agreement: the KV cache holds the latent, decode is absorbed,
DSA with index_topk covering the sequence is dense attention, MTP layers are ignored,
and bad configs are refused naming the field."""

import json

import numpy as np
import pytest

import colibri_core
from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.testing import DELETE, copy_model
from colibri_core.testing.backends import backend_params, matrix_beyond_cpu
from colibri_core.testing.mtp import check_mtp_layer_is_ignored, check_mtp_layer_matches_reference

import test_deepseek_v32_oracle as v32_suite
import test_deepseek_v3_oracle as v3_suite


def fixture(tmp_path_factory, suite, name):
    return suite.oracle(name, tmp_path_factory)


def test_kv_cache_bytes_per_token_are_the_latent_size(tmp_path_factory):
    fx = fixture(tmp_path_factory, v3_suite.TestDeepseekV3Oracle, "base")
    with colibri_core.load(fx.path) as model:
        stats = model.generate(token_ids=fx.prompt, max_tokens=4, ignore_eos=True).stats
        c = model.config
    latent = c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4
    expanded = c["num_hidden_layers"] * c["num_attention_heads"] * (
        c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * 4
    assert stats.kv_bytes_per_token == latent < expanded
    assert stats.kv_bytes == 64 * latent  # the first growth of each layer's cache: 64 positions

    fx = fixture(tmp_path_factory, v32_suite.TestDeepseekV32Oracle, "sparse_top4")
    with colibri_core.load(fx.path) as model:
        stats = model.generate(token_ids=fx.prompt, max_tokens=2, ignore_eos=True).stats
        c = model.config
    # DSA also caches one indexer key per token and layer
    assert stats.kv_bytes_per_token == c["num_hidden_layers"] * (
        c["kv_lora_rank"] + c["qk_rope_head_dim"] + c["index_head_dim"]) * 4


def test_decode_uses_the_absorbed_form(tmp_path_factory, monkeypatch):
    fx = fixture(tmp_path_factory, v3_suite.TestDeepseekV3Oracle, "base")
    calls = {"mla_expand": [], "mla_attention_kv": []}
    for name in calls:
        original = getattr(CpuBackend, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls[_name].append(args[0].shape[0])  # new tokens of the step
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(CpuBackend, name, spy)
    with colibri_core.load(fx.path) as model:
        layers = model.config["num_hidden_layers"]
        model.generate(token_ids=fx.prompt, max_tokens=6, ignore_eos=True)
    # the prompt is expanded once per layer; each of the 5 decode steps attends to the
    # cached latents without expanding them
    assert calls["mla_expand"] == [len(fx.prompt)] * layers
    assert calls["mla_attention_kv"] == [1] * (5 * layers)


def test_index_topk_covering_the_sequence_is_dense_attention(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, v32_suite.TestDeepseekV32Oracle, "topk_covers_sequence")
    ids = fx.prompt + fx.tokens[:-1]
    assert json.loads((fx.path / "config.json").read_text())["index_topk"] >= len(ids)
    # the same weights as DeepSeek-V3 (MLA without the indexer): bit-identical logits
    v3_dir = copy_model(fx.path, tmp_path / "as-v3", model_type="deepseek_v3", architectures=DELETE,
                              rope_interleave=True)
    with colibri_core.load(fx.path) as v32, colibri_core.load(v3_dir) as v3:
        assert v32.family.spec.name == "deepseek-v32" and v3.family.spec.name == "deepseek-v3"
        np.testing.assert_array_equal(v32.logits(ids), v3.logits(ids))
        a = v32.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True, return_logits=True)
        b = v3.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True, return_logits=True)
    assert a.token_ids == b.token_ids == fx.tokens
    for x, y in zip(a.logits, b.logits):
        np.testing.assert_array_equal(x, y)


def test_a_small_index_topk_really_restricts_attention(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, v32_suite.TestDeepseekV32Oracle, "sparse_top4")
    dense_dir = copy_model(fx.path, tmp_path / "dense", index_topk=4096)
    ids = fx.prompt + fx.tokens[:-1]
    with colibri_core.load(fx.path) as sparse, colibri_core.load(dense_dir) as dense:
        a, b = sparse.logits(ids), dense.logits(ids)
    np.testing.assert_array_equal(a[:4], b[:4])  # the first 4 positions see at most 4 keys
    assert np.abs(a[4:] - b[4:]).max() > 1e-3


def test_mtp_layers_are_ignored(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, v3_suite.TestDeepseekV3Oracle, "base")
    # DeepSeek-V3's MTP layer has an MLA attention of its own
    check_mtp_layer_is_ignored(fx.path, tmp_path, fx.prompt, {"self_attn.kv_b_proj.weight": (80, 16)})


@pytest.mark.parametrize("changes,error,match", [
    ({"num_key_value_heads": 2}, ModelFormatError, "num_key_value_heads 2 must equal num_attention_heads"),
    ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func 'softmax'"),
    ({"topk_method": "group_limited_greedy"}, UnsupportedModelError, "group_limited_greedy"),
    ({"n_group": 3}, ModelFormatError, "n_routed_experts 8 is not divisible by n_group 3"),
    ({"topk_group": 3}, ModelFormatError, "topk_group 3 exceeds n_group 2"),
    ({"num_experts_per_tok": 5}, ModelFormatError, "num_experts_per_tok 5 must be within 1..4"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"kv_lora_rank": 0}, ModelFormatError, "'kv_lora_rank' = 0 is outside"),
    ({"kv_lora_rank": 24}, ModelFormatError, "kv_a_proj_with_mqa.weight' has shape"),
    ({"moe_layer_freq": 2}, UnsupportedModelError, "moe_layer_freq 2"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path_factory, tmp_path, changes, error, match):
    fx = fixture(tmp_path_factory, v3_suite.TestDeepseekV3Oracle, "base")
    bad = copy_model(fx.path, tmp_path / "bad", **changes)
    with pytest.raises(error, match=match) as err:
        colibri_core.load(bad)
    assert "config.json" in str(err.value) or "safetensors" in str(err.value)


def test_v32_mlp_layer_types_must_cover_every_layer(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, v32_suite.TestDeepseekV32Oracle, "sparse_top4")
    bad = copy_model(fx.path, tmp_path / "bad", mlp_layer_types=["dense", "sparse"])
    with pytest.raises(ModelFormatError, match="mlp_layer_types must list"):
        colibri_core.load(bad)


def test_list_families_shows_the_deepseek_model_types():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "colibri_core", "list-families", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    families = {f["family"]: f for f in json.loads(out)}
    assert families["deepseek-v3"]["model_types"] == ["deepseek_v3"]
    assert families["deepseek-v32"]["model_types"] == ["deepseek_v32"]


@pytest.mark.parametrize("backend", matrix_beyond_cpu(backend_params()))
def test_mtp_layer_matches_the_torch_reference(backend, tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, v3_suite.TestDeepseekV3Oracle, "base")
    check_mtp_layer_matches_reference(fx.path, tmp_path, fx.prompt, backend)

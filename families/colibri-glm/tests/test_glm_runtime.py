"""GLM beyond token agreement: the config spellings real checkpoints use (top-level
partial_rotary_factor, GLM-5's index_topk_pattern / index_topk_freq schedules), MTP
layers ignored, shared indexer layers caching nothing, config errors naming the field,
and the family listed and running without colibri-deepseek."""

import ast
import json
import subprocess
import sys

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.testing import DELETE, copy_model
from colibri_core.testing.backends import backend_params, matrix_beyond_cpu
from colibri_core.testing.mtp import check_mtp_layer_is_ignored, check_mtp_layer_matches_reference

import test_glm4_moe_lite_oracle as lite_suite
import test_glm4_moe_oracle as moe_suite
import test_glm_moe_dsa_oracle as dsa_suite

MOE = (moe_suite.TestGlm4MoeOracle, "qk_norm_bias_gqa")
LITE = (lite_suite.TestGlm4MoeLiteOracle, "q_lora_interleaved")
SHARED = (dsa_suite.TestGlmMoeDsaOracle, "shared_top4")


def fixture(tmp_path_factory, which):
    suite, name = which
    return suite.oracle(name, tmp_path_factory)


def logits(path, ids):
    with colibri_core.load(path, history=False) as model:
        return model.logits(ids)


def test_glm4_moe_partial_rotary_spellings(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, MOE)
    ids = fx.prompt + fx.tokens[:-1]
    assert json.loads((fx.path / "config.json").read_text())["rope_parameters"]["partial_rotary_factor"] == 0.5
    reference = logits(fx.path, ids)
    same = {
        # GLM-4.5's own config.json: rope_theta and partial_rotary_factor at the top
        "top_level": dict(rope_parameters=DELETE, rope_theta=10000.0, partial_rotary_factor=0.5),
        # absent everywhere: GLM's default 0.5
        "absent": dict(rope_parameters=DELETE, rope_theta=10000.0),
        # rope_parameters wins over the top-level field, as in transformers
        "both": dict(partial_rotary_factor=1.0),
    }
    for name, changes in same.items():
        np.testing.assert_array_equal(logits(copy_model(fx.path, tmp_path / name, **changes), ids), reference, name)
    full = logits(copy_model(fx.path, tmp_path / "full", rope_parameters=DELETE, rope_theta=10000.0,
                                   partial_rotary_factor=1.0), ids)
    assert np.abs(full - reference).max() > 1e-3
    # an explicit null top-level factor is full rotary in transformers (the 0.5 default is a setdefault)
    null = copy_model(fx.path, tmp_path / "null", rope_parameters=DELETE, rope_theta=10000.0)
    config = json.loads((null / "config.json").read_text())
    (null / "config.json").write_text(json.dumps(dict(config, partial_rotary_factor=None)))
    np.testing.assert_array_equal(logits(null, ids), full)


def test_glm4_moe_lite_defaults_to_one_dense_layer(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, LITE)
    assert json.loads((fx.path / "config.json").read_text())["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    # without mlp_layer_types, transformers makes layer 0 dense and the rest MoE (first_k_dense_replace is not read)
    bare = copy_model(fx.path, tmp_path / "bare", mlp_layer_types=DELETE, first_k_dense_replace=2)
    np.testing.assert_array_equal(logits(bare, fx.prompt), logits(fx.path, fx.prompt))


def test_mtp_layers_are_ignored(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, MOE)
    # GLM-4.5's MTP layer has a GQA attention of its own
    check_mtp_layer_is_ignored(fx.path, tmp_path, fx.prompt, {"self_attn.q_proj.weight": (64, 32)})


@pytest.mark.parametrize("backend", matrix_beyond_cpu(backend_params()))
def test_mtp_layer_matches_the_torch_reference(backend, tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, MOE)  # GLM-4.5's MTP layers have DeepSeek-V3's layout
    check_mtp_layer_matches_reference(fx.path, tmp_path, fx.prompt, backend)


def test_glm5_indexer_schedule_spellings(tmp_path_factory, tmp_path):
    """indexer_types, else index_topk_pattern, else index_topk_freq / index_skip_topk_offset
    (transformers' GlmMoeDsaConfig derivation)."""
    fx = fixture(tmp_path_factory, SHARED)
    assert json.loads((fx.path / "config.json").read_text())["indexer_types"] == ["full", "shared", "full", "shared"]
    ids = fx.prompt + fx.tokens[:-1]
    reference = logits(fx.path, ids)
    same = {
        "pattern_string": dict(indexer_types=DELETE, index_topk_pattern="FSFS"),
        "pattern_list": dict(indexer_types=DELETE, index_topk_pattern=["full", "shared", "full", "shared"]),
        "freq_offset": dict(indexer_types=DELETE, index_topk_freq=2, index_skip_topk_offset=1),
    }
    for name, changes in same.items():
        np.testing.assert_array_equal(logits(copy_model(fx.path, tmp_path / name, **changes), ids), reference, name)
    # no schedule at all: every layer runs its own indexer, whose weights this checkpoint lacks
    with pytest.raises(ModelFormatError, match=r"missing tensor 'model\.layers\.1\.self_attn\.indexer"):
        colibri_core.load(copy_model(fx.path, tmp_path / "none", indexer_types=DELETE))


def test_shared_indexer_layers_cache_no_index_keys(tmp_path_factory):
    fx = fixture(tmp_path_factory, SHARED)
    with colibri_core.load(fx.path) as model:
        stats = model.generate(token_ids=fx.prompt, max_tokens=2, ignore_eos=True).stats
        c = model.config
    full = c["indexer_types"].count("full")
    assert full == 2
    assert stats.kv_bytes_per_token == 4 * (c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
                                            + full * c["index_head_dim"])


@pytest.mark.parametrize("which,changes,error,match", [
    (SHARED, {"indexer_types": ["shared", "full", "full", "shared"]}, ModelFormatError, "layer 0 cannot be 'shared'"),
    (SHARED, {"indexer_types": ["full", "shared"]}, ModelFormatError, "indexer_types must give 'full' or 'shared'"),
    (SHARED, {"indexer_types": DELETE, "index_topk_pattern": "FSXS"}, ModelFormatError, "index_topk_pattern must give"),
    (SHARED, {"q_lora_rank": DELETE}, ModelFormatError, "DSA needs q_lora_rank"),
    (MOE, {"num_key_value_heads": 3}, ModelFormatError, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (MOE, {"n_group": 3}, ModelFormatError, "n_routed_experts 8 is not divisible by n_group 3"),
    (MOE, {"num_experts_per_tok": 5}, ModelFormatError, "num_experts_per_tok 5 must be within 1..4"),
    (MOE, {"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    (MOE, {"head_dim": 8}, ModelFormatError, r"q_proj\.bias. has shape \[64\], but config.json implies \[32\]"),
    (MOE, {"partial_rotary_factor": 2.0, "rope_parameters": DELETE, "rope_theta": 10000.0}, ModelFormatError,
     "'partial_rotary_factor' = 2.0 is outside"),
    (LITE, {"num_key_value_heads": 2}, ModelFormatError, "num_key_value_heads 2 must equal num_attention_heads"),
    (LITE, {"mlp_layer_types": ["dense", "moe", "sparse"]}, ModelFormatError, "mlp_layer_types must list"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path_factory, tmp_path, which, changes, error, match):
    fx = fixture(tmp_path_factory, which)
    bad = copy_model(fx.path, tmp_path / "bad", **changes)
    with pytest.raises(error, match=match) as err:
        colibri_core.load(bad)
    assert "config.json" in str(err.value) or "safetensors" in str(err.value)


def test_list_families_shows_the_glm_model_types():
    out = subprocess.run([sys.executable, "-m", "colibri_core", "list-families", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    families = {f["family"]: f for f in json.loads(out)}
    expected = {"glm4-moe": "glm4_moe", "glm4-moe-lite": "glm4_moe_lite", "glm-moe-dsa": "glm_moe_dsa"}
    for family, model_type in expected.items():
        assert families[family]["model_types"] == [model_type]
        assert families[family]["distribution"] == "colibri-glm"
        assert families[family]["status"] == "ok"


def test_the_glm_family_never_imports_colibri_deepseek(tmp_path_factory):
    paths = [str(fixture(tmp_path_factory, which).path) for which in (MOE, LITE, SHARED)]
    script = ("import sys, colibri_core\n"
              "for p in sys.argv[1:]:\n"
              "    with colibri_core.load(p) as m:\n"
              "        assert m.family.spec.name.startswith('glm'), m.family.spec.name\n"
              "        m.generate(token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True)\n"
              "print(sorted(n for n in sys.modules if n.startswith('colibri_')))\n")
    out = subprocess.run([sys.executable, "-c", script, *paths], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    modules = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    # plugin discovery imports every installed plugin's light package; no other family's
    # architecture may be imported to run GLM
    assert "colibri_glm.model" in modules
    assert not {m for m in modules if m.startswith(("colibri_deepseek.", "colibri_kimi."))}, modules

"""MiMo-V2-Flash's multi-token-prediction layers (``model.mtp.layers.{j}``: ``enorm``,
``hnorm``, ``eh_proj``, ``final_layernorm`` around a sliding-attention decoder layer with a
dense MLP and a ``pre_mlp_layernorm``) as the ``mtp`` draft source, against a torch
implementation written from vLLM's ``mimo_v2_mtp`` (``colibri_core.testing.mtp``): its
logits and its chained drafts, and drafting with it changes no token."""

import pytest

import colibri_core
from colibri_core.nn import SwiGLU
from colibri_core.nn.mtp import MIMO_MTP, mtp_layout
from colibri_core.testing.backends import backend_params, matrix_beyond_cpu
from colibri_core.testing.mtp import (add_mimo_mtp_layer, check_mtp_drafts_change_nothing,
                                     check_mtp_layer_matches_reference)

import test_mimo_v2_flash_oracle as oracle_suite
from test_mimo_v2_flash_configs import MIMO_V2_FLASH


def test_the_published_config_declares_mimo_mtp_layers():
    assert mtp_layout(MIMO_V2_FLASH) == (MIMO_MTP, 3, "num_nextn_predict_layers")
    assert MIMO_MTP.prefixes("model.layers.48", 1) == ("model.mtp.layers.1", "model.mtp.layers.1")
    # DeepSeek's layout keeps the same field: the model type tells them apart
    assert mtp_layout({**MIMO_V2_FLASH, "model_type": "deepseek_v3"})[0].name == "deepseek"


def test_the_first_mtp_layer_is_built_as_vllm_builds_it(tmp_path_factory, tmp_path):
    """Layer 0 of ``model.mtp.layers`` only (the checkpoint has two), its block a sliding
    layer's attention (twice the KV heads, the window, the sinks, the sliding rope) and a
    dense SwiGLU of intermediate_size, its norms under MiMo's names."""
    fx = oracle_suite.TestMiMoV2FlashOracle()._fixture("defaults_sharded", tmp_path_factory)
    mtp_dir = add_mimo_mtp_layer(fx.path, tmp_path)
    with colibri_core.load(mtp_dir, history=False, mtp=True) as model:
        lm = model.lm
        assert len(lm.mtp) == 1
        layer = lm.mtp[0]
        attn, sliding = layer.block.attn, lm.layers[1].attn
        assert layer.index == 3 and layer.prefixes == ("model.mtp.layers.0.",)
        assert (attn.window, attn.n_kv_heads, attn.v_head_dim, attn.value_scale) == (8, 2, 16, 0.707)
        assert attn.sinks.name == "model.mtp.layers.0.self_attn.attention_sink_bias"
        assert (attn.rope.inv_freq == sliding.rope.inv_freq).all() and attn.rope.rotary_dim == sliding.rope.rotary_dim
        assert isinstance(layer.block.mlp, SwiGLU) and layer.block.mlp.down.weight.name == "model.mtp.layers.0.mlp.down_proj.weight"
        names = [n.weight.name for n in (layer.enorm, layer.hnorm, layer.block.attn_norm, layer.block.mlp_norm, layer.head_norm)]
        assert names == [f"model.mtp.layers.0.{n}.weight" for n in
                         ("enorm", "hnorm", "input_layernorm", "pre_mlp_layernorm", "final_layernorm")]
        assert layer.eh_proj.weight.name == "model.mtp.layers.0.eh_proj.weight" and layer.head is lm.lm_head
    with colibri_core.load(mtp_dir, history=False) as plain:  # not asked for: not read
        assert plain.lm.mtp == []


@pytest.mark.parametrize("backend", matrix_beyond_cpu(backend_params()))
@pytest.mark.parametrize("case", ["defaults_sharded", "yarn_groups_tied"])
def test_mtp_layer_matches_the_torch_reference(backend, case, tmp_path_factory, tmp_path):
    """MTP logits within 1e-4 of the reference at every prompt position (prompts longer
    than the sliding window), chained drafts (depth 3, twice on one drafter) equal to the
    reference's, and drafting with it changes no token; the second case has a window of
    5, a half-rotated sliding rope and tied embeddings."""
    fx = oracle_suite.TestMiMoV2FlashOracle()._fixture(case, tmp_path_factory)
    check_mtp_layer_matches_reference(fx.path, tmp_path, fx.prompt, backend, layout="mimo")


@pytest.mark.parametrize("backend", matrix_beyond_cpu(backend_params()))
def test_mtp_drafts_change_nothing(backend, tmp_path_factory, tmp_path):
    """Greedy and seeded sampling with ``draft="mtp"`` (depth 1 and 3), experts streaming
    through one cached expert per layer, give the tokens and bit-identical logits of
    decoding without drafts."""
    fx = oracle_suite.TestMiMoV2FlashOracle()._fixture("defaults_sharded", tmp_path_factory)
    mtp_dir = add_mimo_mtp_layer(fx.path, tmp_path)
    check_mtp_drafts_change_nothing(mtp_dir, fx.prompt, backend)

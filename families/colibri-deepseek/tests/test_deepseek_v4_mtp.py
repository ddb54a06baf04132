"""DeepSeek-V4's multi-token-prediction layer (``mtp.{j}.``: ``enorm``, ``hnorm``, separate
``e_proj`` / ``h_proj``, a V4 block on hyper-connection streams, its own ``hc_head`` and
``norm``) as the ``mtp`` draft source, against a torch implementation written from vLLM's
``deepseek_v4_mtp`` and DeepSeek's ``MTPBlock`` (``colibri_core.testing.mtp``): its logits
and its chained drafts, and drafting with it changes no token."""

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import ModelFormatError, UnsupportedModelError, UsageError
from colibri_core.io.checkpoint import Checkpoint
from colibri_core.nn.hyper import HeadNorm, HyperDecoderLayer
from colibri_core.nn.mtp import DEEPSEEK_MTP, DEEPSEEK_V4_MTP, StreamMTPLayer, mtp_layout
from colibri_core.nn.routers import HashRouter, ScoredTopKRouter
from colibri_core.testing import edit_config
from colibri_core.testing.backends import backend_params, matrix_beyond_cpu
from colibri_core.testing.mtp import (add_v4_mtp_layer, check_mtp_drafts_change_nothing,
                                     check_mtp_layer_matches_reference)

import test_deepseek_v4_native as native_suite
import test_deepseek_v4_oracle as oracle_suite
from ds_v4_native import v4_native_rewrite


def _fixture(case, tmp_path_factory):
    return oracle_suite.TestDeepseekV4Oracle()._fixture(case, tmp_path_factory)


def test_v4_configs_declare_the_v4_layout():
    config = {"model_type": "deepseek_v4", "num_hidden_layers": 43, "num_nextn_predict_layers": 1}
    assert mtp_layout(config) == (DEEPSEEK_V4_MTP, 1, "num_nextn_predict_layers")
    assert DEEPSEEK_V4_MTP.prefixes("model.layers.43", 0) == ("mtp.0", "mtp.0")
    # DeepSeek-V3's layout keeps the same field: the model type tells them apart
    assert mtp_layout({**config, "model_type": "deepseek_v3"})[0] is DEEPSEEK_MTP


def test_a_checkpoint_saved_by_transformers_has_no_mtp_layer(tmp_path_factory):
    """transformers drops ``mtp.*`` on load and its config declares one MTP layer: asked
    for, the missing layer is named; ``if-usable`` loads the model without it."""
    fx = _fixture("mixed", tmp_path_factory)
    with pytest.raises(ModelFormatError, match="'mtp.0.e_proj.weight'"):
        colibri_core.load(fx.path, history=False, mtp=True)
    with colibri_core.load(fx.path, history=False, mtp="if-usable") as model:
        assert model.lm.mtp == []


def test_the_mtp_layer_is_built_as_vllm_builds_it(tmp_path_factory, tmp_path):
    """Layer number num_hidden_layers under ``mtp.0.``: a sliding layer's attention (no
    compressor, the window, the main rope), a score-routed MoE (not hash-routed, its
    correction bias read), the hyper-connections and norms under DeepSeek's names (the
    KV norm in transformers' spelling here), its own hc_head and norm before the model's
    LM head; the model hands it its streams and gives the same logits as without."""
    fx = _fixture("mixed", tmp_path_factory)
    mtp_dir = add_v4_mtp_layer(fx.path, tmp_path, kv_norm="norm")
    with colibri_core.load(mtp_dir, history=False, mtp=True) as model:
        lm = model.lm
        assert len(lm.mtp) == 1
        layer = lm.mtp[0]
        assert isinstance(layer, StreamMTPLayer) and isinstance(layer.block, HyperDecoderLayer)
        assert layer.index == 4 and layer.prefixes == ("mtp.0.",) and not layer.chains_normed
        attn, sliding = layer.block.attn, lm.layers[0].attn
        assert attn.compressor is None and attn.indexer is None and attn.window == 8
        assert (attn.rope.inv_freq == sliding.rope.inv_freq).all()
        assert attn.kv_norm.weight.name == "mtp.0.attn.norm.weight"
        assert isinstance(lm.layers[0].mlp.router, HashRouter)
        router = layer.block.mlp.router
        assert isinstance(router, ScoredTopKRouter) and router.bias.name == "mtp.0.ffn.gate.bias"
        assert layer.block.mlp.experts.decl.layer == 4
        names = [n.weight.name for n in (layer.enorm, layer.hnorm, layer.block.attn_norm, layer.block.mlp_norm)]
        assert names == [f"mtp.0.{n}.weight" for n in ("enorm", "hnorm", "attn_norm", "ffn_norm")]
        assert layer.block.attn_hc.fn.weight.name == "mtp.0.hc_attn_fn"
        assert (layer.eh_proj.weight.name, layer.h_proj.weight.name) == ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight")
        assert isinstance(layer.head_norm, HeadNorm) and layer.head_norm.head.fn.weight.name == "mtp.0.hc_head_fn"
        assert layer.head_norm.norm.weight.name == "mtp.0.norm.weight"
        assert layer.head is lm.lm_head and layer.embed.weight is lm.embed.weight
        assert lm.hidden_before_norm and isinstance(lm.norm, HeadNorm)  # the streams go to the drafter as they are
        logits = model.logits(fx.prompt)
    np.testing.assert_array_equal(logits, _plain_logits(fx))
    with colibri_core.load(mtp_dir, history=False) as plain:  # not asked for: not read
        assert plain.lm.mtp == [] and not plain.lm.hidden_before_norm


def _plain_logits(fx):
    with colibri_core.load(fx.path, history=False) as plain:
        return plain.logits(fx.prompt)


def test_a_compressed_mtp_layer_is_refused(tmp_path_factory, tmp_path):
    """DeepSeek's configs list a compress ratio for the MTP layer too (0: sliding); one
    that gives it a compressor is refused, as vLLM would build it sliding."""
    fx = _fixture("mixed", tmp_path_factory)
    mtp_dir = add_v4_mtp_layer(fx.path, tmp_path)
    edit_config(mtp_dir, compress_ratios=[0, 4, 8, 4, 0])
    with colibri_core.load(mtp_dir, history=False, mtp=True) as model:
        assert model.lm.mtp[0].block.attn.compressor is None
    edit_config(mtp_dir, compress_ratios=[0, 4, 8, 4, 4])
    with pytest.raises(UnsupportedModelError, match=r"compress_ratios\[4\] = 4"):
        colibri_core.load(mtp_dir, history=False, mtp=True)


@pytest.mark.parametrize("backend", matrix_beyond_cpu(backend_params()))
@pytest.mark.parametrize("case", ["mixed", "yarn_sigmoid_sharded"])
def test_mtp_layer_matches_the_torch_reference(backend, case, tmp_path_factory, tmp_path):
    """MTP logits within 1e-4 of the reference at every prompt position (prompts longer
    than the sliding window), chained drafts (depth 3, twice on one drafter) equal to the
    reference's, and drafting with it changes no token; the second case has 2 streams, a
    window of 6, sigmoid scores and a sharded checkpoint."""
    fx = _fixture(case, tmp_path_factory)
    check_mtp_layer_matches_reference(fx.path, tmp_path, fx.prompt, backend, layout="deepseek-v4")


@pytest.mark.parametrize("backend", matrix_beyond_cpu(backend_params()))
def test_the_published_layout_with_fp4_experts(backend, tmp_path_factory, tmp_path):
    """The layer as DeepSeek ships it (``ds_v4_native``: the whole checkpoint in the
    published layout; the layer's attention projections, shared expert, ``e_proj`` and
    ``h_proj`` fp8 with 128 x 128 block scales, its routed experts fp4): its 4-bit experts
    are refused unless ``mtp_int4`` (the int8 rule); forced, its logits are the
    reference's on the dequantised weights, its chained drafts too, and drafting changes
    no token."""
    fx = native_suite.TestDeepseekV4NativeOracle()._fixture("flash", tmp_path_factory)
    float_dir = fx.path.parent / f"{fx.path.name}-dequantized"  # rewrite_checkpoint's float32 copy
    check_mtp_layer_matches_reference(float_dir, tmp_path, fx.prompt, backend, layout="deepseek-v4",
                                      rewrite=v4_native_rewrite(), mtp_int4=True)
    mtp_dir = tmp_path / "with-mtp" / "model"
    checkpoint = Checkpoint(mtp_dir)
    try:
        stored = {n: checkpoint.info(n).dtype for n in ("mtp.0.e_proj.weight", "mtp.0.e_proj.scale",
                                                         "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.0.w1.weight",
                                                         "mtp.0.ffn.experts.0.w1.scale", "mtp.0.attn.kv_norm.weight")}
    finally:
        checkpoint.close()
    assert stored == {"mtp.0.e_proj.weight": "F8_E4M3", "mtp.0.e_proj.scale": "F8_E8M0",
                      "mtp.0.attn.wq_a.weight": "F8_E4M3", "mtp.0.ffn.experts.0.w1.weight": "I8",
                      "mtp.0.ffn.experts.0.w1.scale": "F8_E8M0", "mtp.0.attn.kv_norm.weight": "F32"}
    with pytest.raises(UsageError, match=r"'mtp\.0\.ffn\.experts\.\d+\.w[123]\.weight' .* fp4"):
        colibri_core.load(mtp_dir, backend=backend, history=False, mtp=True)


@pytest.mark.parametrize("backend", matrix_beyond_cpu(backend_params()))
def test_mtp_drafts_change_nothing(backend, tmp_path_factory, tmp_path):
    """Greedy and seeded sampling with ``draft="mtp"`` (depth 1 and 3), experts streaming
    through one cached expert per layer, give the tokens and bit-identical logits of
    decoding without drafts."""
    fx = _fixture("mixed", tmp_path_factory)
    mtp_dir = add_v4_mtp_layer(fx.path, tmp_path)
    check_mtp_drafts_change_nothing(mtp_dir, fx.prompt, backend)

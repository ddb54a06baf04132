"""Hunyuan MoE against transformers' HunYuanMoEV1ForCausalLM: greedy tokens and logits
under every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu``
restricts them).

The cases cover q/k norms after RoPE with and without attention biases, NTK-alpha RoPE
(Hunyuan-A13B's) and YaRN, one top-k for every layer and one per layer, tied and untied
embeddings, MHA and GQA, single-file and sharded saves (per-expert tensors, as
transformers saves them), and the fused layout transformers keeps in memory.
"""

import pytest
from transformers import HunYuanMoEV1Config

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.nn import SoftmaxTopKRouter
from colibri_core.testing import copy_model
from colibri_core.testing.oracle import FamilyOracleSuite, FusedLayoutCheck, OracleCase
from colibri_core.testing.oracle_cases import prompt, yarn

NTK_ALPHA = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}  # Hunyuan-A13B's


def config(**overrides):
    # (transformers' Hunyuan attention needs head_dim spelled out)
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32,
                intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_experts=8, moe_topk=2, max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: HunYuanMoEV1Config(**base)


class TestHunYuanMoeV1Oracle(FamilyOracleSuite, FusedLayoutCheck):
    model_class = "HunYuanMoEV1ForCausalLM"
    fused_case = "ntk_alpha_topk_per_layer_sharded"  # transformers 5's in-memory experts.gate_up_proj / down_proj
    cases = {
        "base": OracleCase(config(), prompt=prompt(30)),
        # NTK-alpha RoPE, q/k/v/o biases, 16 experts, top-k 1, 4 and 2 by layer
        "ntk_alpha_topk_per_layer_sharded": OracleCase(
            config(num_hidden_layers=3, num_experts=16, moe_topk=[1, 4, 2], attention_bias=True,
                   rope_parameters=NTK_ALPHA),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5)),
        # tied, MHA, a wider head, YaRN
        "tied_mha_yarn": OracleCase(
            config(tie_word_embeddings=True, num_key_value_heads=4, head_dim=16, rope_parameters=yarn()),
            seed=2, prompt=prompt(45, 3)),
    }

    def test_norms_after_rope_and_routers_per_layer(self, tmp_path_factory):
        fx = self._fixture("ntk_alpha_topk_per_layer_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
            assert all(layer.attn.qk_norm_after_rope for layer in layers)
            assert [layer.mlp.router.top_k for layer in layers] == [1, 4, 2]
            assert all(isinstance(layer.mlp.router, SoftmaxTopKRouter) and layer.mlp.shared is not None
                       for layer in layers)

    def test_per_layer_expert_counts_are_refused(self, tmp_path_factory, tmp_path):
        fx = self._fixture("base", tmp_path_factory)
        model = copy_model(fx.path, tmp_path / "lists", num_experts=[8, 8])
        with pytest.raises(UnsupportedModelError, match="num_experts .*per-layer expert counts are not supported"):
            colibri_core.load(model, history=False)

"""Solar Open against transformers' SolarOpenForCausalLM: greedy tokens and logits under
every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

Every router gets a random ``e_score_correction_bias`` (a buffer the perturbation leaves
at zero), so that choosing with it and weighting without it is tested; the cases cover
grouped and ungrouped routing, renormalised or not, one or two shared experts, q/k/v
biases, head_dim given or implied, tied embeddings, yarn and sharded checkpoints.
"""

import pytest
from transformers import SolarOpenConfig

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.nn import SigmoidGroupedTopKRouter
from colibri_core.testing import copy_model
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32,
                moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: SolarOpenConfig(**base)


class TestSolarOpenOracle(FamilyOracleSuite):
    model_class = "SolarOpenForCausalLM"
    cases = {
        # 2 groups of 4 experts (1 chosen), top-2 renormalised and scaled, a shared expert,
        # grouped KV heads of 16 dims, several shards
        "grouped_sharded": OracleCase(config(), max_shard_size="40KB", prompt=prompt(30), prepare=random_correction_bias()),
        # q/k/v biases, no grouping, 16 experts top-4 not renormalised, 2 shared experts, MHA
        # of 8-dim heads, tied embeddings, yarn
        "biases_tied_yarn": OracleCase(
            config(attention_bias=True, n_group=1, n_routed_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                   routed_scaling_factor=1.0, n_shared_experts=2, num_key_value_heads=4, head_dim=8,
                   tie_word_embeddings=True, rope_parameters=yarn(), num_hidden_layers=2),
            seed=1, prompt=prompt(40, 5), prepare=random_correction_bias(0.2, 7)),
    }

    def test_every_layer_is_moe(self, tmp_path_factory):
        fx = self._fixture("grouped_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
        assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoE"] * 3
        router = layers[0].mlp.router
        assert isinstance(router, SigmoidGroupedTopKRouter) and router.bias is not None and router.n_group == 2

    def test_partial_rotary_is_refused(self, tmp_path_factory, tmp_path):
        fx = self._fixture("grouped_sharded", tmp_path_factory)
        model = copy_model(fx.path, tmp_path / "partial", partial_rotary_factor=0.5)
        with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
            colibri_core.load(model, history=False)

"""FlexOlmo against transformers' FlexOlmoForCausalLM: greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

The cases cover OLMo 2's layer (no pre-norms, the attention and MLP outputs normalised
before the residual), q/k norms over the whole projection with grouped KV heads, biases,
tied embeddings, yarn, renormalised or plain top-k, and sharded checkpoints."""

import pytest
from transformers import FlexOlmoConfig

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.testing import copy_model
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: FlexOlmoConfig(**base)


class TestFlexOlmoOracle(FamilyOracleSuite):
    model_class = "FlexOlmoForCausalLM"
    cases = {
        # grouped KV heads, 8 experts top-2 not renormalised, several shards
        "gqa_sharded": OracleCase(config(), max_shard_size="40KB", prompt=prompt(30)),
        # q/k/v/o biases, MHA, 6 experts top-3 renormalised, tied embeddings, yarn
        "biases_tied_yarn": OracleCase(
            config(attention_bias=True, num_key_value_heads=4, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
                   tie_word_embeddings=True, rope_parameters=yarn(), num_hidden_layers=2),
            seed=1, prompt=prompt(40, 5)),
    }

    def test_layers_have_no_pre_norms(self, tmp_path_factory):
        fx = self._fixture("gqa_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layer = model.lm.layers[0]
        assert type(layer.attn_norm).__name__ == type(layer.mlp_norm).__name__ == "Unnormed"
        assert layer.attn_post.weight.name == "model.layers.0.post_attention_layernorm.weight"
        assert layer.mlp_post.weight.name == "model.layers.0.post_feedforward_layernorm.weight"

    def test_partial_rotary_is_refused(self, tmp_path_factory, tmp_path):
        fx = self._fixture("gqa_sharded", tmp_path_factory)
        model = copy_model(fx.path, tmp_path / "partial", partial_rotary_factor=0.5)
        with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
            colibri_core.load(model, history=False)

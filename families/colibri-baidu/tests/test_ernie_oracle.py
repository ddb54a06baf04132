"""ERNIE 4.5 MoE against transformers' Ernie4_5_MoeForCausalLM: greedy tokens and logits
under every placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu``
restricts them).

Each case gives the routers a random ``e_score_correction_bias`` (of the probabilities'
size, so it changes which experts are chosen, never their weights) and covers dense and
MoE layers, with and without shared experts, biases, tied embeddings and rope scaling.
"""

import numpy as np
import pytest
from transformers import Ernie4_5_MoeConfig

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.nn import SoftmaxGroupedTopKRouter
from colibri_core.testing import copy_model
from colibri_core.testing.oracle import FamilyOracleSuite, FusedLayoutCheck, OracleCase
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=48,
                moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, tie_word_embeddings=False,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: Ernie4_5_MoeConfig(**base)


def correction_bias(scale: float = 0.1, seed: int = 1234):
    """Random ``moe_statics.e_score_correction_bias`` (a frozen parameter, zeros at init)
    of about the probabilities' size (1 / experts)."""

    def prepare(model):
        import torch

        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)

    return prepare


class TestErnie4_5MoeOracle(FamilyOracleSuite, FusedLayoutCheck):
    model_class = "Ernie4_5_MoeForCausalLM"
    fused_case = "sharded_biases_interval"  # transformers 5's in-memory experts.gate_up_proj / down_proj
    cases = {
        # layer 0 dense, then MoE with one shared expert
        "base": OracleCase(config(), prompt=prompt(30), prepare=correction_bias()),
        # q/k/v/o, MLP and LM head biases, MoE every second layer (1 and 3), 16 experts top-4, 2 shared
        "sharded_biases_interval": OracleCase(
            config(use_bias=True, num_hidden_layers=4, moe_layer_interval=2, moe_num_experts=16, moe_k=4,
                   moe_num_shared_experts=2),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5), prepare=correction_bias(0.05, 7)),
        # no shared experts, MoE only in layers 0..1 (layer 2 dense), tied (with a head bias),
        # MHA, yarn, top-1
        "tied_yarn_no_shared": OracleCase(
            config(moe_num_shared_experts=0, moe_layer_start_index=0, moe_layer_end_index=1, tie_word_embeddings=True,
                   use_bias=True, num_key_value_heads=4, moe_k=1, rope_parameters=yarn()),
            seed=2, prompt=prompt(45, 3), prepare=correction_bias(0.2, 3)),
    }

    def test_layers_and_router(self, tmp_path_factory):
        fx = self._fixture("sharded_biases_interval", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            kinds = [type(layer.mlp).__name__ for layer in model.lm.layers]
            router = model.lm.layers[1].mlp.router
        assert kinds == ["SwiGLU", "SparseMoE", "SwiGLU", "SparseMoE"]
        assert isinstance(router, SoftmaxGroupedTopKRouter) and router.renormalise and router.bias is not None
        assert router.bias.name == "model.layers.1.mlp.moe_statics.e_score_correction_bias"

    def test_another_activation_is_refused(self, tmp_path_factory, tmp_path):
        fx = self._fixture("base", tmp_path_factory)
        model = copy_model(fx.path, tmp_path / "gelu", hidden_act="gelu")
        with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
            colibri_core.load(model, history=False)

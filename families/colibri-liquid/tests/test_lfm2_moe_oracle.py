"""LFM2-MoE against transformers' Lfm2MoeForCausalLM: greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

The cases cover gated short-convolution layers (their state carried across prefill
chunks, decode steps, batched and drafted steps) beside attention layers, conv biases
and two kernel sizes, dense first layers, the router with a random ``expert_bias`` and
its renormalisation (+ 1e-6) or neither, ``routed_scaling_factor``, tied and untied
embeddings, yarn and sharded checkpoints.
"""

import pytest
from transformers import Lfm2MoeConfig

import colibri_core
from colibri_core.nn import GatedShortConv
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=48,
                moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                layer_types=["conv", "full_attention", "conv"], num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
                routed_scaling_factor=2.0, max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: Lfm2MoeConfig(**base)


def expert_bias(scale: float = 0.2, seed: int = 1234):
    """A random ``expert_bias`` (a buffer the perturbation leaves at zero)."""

    def prepare(model):
        import torch

        g = torch.Generator().manual_seed(seed)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=g) * scale)

    return prepare


class TestLfm2MoeOracle(FamilyOracleSuite):
    model_class = "Lfm2MoeForCausalLM"
    cases = {
        # conv, attention, conv (kernel 3); a dense first layer; 8 experts top-2 chosen with a
        # random expert_bias, renormalised, times 2.0; grouped KV heads; tied embeddings
        "conv_attention_dense_first": OracleCase(config(), prompt=prompt(30), prepare=expert_bias()),
        # attention, conv, conv (kernel 4, biases); every layer MoE, 16 experts top-4 without
        # bias or renormalisation; MHA; untied; yarn; several shards
        "conv_bias_plain_router_sharded": OracleCase(
            config(layer_types=["full_attention", "conv", "conv"], conv_bias=True, conv_L_cache=4, num_dense_layers=0,
                   num_experts=16, num_experts_per_tok=4, use_expert_bias=False, norm_topk_prob=False,
                   routed_scaling_factor=1.0, num_key_value_heads=4, tie_word_embeddings=False, rope_parameters=yarn()),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5)),
    }

    def test_layers(self, tmp_path_factory):
        fx = self._fixture("conv_attention_dense_first", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
            final = model.lm.norm
        assert [type(layer.attn).__name__ for layer in layers] == ["GatedShortConv", "Attention", "GatedShortConv"]
        assert isinstance(layers[0].attn, GatedShortConv) and layers[0].attn.kernel == 3
        assert layers[1].mlp_norm.weight.name == "model.layers.1.ffn_norm.weight"
        assert final.weight.name == "model.embedding_norm.weight"
        router = layers[1].mlp.router
        assert router.bias.name == "model.layers.1.feed_forward.expert_bias" and router.norm_eps == pytest.approx(1e-6)

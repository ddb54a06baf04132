"""AFMoE against transformers' AfmoeForCausalLM: greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

Every MoE layer gets a random ``expert_bias`` (choosing only), large enough to change the
choice; the cases cover the norms around both branches, the gated attention with per-head
q/k norms, sliding layers with RoPE beside global NoPE layers (prompts longer than the
window) by ``global_attn_every_n_layers`` and by ``layer_types``, dense first layers,
shared experts, ``route_scale``, muP embeddings, biases, tied embeddings, yarn and sharded
checkpoints.
"""

from transformers import AfmoeConfig

import colibri_core
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase
from colibri_core.testing.oracle_cases import prompt, yarn


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=48,
                moe_intermediate_size=16, num_hidden_layers=3, num_dense_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                route_scale=2.0, global_attn_every_n_layers=2, sliding_window=8, max_position_embeddings=256,
                initializer_range=0.1)
    base.update(overrides)
    return lambda: AfmoeConfig(**base)


def expert_bias(scale: float, seed: int):
    """A random ``expert_bias`` of about the sigmoid scores' spread."""

    def prepare(model):
        import torch

        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("expert_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)

    return prepare


class TestAfmoeOracle(FamilyOracleSuite):
    model_class = "AfmoeForCausalLM"
    cases = {
        # sliding (8 positions, RoPE), global (NoPE), sliding; a dense first layer; 8 experts
        # top-2 times 2.0, a shared expert
        "sliding_nope_dense_first": OracleCase(config(), prompt=prompt(30), prepare=expert_bias(0.2, 1)),
        # muP embeddings, tied; layer_types global then sliding (6 positions, yarn); every
        # layer MoE, 16 experts top-4, 2 shared experts; q/k/v/o biases; MHA of 8-dim heads;
        # several shards
        "mup_tied_yarn_sharded": OracleCase(
            config(mup_enabled=True, tie_word_embeddings=True, num_hidden_layers=2,
                   layer_types=["full_attention", "sliding_attention"], sliding_window=6, rope_parameters=yarn(),
                   num_dense_layers=0, num_experts=16, num_experts_per_tok=4, num_shared_experts=2, route_scale=1.0,
                   attention_bias=True, num_key_value_heads=4, head_dim=8),
            seed=1, max_shard_size="40KB", prompt=prompt(40, 5), prepare=expert_bias(0.1, 7)),
    }

    def test_layers(self, tmp_path_factory):
        fx = self._fixture("sliding_nope_dense_first", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
        assert [(layer.attn.window, layer.attn.rope is not None) for layer in layers] == [(8, True), (None, False), (8, True)]
        assert [type(layer.mlp).__name__ for layer in layers] == ["SwiGLU", "SparseMoE", "SparseMoE"]
        layer = layers[1]
        assert layer.mlp_norm.weight.name == "model.layers.1.pre_mlp_layernorm.weight"
        assert layer.attn_post.weight.name == "model.layers.1.post_attention_layernorm.weight"
        assert layer.attn.gate.weight.name == "model.layers.1.self_attn.gate_proj.weight"
        assert layer.mlp.router.bias.name == "model.layers.1.mlp.expert_bias"

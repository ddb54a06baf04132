"""Granite 4 (granitemoehybrid) against transformers' GraniteMoeHybridForCausalLM: greedy
tokens and logits under every placement, on every installed backend
(``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

The cases cover Mamba-2 layers (grouped and single B/C groups, conv biases or none,
biased projections, dt limited by time_step_limit, prompts spanning several chunks)
beside attention layers without positional encoding (transformers' default) or with
RoPE, every muP multiplier away from 1, the shared SwiGLU beside the routed experts,
tied and untied embeddings, sharded checkpoints and transformers' in-memory layout.
"""

import colibri_core
from colibri_core.testing.mamba import Mamba2Checks
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt
from transformers import GraniteMoeHybridConfig

M, A = "linear_attention", "full_attention"
MUP = dict(embedding_multiplier=4.0, attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=3.0)


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32,
                intermediate_size=16, shared_intermediate_size=24, num_hidden_layers=3, layer_types=[M, A, M],
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1,
                mamba_chunk_size=8, max_position_embeddings=128, initializer_range=0.1, **MUP)
    base.update(overrides)
    return lambda: GraniteMoeHybridConfig(**base)


class TestGraniteMoeHybridOracle(Mamba2Checks, FamilyOracleSuite):
    model_class = "GraniteMoeHybridForCausalLM"
    cases = {
        # Mamba (2 groups of 2 heads of 8), NoPE attention, Mamba; 8 experts top-2 and the
        # shared SwiGLU; chunks of 8; untied
        "nope_grouped": OracleCase(config(), prompt=prompt(30)),
        # attention with RoPE, Mamba (1 group, 2 heads of 32, kernel 3, no conv bias, biased
        # projections, dt within [0.01, 0.08]), attention, Mamba; 16 experts top-4; MHA;
        # tied; chunks of 5; several shards. A prompt of 27: no prefill chunk of the suite's
        # small-chunk test (5) is a lone token, which takes the stepwise form without the dt
        # limits, as a one-token transformers forward does (the limits bind here)
        "rope_limits_biases_tied_sharded": OracleCase(
            config(num_hidden_layers=4, layer_types=[A, M, A, M], position_embedding_type="rope", mamba_n_heads=2,
                   mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=5,
                   mamba_conv_bias=False, mamba_proj_bias=True, time_step_limit=(0.01, 0.08), num_local_experts=16,
                   num_experts_per_tok=4, num_key_value_heads=4, tie_word_embeddings=True),
            seed=1, max_shard_size="40KB", prompt=prompt(27, 5)),
    }

    def test_layers(self, tmp_path_factory):
        fx = self._fixture("rope_limits_biases_tied_sharded", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
            assert [type(layer.attn).__name__ for layer in layers] == ["Attention", "Mamba2Mixer"] * 2
            assert layers[0].attn.rope is not None and layers[1].attn.dt_limit == (0.01, 0.08)
            assert layers[1].attn.in_proj.weight.name == "model.layers.1.mamba.in_proj.weight"
            assert layers[1].mlp.shared is not None
        with colibri_core.load(self._fixture("nope_grouped", tmp_path_factory).path, history=False) as model:
            assert model.lm.layers[1].attn.rope is None

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        fx = self._fixture("nope_grouped", tmp_path_factory)
        target = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, target)
        assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in names
        self.check_rewritten(fx, target, backend, "the in-memory layout")

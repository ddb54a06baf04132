"""Jamba against transformers' JambaForCausalLM: greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

The cases cover both mixers (Mamba (v1) with its dt / B / C norms, conv biases or none,
biased projections, an explicit or "auto" dt rank; NoPE grouped-query attention) and
both feed-forward kinds (the softmax top-k MoE, not renormalised; dense SwiGLU), the
periods and offsets placing them, prompts past the suite's prefill chunk (the Mamba state
carried across prefill chunks, decode steps, batched and drafted steps), tied and untied
embeddings, sharded checkpoints and transformers' in-memory layout (fused experts).
"""

import colibri_core
from colibri_core.testing.mamba1 import Mamba1Checks
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, save_in_memory_layout
from colibri_core.testing.oracle_cases import prompt
from transformers import JambaConfig


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32,
                intermediate_size=24, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                num_experts=8, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                mamba_dt_rank=4, max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: JambaConfig(**base)


class TestJambaOracle(Mamba1Checks, FamilyOracleSuite):
    model_class = "JambaForCausalLM"
    cases = {
        # Mamba + dense, Mamba + MoE, attention + dense, Mamba + MoE; 8 experts top-2; GQA;
        # conv bias, no projection biases; untied
        "mamba_attention_moe": OracleCase(config(), prompt=prompt(30)),
        # attention + MoE, Mamba + dense, Mamba + MoE, attention + dense, Mamba + MoE (periods
        # 3 and 2, offsets 0); 16 experts top-4; MHA; no conv bias, biased in/out projections,
        # kernel 3, the dt rank "auto" (ceil(32 / 16) = 2); tied; several shards
        "periods_biases_tied_sharded": OracleCase(
            config(num_hidden_layers=5, attn_layer_period=3, attn_layer_offset=0, expert_layer_period=2,
                   expert_layer_offset=0, num_experts=16, num_experts_per_tok=4, num_key_value_heads=4,
                   mamba_d_conv=3, mamba_d_state=16, mamba_conv_bias=False, mamba_proj_bias=True, mamba_dt_rank="auto",
                   tie_word_embeddings=True),
            seed=1, max_shard_size="40KB", prompt=prompt(27, 5)),
    }

    def test_layers(self, tmp_path_factory):
        fx = self._fixture("mamba_attention_moe", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
            assert [type(layer.attn).__name__ for layer in layers] == ["Mamba1Mixer", "Mamba1Mixer", "Attention",
                                                                        "Mamba1Mixer"]
            assert [type(layer.mlp).__name__ for layer in layers] == ["SwiGLU", "SparseMoE", "SwiGLU", "SparseMoE"]
            assert layers[2].attn.rope is None and not layers[1].mlp.router.norm_topk_prob
            assert layers[0].attn.in_proj.weight.name == "model.layers.0.mamba.in_proj.weight"
            assert layers[0].attn.dt_norm.name == "model.layers.0.mamba.dt_layernorm.weight"
            assert layers[1].mlp_norm.weight.name == "model.layers.1.pre_ff_layernorm.weight"
            assert model.lm.norm.weight.name == "model.final_layernorm.weight"
            cache = model.lm.new_cache(model.backend)
            assert [type(s).__name__ for s in cache.layers] == ["RecurrentState", "RecurrentState", "KVCache",
                                                                 "RecurrentState"]
        with colibri_core.load(self._fixture("periods_biases_tied_sharded", tmp_path_factory).path,
                               history=False) as model:
            layers = model.lm.layers
            assert [type(layer.attn).__name__ for layer in layers] == ["Attention", "Mamba1Mixer", "Mamba1Mixer",
                                                                        "Attention", "Mamba1Mixer"]
            assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoE", "SwiGLU", "SparseMoE", "SwiGLU",
                                                                       "SparseMoE"]
            assert layers[1].attn.dt_rank == 2 and layers[1].attn.conv_bias is None

    def test_in_memory_layout_matches_transformers(self, backend, tmp_path_factory):
        """The checkpoint as transformers keeps it in memory (experts fused as
        ``experts.gate_up_proj`` / ``experts.down_proj``): the same tokens and logits."""
        fx = self._fixture("mamba_attention_moe", tmp_path_factory)
        path = tmp_path_factory.mktemp("in-memory") / "model"
        names = save_in_memory_layout(self.model_class, fx.path, path)
        assert "model.layers.1.feed_forward.experts.gate_up_proj" in names
        self.check_rewritten(fx, path, backend, "the in-memory checkpoint")

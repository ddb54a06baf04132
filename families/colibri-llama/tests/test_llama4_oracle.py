"""Llama 4 against transformers' Llama4ForCausalLM (``llama4_text``) and the text path of
Llama4ForConditionalGeneration (``llama4``): greedy tokens and logits under every
placement, on every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

The cases cover chunked attention on the RoPE layers with prompts past the chunk (and a
chunk as long as the context, where the cache keeps everything), NoPE layers with the
attention temperature tuning reached within the prompt (tiny ``floor_scale``) and
without it, the L2 q/k norm and its absence, dense layers between MoE layers
(``interleave_moe_layer_step`` and explicit ``moe_layers``), explicit ``no_rope_layers``
and ``layer_types``, top-1 and top-2 routing with the sigmoid weights on the experts'
inputs, the shared expert, q/k/v/o biases, llama3 rope (Scout's equal low and high
frequency factors, and a smoothed band), tied embeddings and sharded checkpoints.
"""

import pytest
from transformers import Llama4Config, Llama4TextConfig

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase
from colibri_core.testing.oracle_cases import prompt

# Llama 4 Scout's rope_scaling at the tiny models' scale (equal frequency factors)
SCOUT_LLAMA3 = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                "original_max_position_embeddings": 32, "rope_theta": 500000.0}
SMOOTH_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 32, "rope_theta": 10000.0}
VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vision_output_dim=16,
              image_size=28, patch_size=14, projector_input_dim=16, projector_output_dim=16)


def text(**overrides) -> dict:
    """A tiny Llama 4 text config: layers 0-2 RoPE and chunked (8 positions), layer 3 NoPE
    and full, with temperature tuning from position 3 on (floor_scale 4); MoE on layers 1
    and 3, dense SwiGLU (24) on 0 and 2; 8 experts top-1 of 16, a shared expert."""
    base = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32,
                intermediate_size=16, intermediate_size_mlp=24, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=1,
                interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return base


def text_config(**overrides):
    return lambda: Llama4TextConfig(**text(**overrides))


def multimodal_config(top: dict | None = None, **overrides):
    return lambda: Llama4Config(text_config=text(**overrides), vision_config=VISION, **(top or {}))


class TestLlama4TextOracle(FamilyOracleSuite):
    model_class = "Llama4ForCausalLM"
    cases = {
        # a 30-token prompt and 32 generated over chunks of 8; the NoPE layer's temperature
        # grows every 4 positions
        "chunked_nope_interleaved": OracleCase(text_config(), prompt=prompt(30)),
        # top-2 (each pair's input weighted on its own), biases, no q/k norm, Scout's llama3;
        # RoPE / NoPE and chunked / full set by hand (a chunked NoPE layer, a full RoPE one),
        # MoE layers listed; chunks of 6, temperature from position 2 (floor_scale 3); shards
        "top2_bias_explicit_layers_sharded": OracleCase(
            text_config(num_hidden_layers=3, num_experts_per_tok=2, attention_bias=True, use_qk_norm=False,
                        rope_parameters=SCOUT_LLAMA3, no_rope_layers=[1, 0, 1], moe_layers=[0, 2],
                        layer_types=["chunked_attention", "chunked_attention", "full_attention"],
                        attention_chunk_size=6, floor_scale=3),
            seed=1, prompt=prompt(20, 5), max_shard_size="40KB"),
        # tied, MHA, every layer MoE, no temperature tuning, a chunk as long as the context
        # (the cache keeps every position), a smoothed llama3 band
        "tied_mha_whole_chunk": OracleCase(
            text_config(num_hidden_layers=2, no_rope_layer_interval=2, tie_word_embeddings=True, num_key_value_heads=4,
                        interleave_moe_layer_step=1, attn_temperature_tuning=False, attention_chunk_size=256,
                        rope_parameters=SMOOTH_LLAMA3),
            seed=2, prompt=prompt(12)),
    }

    def test_layers(self, tmp_path_factory):
        """Which layers rotate, chunk, normalise q/k, tune the temperature and route."""
        fx = self._fixture("chunked_nope_interleaved", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            layers = model.lm.layers
            cache = model.lm.new_cache(model.backend)
        assert [(layer.attn.rope is not None, layer.attn.chunk, layer.attn.query_scale is not None,
                 layer.attn.q_norm is not None) for layer in layers] == [(True, 8, False, True)] * 3 + [(False, None, True, False)]
        assert [type(layer.mlp).__name__ for layer in layers] == ["SwiGLU", "SparseMoE", "SwiGLU", "SparseMoE"]
        assert [type(state).__name__ for state in cache.layers] == ["SlidingKVCache"] * 3 + ["KVCache"]
        assert {state.window for state in cache.layers[:3]} == {8}
        moe = layers[1].mlp
        assert moe.weight_inputs and type(moe.router).__name__ == "SigmoidTopKRouter"
        assert moe.router.gate.weight.name == "model.layers.1.feed_forward.router.weight"
        assert moe.shared.gate.weight.name == "model.layers.1.feed_forward.shared_expert.gate_proj.weight"
        assert layers[0].mlp.gate.weight.name == "model.layers.0.feed_forward.gate_proj.weight"
        experts = moe.experts.decl.matrices[3]
        assert experts["gate_up"].name == "model.layers.1.feed_forward.experts.gate_up_proj[3]"
        assert experts["down"].name == "model.layers.1.feed_forward.experts.down_proj[3]"

    def test_another_activation_is_refused(self, tmp_path_factory, tmp_path):
        from colibri_core.testing import copy_model

        fx = self._fixture("chunked_nope_interleaved", tmp_path_factory)
        with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
            colibri_core.load(copy_model(fx.path, tmp_path / "gelu", hidden_act="gelu"), history=False)


class TestLlama4Oracle(FamilyOracleSuite):
    model_class = "Llama4ForConditionalGeneration"
    cases = {
        # the text model of the multimodal checkpoint: chunks of 5 under a 24-token prompt,
        # the NoPE layer's temperature from position 1 (floor_scale 2), Scout's llama3
        "text_model_chunked_nope": OracleCase(multimodal_config(attention_chunk_size=5, floor_scale=2,
                                                                rope_parameters=SCOUT_LLAMA3), prompt=prompt(24, 3)),
        # tied through the text config, top-2, no q/k norm, every second layer NoPE, sharded
        "text_model_tied_top2_sharded": OracleCase(
            multimodal_config(num_hidden_layers=2, no_rope_layer_interval=2, tie_word_embeddings=True,
                              num_experts_per_tok=2, use_qk_norm=False, interleave_moe_layer_step=1),
            seed=1, prompt=prompt(18), max_shard_size="40KB"),
    }

    def test_only_the_text_model_is_loaded(self, tmp_path_factory):
        fx = self._fixture("text_model_chunked_nope", tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            infos = model.checkpoint.tensors
            assert any(n.startswith("vision_model.") for n in infos) and "multi_modal_projector.linear_1.weight" in infos
            assert model.lm.embed.weight.name == "language_model.model.embed_tokens.weight"
            assert model.lm.lm_head.weight.name == "language_model.lm_head.weight"
            text_tensors = [i for n, i in infos.items() if n.startswith("language_model.")]
            assert model.placement.dense_bytes == 4 * sum(i.numel for i in text_tensors if ".experts." not in i.name)

    def test_image_placeholder_in_prompt_is_refused(self, tmp_path_factory):
        from colibri_core.testing.oracle import build_oracle

        case = OracleCase(multimodal_config(top={"image_token_index": 100}), new_tokens=2)
        path = tmp_path_factory.mktemp("llama4_image")
        build_oracle(case, self.model_class, path)
        with colibri_core.load(path, history=False) as model:
            with pytest.raises(UnsupportedModelError, match="image input is not supported.*llama4"):
                model.generate(token_ids=[5, 100, 7], max_tokens=2)
            assert len(model.generate(token_ids=[5, 99, 7], max_tokens=2).token_ids) == 2

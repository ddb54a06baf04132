"""Inkling against transformers' InklingForCausalLM: sliding and full relative-bias
attention layers (prompts longer than the window, a full layer's bias extent shorter
than the sequence, log-length scaling), short convolutions, dense-first layers, the sink
MoE with shared experts, the muP head (a head padded beyond unpadded_vocab_size in one
case); tokens and logits under every placement. Also: the sliding layers' cache stays
bounded by the window, states fed in pieces, malformed configs refused, and the
multimodal checkpoint's text model (as transformers saves it: the original names, gate
and up interleaved) against InklingForConditionalGeneration, its media placeholders
refused."""

import json

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.nn.cache import LayerStates, SlidingKVCache
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import prompt

VOCAB = 128
WINDOW = 5


def inkling(**overrides):
    from transformers import InklingTextConfig

    base = dict(vocab_size=VOCAB, eos_token_id=None, pad_token_id=0, bos_token_id=1, hidden_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                swa_num_attention_heads=4, swa_num_key_value_heads=1, swa_head_dim=12, sliding_window_size=WINDOW,
                d_rel=4, rel_extent=12, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=2, route_scale=2.5, logits_mup_width_multiplier=0.7,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return lambda: InklingTextConfig(**base)


class TestInklingOracle(FamilyOracleSuite):
    model_class = "InklingForCausalLM"
    cases = {
        # sliding / full / sliding, the first MLP dense; the full layer's bias extent (12)
        # shorter than the 44 positions, log-length scaling from position 3
        "hybrid": OracleCase(inkling(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                                     mlp_layer_types=["dense", "sparse", "sparse"], log_scaling_n_floor=3,
                                     log_scaling_alpha=0.4),
                             seed=3, prompt=prompt(12), prepare=random_correction_bias()),
        # the default layer pattern from local_layer_ids, one shared expert, MHA sliding
        # layers, a kernel of 3, a head padded past the vocabulary
        "padded": OracleCase(inkling(num_hidden_layers=2, local_layer_ids=[0], n_shared_experts=1,
                                     swa_num_key_value_heads=4, conv_kernel_size=3, unpadded_vocab_size=120,
                                     num_experts_per_tok=3),
                             seed=11, prompt=prompt(9, step=11), prepare=random_correction_bias(seed=7)),
    }


def multimodal(**text_overrides):
    """An inkling_mm_model config around the text config, with tiny vision and audio towers
    (never run: only built and saved)."""
    def make():
        from transformers import InklingConfig

        text = inkling(**text_overrides)().to_dict()
        towers = dict(text_hidden_size=text["hidden_size"])
        return InklingConfig(text_config=text, vision_config=dict(towers, patch_size=2, hidden_size=8, num_hidden_layers=1,
                                                                  num_attention_heads=2),
                             audio_config=dict(towers, n_mel_bins=4, mel_vocab_size=8),
                             image_token_id=120, audio_token_id=121, image_bos_token_id=122, audio_bos_token_id=123)
    return make


class TestInklingMultimodalOracle(FamilyOracleSuite):
    """save_pretrained writes the original layout (model.llm.*, attn.wq_du, row-interleaved
    w13 tensors for the dense, shared and routed MLPs)."""

    model_class = "InklingForConditionalGeneration"
    cases = {
        "mm": OracleCase(multimodal(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                                    mlp_layer_types=["dense", "sparse", "sparse"]),
                         seed=5, prompt=prompt(10, step=5), prepare=random_correction_bias(seed=3)),
    }


def test_multimodal_checkpoint_keeps_the_original_names_and_refuses_media(tmp_path_factory):
    fx = TestInklingMultimodalOracle.oracle("mm", tmp_path_factory)
    from safetensors import safe_open

    with safe_open(next(fx.path.glob("*.safetensors")), "np") as f:
        names = set(f.keys())
    assert {"model.llm.embed.weight", "model.llm.layers.0.mlp.w13_dn.weight", "model.llm.layers.1.mlp.experts.w13_weight",
            "model.llm.layers.1.mlp.shared_experts.shared_w13_weight"} <= names
    assert not any(n.startswith("model.language_model.") for n in names)
    with colibri_core.load(fx.path, history=False) as model:
        for token, what in ((120, "image"), (121, "audio")):
            with pytest.raises(UnsupportedModelError, match=what):
                model.generate(token_ids=list(fx.prompt) + [token], max_tokens=1)


def test_sliding_layers_keep_at_most_the_window(tmp_path_factory):
    fx = TestInklingOracle.oracle("hybrid", tmp_path_factory)
    with colibri_core.load(fx.path, history=False) as model:
        lm, ops = model.lm, model.backend
        cache = lm.new_cache(ops)
        lm.forward(np.asarray(fx.prompt + fx.tokens), cache, ops)
        kinds = [type(layer["kv"]).__name__ for layer in cache.layers]
        assert kinds == ["SlidingKVCache", "KVCache", "SlidingKVCache"]
        n = len(fx.prompt) + len(fx.tokens)
        for layer in cache.layers:
            assert isinstance(layer, LayerStates)
            assert set(layer.parts) == {"kv", "k_sconv", "v_sconv", "attn_sconv", "mlp_sconv"}
            kv = layer["kv"]
            held = kv.bytes_for(n) if isinstance(kv, SlidingKVCache) else kv.bytes_per_token() * n
            assert held == (min(n, WINDOW) if isinstance(kv, SlidingKVCache) else n) * kv.bytes_per_token()
        # what plan reports: the sliding layers at their window, the full ones per position
        assert cache.bytes_for(10 * n) < 10 * n * cache.bytes_per_token()


def test_inkling_configs_are_checked(tmp_path_factory, tmp_path):
    import shutil

    fx = TestInklingOracle.oracle("hybrid", tmp_path_factory)
    bad = {"layer_types": ["hybrid"] * 2, "mlp_layer_types": ["dense", "moe", "sparse"],
           "swa_num_key_value_heads": 3, "hidden_act": "gelu", "sliding_window_size": 0}
    for field, value in bad.items():
        model_dir = tmp_path / field
        shutil.copytree(fx.path, model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config[field] = value
        (model_dir / "config.json").write_text(json.dumps(config))
        with pytest.raises((ModelFormatError, UnsupportedModelError), match=field):
            colibri_core.load(model_dir, history=False).close()


def as_multimodal(src, dst):
    """The text oracle rewritten as an ``inkling_mm_model`` checkpoint under transformers'
    in-memory names: the config nested in ``text_config`` with media token ids, the text
    tensors under ``model.language_model.``."""
    from safetensors.numpy import load_file

    from colibri_core.io.safetensors import write_safetensors

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    renamed = {(k if k.startswith("lm_head") else "model.language_model." + k[len("model."):]): v for k, v in tensors.items()}
    dst.mkdir(parents=True)
    write_safetensors(dst / "model.safetensors", renamed, {"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    config = {"model_type": "inkling_mm_model", "architectures": ["InklingForConditionalGeneration"],
              "text_config": text, "image_token_id": 120, "audio_token_id": 121, "image_bos_token_id": 122,
              "audio_bos_token_id": 123}
    (dst / "config.json").write_text(json.dumps(config))


def test_multimodal_checkpoint_runs_its_text_model_and_refuses_media(tmp_path_factory, tmp_path):
    fx = TestInklingOracle.oracle("hybrid", tmp_path_factory)
    mm = tmp_path / "mm"
    as_multimodal(fx.path, mm)
    with colibri_core.load(mm, history=False) as model:
        result = model.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True, return_logits=True)
        for token, what in ((120, "image"), (121, "audio")):
            with pytest.raises(UnsupportedModelError, match=what):
                model.generate(token_ids=list(fx.prompt) + [token], max_tokens=1)
        model.generate(token_ids=list(fx.prompt) + [122], max_tokens=1)  # a begin-of-image marker is text
    assert result.token_ids == fx.tokens
    assert float(np.abs(np.stack(result.logits) - fx.step_logits).max()) < 1e-4

"""Tiny GLM configs shared by this family's tests (eos_token_id=None: generation runs
the full 32 tokens)."""


COMMON = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, hidden_size=32, intermediate_size=48,
              moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
              max_position_embeddings=128, initializer_range=0.1)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)


def glm4_moe(**overrides):
    from transformers import Glm4MoeConfig

    kwargs = {**COMMON, "num_key_value_heads": 2, "head_dim": 16, "first_k_dense_replace": 1, "use_qk_norm": True,
              "attention_bias": True, **overrides}
    if kwargs["head_dim"] is None:  # hidden_size // num_attention_heads (transformers cannot take None)
        del kwargs["head_dim"]
    return lambda: Glm4MoeConfig(**kwargs)


def glm4_moe_lite(**overrides):
    from transformers import Glm4MoeLiteConfig

    kwargs = {**COMMON, **MLA, **overrides}
    return lambda: Glm4MoeLiteConfig(**kwargs)


def glm_moe_dsa(**overrides):
    from transformers import GlmMoeDsaConfig

    # 16 indexer heads: with few heads, exact ties between index scores (relu zeros) make
    # even transformers' cached and uncached paths choose different keys
    kwargs = {**COMMON, **MLA, "first_k_dense_replace": 1, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 4,
              **overrides}
    return lambda: GlmMoeDsaConfig(**kwargs)


NEXT = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=48,
            moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=0, qk_nope_head_dim=16,
            v_head_dim=12, index_topk=8, index_head_dim=16, index_n_heads=16, index_kpool=4, linear_head_dim=8,
            linear_num_heads=4, max_position_embeddings=256, initializer_range=0.1)
# the smallest vision tower transformers builds: saved beside the text model, never read by colibri
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                   projection_intermediate_size=16)
# outside the tiny vocabulary: a generated token is never a placeholder (test_glm5_next_runtime
# makes one a placeholder on purpose)
MEDIA = dict(image_token_id=200, video_token_id=201, image_start_token_id=202, image_end_token_id=203,
             video_start_token_id=204, video_end_token_id=205)


def glm5_next(top=None, **overrides):
    """Glm5NextConfig with a tiny text model (``overrides``) and vision tower; ``top``:
    top-level fields (tie_word_embeddings, media token ids)."""
    from transformers import Glm5NextConfig

    text = {**NEXT, **overrides}
    return lambda: Glm5NextConfig(text_config=text, vision_config=TINY_VISION, **{**MEDIA, **(top or {})})

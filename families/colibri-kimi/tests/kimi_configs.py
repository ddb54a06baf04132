"""Tiny Kimi K2.5 configs: a DeepSeek-V3 text model inside the vision-language wrapper."""


VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
              num_hidden_layers=1, hidden_size=8, intermediate_size=16)


def text_kwargs(**overrides):
    base = dict(model_type="deepseek_v3", vocab_size=128, eos_token_id=None, hidden_size=32, intermediate_size=48,
                moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=12, max_position_embeddings=128, initializer_range=0.1)
    base.update(overrides)
    base["num_key_value_heads"] = base["num_attention_heads"]
    return base


def k25(tie_word_embeddings=True, **overrides):
    from transformers import Kimi_K25Config

    text = text_kwargs(**overrides)
    return lambda: Kimi_K25Config(text_config=dict(text), vision_config=dict(VISION), projection_hidden_size=8,
                                  tie_word_embeddings=tie_word_embeddings, eos_token_id=None)

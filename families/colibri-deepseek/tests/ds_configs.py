"""Tiny DeepSeek configs shared by this family's tests."""


def v3_kwargs(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                max_position_embeddings=128, initializer_range=0.1)
    base.update(overrides)
    if base.get("num_key_value_heads") != base["num_attention_heads"]:
        base["num_key_value_heads"] = base["num_attention_heads"]  # transformers' default (128) breaks MLA
    return base


def v3(**overrides):
    from transformers import DeepseekV3Config

    kwargs = v3_kwargs(**overrides)
    return lambda: DeepseekV3Config(**kwargs)


def v32(**overrides):
    from transformers import DeepseekV32Config

    kwargs = v3_kwargs(**{"index_n_heads": 16, "index_head_dim": 16, "index_topk": 4, **overrides})
    kwargs.pop("rope_interleave", None)  # V3.2's MLA always interleaves
    return lambda: DeepseekV32Config(**kwargs)

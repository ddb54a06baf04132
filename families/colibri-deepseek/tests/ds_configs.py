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

    # 16 indexer heads: with few heads, exact ties between index scores (relu zeros) make
    # even transformers' cached and uncached paths choose different keys
    kwargs = v3_kwargs(**{"index_n_heads": 16, "index_head_dim": 16, "index_topk": 4, **overrides})
    kwargs.pop("rope_interleave", None)  # V3.2's MLA always interleaves
    return lambda: DeepseekV32Config(**kwargs)


def v4_kwargs(**overrides):
    base = dict(vocab_size=96, eos_token_id=None, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
                num_attention_heads=4, head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=8,
                o_groups=2, o_lora_rank=12, index_n_heads=16, index_head_dim=16, index_topk=2, sliding_window=8,
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                             "compressed_sparse_attention"],
                mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], partial_rotary_factor=0.5, hc_mult=3,
                max_position_embeddings=256, initializer_range=0.1)
    base.update(overrides)
    return base


def v4(**overrides):
    from transformers import DeepseekV4Config

    kwargs = v4_kwargs(**overrides)
    return lambda: DeepseekV4Config(**kwargs)


def v4_buffers(seed: int = 7, bias_scale: float = 0.3):
    """An ``OracleCase.prepare`` hook for DeepSeek-V4: distinct random experts per token in
    every hash layer's ``tid2eid`` (transformers initialises it to zeros, one expert
    twice) and a random ``e_score_correction_bias`` in the others."""

    def prepare(model):
        import torch

        g = torch.Generator().manual_seed(seed)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                vocab, k = buffer.shape
                experts = model.config.n_routed_experts
                buffer.copy_(torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(vocab)]))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=g) * bias_scale)

    return prepare


def v2(**overrides):
    """A tiny DeepSeek-V2: V3's sizes, V2's router (greedy unless overridden), no
    renormalisation; ``q_lora_rank=None`` is V2-Lite's attention."""
    from transformers import DeepseekV2Config

    kwargs = v3_kwargs(**{"topk_method": "greedy", "n_group": None, "topk_group": None, "routed_scaling_factor": 1.0,
                          "n_shared_experts": 2, **overrides})
    return lambda: DeepseekV2Config(**kwargs)

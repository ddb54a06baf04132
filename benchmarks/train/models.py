"""The trained models' shapes: published routing geometries at widths that train on two
CPU cores in about 45 minutes and keep both checkpoints near 25 MB of bf16."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizer import VOCAB_SIZE

SEQ_LEN = 256


@dataclass(frozen=True)
class Recipe:
    name: str
    model_type: str
    steps: int
    batch: int  # sequences of SEQ_LEN tokens per step
    lr: float
    warmup: int
    threads: int  # torch threads: fixed, because the arithmetic (and so the weights) depends on it
    mtp_weight: float = 0.0  # the multi-token-prediction loss's weight (DeepSeek-V3: 0.3, then 0.1)
    bias_update: float = 0.0  # auxiliary-loss-free balancing: the router bias's step (DeepSeek-V3: 0.001)

    def config(self):
        return CONFIGS[self.model_type]()


def olmoe_config():
    from transformers import OlmoeConfig

    # OLMoE-1B-7B's routing geometry (16 layers, 64 experts, top-8, softmax router
    # without renormalising the top-k, q/k norms), widths cut to fit the budget
    return OlmoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32, num_hidden_layers=16,
        num_attention_heads=4, num_key_value_heads=4, num_experts=64, num_experts_per_tok=8,
        max_position_embeddings=4096, rope_theta=10000.0, router_aux_loss_coef=0.01,
        output_router_logits=True, norm_topk_prob=False, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )


def deepseek_v3_config():
    from transformers import DeepseekV3Config

    # DeepSeek-V3's structure: MLA (q and kv LoRA ranks, decoupled rope dims), the first
    # layer dense, then MoE layers of 64 routed experts in 8 groups (top-4 groups, top-6
    # experts, sigmoid scores with a correction bias, scaling 2.5) plus a shared expert,
    # and one multi-token-prediction layer
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )


CONFIGS = {"olmoe": olmoe_config, "deepseek_v3": deepseek_v3_config}

RECIPES = {
    "olmoe": Recipe("olmoe-16x64", "olmoe", steps=1500, batch=16, lr=3e-3, warmup=100, threads=1),
    "deepseek_v3": Recipe("deepseek-v3-6x64-mtp", "deepseek_v3", steps=1500, batch=16, lr=3e-3, warmup=100,
                          threads=1, mtp_weight=0.3, bias_update=1e-3),
}


def mtp_module(config):
    """DeepSeek-V3's multi-token-prediction layer: position i's final hidden state and
    the embedding of token i+1, each RMS-normed, concatenated (embedding first) and
    projected, through one decoder layer and a norm, then the shared LM head: predicts
    token i+2. Parameter names follow the published checkpoints' ``model.layers.{N}.*``
    (vLLM's and SGLang's loaders read the same names)."""
    import torch
    from torch import nn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    class SharedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    class MTPLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.enorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.hnorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
            self.block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
            self.shared_head = SharedHead()

        def forward(self, hidden, next_embeds, position_embeddings, position_ids):
            x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
            x = self.block(x, position_embeddings=position_embeddings, position_ids=position_ids)
            return self.shared_head.norm(x)

    return MTPLayer()


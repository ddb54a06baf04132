"""glm5_next (GLM-5 Next's text model: KDA linear attention with a bounded decay, NoPE MLA
with the pooled DSA indexer, clamped SwiGLU MoE, hyper-connections) against transformers'
Glm5NextForConditionalGeneration, under every placement.

Prompts are 70 tokens: longer than the linear attention's chunk (64), and than the
indexer's budget (index_topk tokens), so both the chunked recurrence and the pooled
selection are exercised, in prefill and in decode. The indexers have 16 heads: with few,
exact ties between pool scores make the selection arbitrary.
"""

import pytest

from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import prompt

from glm_configs import glm5_next

BIAS = random_correction_bias()
PROMPT = prompt(70)


class TestGlm5NextOracle(FamilyOracleSuite):
    model_class = "Glm5NextForConditionalGeneration"

    cases = {
        # linear, full indexed, shared indexed, linear; pools of 4, 2 kept per query (plus
        # its tail); 4 streams, 20 Sinkhorn rounds; the lower-bounded decay; one dense layer
        "hybrid_pooled_shared": OracleCase(
            glm5_next(layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
                      indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
            prompt=PROMPT, prepare=BIAS),
        # transformers' default schedules (every 4th layer indexed, 3 dense layers first),
        # the softplus decay (linear_lower_bound null), SwiGLU clamped at 0.5, 3 streams
        # (a mean that is not a power-of-two division), 3 Sinkhorn rounds, pools of 2 with
        # 3 kept, no grouping, tied embeddings, several shards
        "defaults_softplus_clamped_tied": OracleCase(
            glm5_next(top={"tie_word_embeddings": True}, num_hidden_layers=5, linear_lower_bound=None, swiglu_limit=0.5,
                      hc_mult=3, hc_sinkhorn_iters=3, index_kpool=2, index_topk=6, n_group=1, n_shared_experts=2,
                      tie_word_embeddings=True),
            seed=1, prompt=PROMPT, max_shard_size="60KB", prepare=BIAS),
        # single-token pools (a token-level indexer with its tail empty), 2 streams, an
        # indexed layer first, top-3 of 16 experts in 4 groups (2 chosen), every layer MoE
        "token_pools_two_streams": OracleCase(
            glm5_next(layer_types=["indexed_attention", "linear_attention", "indexed_attention", "indexed_attention"],
                      indexer_types=["full", "full", "full", "shared"], mlp_layer_types=["sparse"] * 4, index_kpool=1,
                      index_topk=12, hc_mult=2, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                      linear_lower_bound=-2.0),
            seed=2, prompt=PROMPT, prepare=BIAS),
    }

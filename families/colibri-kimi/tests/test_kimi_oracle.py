"""Kimi K2.5's text model against transformers' Kimi_K25ForConditionalGeneration, and
Kimi K2 (a DeepSeek-V3 config with model_type kimi_k2) against DeepseekV3ForCausalLM."""

import json

from colibri_core.testing.fp8 import fp8_rewrite
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias

from kimi_configs import k25, text_kwargs

BIAS = random_correction_bias()
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 50000.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


class TestKimiK25Oracle(FamilyOracleSuite):
    model_class = "Kimi_K25ForConditionalGeneration"
    cases = {
        # the K2.5 default: lm_head tied to the embeddings by the top-level flag
        "tied": OracleCase(k25(), prepare=BIAS),
        # untied lm_head, Kimi K2's shape of routing (one group, scaling 2.827), yarn, shards
        "untied_yarn_sharded": OracleCase(
            k25(tie_word_embeddings=False, n_group=1, topk_group=1, n_routed_experts=12, num_experts_per_tok=3,
                routed_scaling_factor=2.827, rope_parameters=YARN),
            seed=1, max_shard_size="40KB", prepare=BIAS),
        # fp8 block scales with quantization_config in text_config
        "fp8_b16": OracleCase(k25(tie_word_embeddings=False), seed=2, prepare=BIAS,
                              rewrite=fp8_rewrite((16, 16), config_key="text_config")),
    }


def as_kimi_k2(path):
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    (path / "config.json").write_text(json.dumps(config))


def v3_config(**overrides):
    from transformers import DeepseekV3Config

    kwargs = text_kwargs(**overrides)
    kwargs.pop("model_type")
    return lambda: DeepseekV3Config(**kwargs)


class TestKimiK2Oracle(FamilyOracleSuite):
    model_class = "DeepseekV3ForCausalLM"
    cases = {
        "k2": OracleCase(v3_config(n_group=1, topk_group=1, routed_scaling_factor=2.827), prepare=BIAS,
                         rewrite=as_kimi_k2),
    }

"""Kimi K2.5's text model against transformers' Kimi_K25ForConditionalGeneration, and
Kimi K2 (a DeepSeek-V3 config with model_type kimi_k2) against DeepseekV3ForCausalLM."""

import json

import numpy as np
import pytest

from colibri_core.testing.fp8 import fp8_rewrite
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias
from colibri_core.testing.oracle_cases import yarn

from kimi_configs import k25, text_kwargs

BIAS = random_correction_bias()
YARN = yarn(rope_theta=50000.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)


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


# -- a generated image placeholder ------------------------------------------------------
PLACEHOLDER_PROMPT = (5, 17, 99, 3, 42, 7, 64)


def placeholder_from_generation(model):
    """``prepare`` hook: the correction bias, then make the model's own third-or-later
    greedy token (one not in the prompt, not 0) its image placeholder, so its greedy
    output holds a placeholder id. transformers embeds that id as token 0 from then on,
    so the continuation after it changes; colibri must follow."""
    import torch

    BIAS(model)
    prompt = torch.tensor([list(PLACEHOLDER_PROMPT)])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                         pad_token_id=0)
    generated = out[0, len(PLACEHOLDER_PROMPT):].tolist()
    token = next(t for t in generated[2:] if t not in PLACEHOLDER_PROMPT and t != 0)
    model.config.image_token_id = token


GENERATED_PLACEHOLDER = OracleCase(k25(), seed=3, prompt=PLACEHOLDER_PROMPT, prepare=placeholder_from_generation)


def _backends():
    from colibri_core.testing.backends import backend_params

    return backend_params()


@pytest.mark.parametrize("backend", _backends())
def test_a_generated_image_placeholder_is_embedded_as_transformers_does(backend, tmp_path_factory):
    import colibri_core
    from colibri_core.testing.oracle import oracle_fixture

    root = tmp_path_factory.getbasetemp() / "oracles"
    root.mkdir(exist_ok=True)
    fx = oracle_fixture("kimi-k25-placeholder", "generated", GENERATED_PLACEHOLDER, TestKimiK25Oracle.model_class, root)
    placeholder = json.loads((fx.path / "config.json").read_text())["image_token_id"]
    first = fx.tokens.index(placeholder)  # transformers generated it...
    assert first < len(fx.tokens) - 8, "the case needs tokens after the placeholder"
    with colibri_core.load(fx.path, backend=backend, history=False) as model:
        result = model.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True, return_logits=True)
        bound = max(1e-4, model.backend.logits_tolerance)
    assert result.token_ids == fx.tokens  # ... and colibri continues past it as transformers does
    worst = float(np.abs(np.stack(result.logits) - fx.step_logits).max())
    assert worst < bound, f"logits differ by {worst:.2e}"

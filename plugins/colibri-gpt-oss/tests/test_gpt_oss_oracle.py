"""gpt-oss against transformers' GptOssForCausalLM: tokens and logits under every placement,
with prompts longer than the sliding window (so the window and the bounded cache matter)."""

from pathlib import Path

import numpy as np

from colibri_core.testing.mxfp4 import quantize_mxfp4
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase
from colibri_core.testing.oracle_cases import yarn
from colibri_core.testing.rewrite import rewrite_checkpoint
from transformers import GptOssConfig

YARN = yarn(beta_fast=32.0, beta_slow=1.0, truncate=False)


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, pad_token_id=None, hidden_size=32, intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1,
                rope_parameters=YARN)
    base.update(overrides)
    return lambda: GptOssConfig(**base)


class TestGptOssOracle(FamilyOracleSuite):
    model_class = "GptOssForCausalLM"
    cases = {
        # sliding then full; a low swiglu_limit so both clamps bite
        "yarn_gqa_clamped": OracleCase(config(swiglu_limit=0.25), prompt=(5, 17, 99, 3, 42, 7, 64, 11, 23)),
        # full first, two sliding layers of another window, wider heads than hidden / heads, sharded
        "full_first_mha": OracleCase(
            config(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                   sliding_window=6, num_key_value_heads=4, head_dim=12, num_local_experts=6, num_experts_per_tok=3,
                   rope_parameters={**YARN, "factor": 2.0, "truncate": True}),
            seed=1, max_shard_size="60KB"),
    }


def gpt_oss_mxfp4(path):
    """``OracleCase.rewrite``: the experts as the original gpt-oss checkpoints ship them,
    ``gate_up_proj_blocks`` / ``_scales`` output-major (E, 2I, H / 32, 16) with gate and up
    rows interleaved, ``down_proj_blocks`` (E, H, I / 32, 16); the reference holds the
    dequantised numbers in transformers' (E, in, out) layout."""
    def quantise(tensors):
        stored, dequantised, names = {}, {}, []
        for name, t in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales, values = quantize_mxfp4(np.ascontiguousarray(np.swapaxes(t, 1, 2)))
                stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
                dequantised[name] = np.ascontiguousarray(np.swapaxes(values, 1, 2))
                names.append(name)
            else:
                stored[name] = dequantised[name] = t
        return stored, dequantised, names

    return rewrite_checkpoint(Path(path), quantise, {"quant_method": "mxfp4"})


class TestGptOssMxfp4Oracle(FamilyOracleSuite):
    """A tiny gpt-oss saved with MXFP4 experts runs token-exact against the same model dequantised."""

    model_class = "GptOssForCausalLM"
    cases = {"mxfp4_experts": OracleCase(config(intermediate_size=32, swiglu_limit=0.5), seed=2, rewrite=gpt_oss_mxfp4,
                                         prompt=(9, 4, 77, 31, 2, 56, 100, 8))}

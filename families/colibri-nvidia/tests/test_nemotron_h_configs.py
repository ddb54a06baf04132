"""Nemotron-H's config.json as published (``hybrid_override_pattern``, the older
``mamba_*`` names) parses as transformers parses it; malformed ones are refused naming the
field, and options colibri does not run are refused in one line."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_nvidia.model import NemotronH

PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 (the fields colibri reads)
NANO = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688,
        "hybrid_override_pattern": PATTERN, "num_hidden_layers": 52, "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 262144, "attention_bias": False,
        "intermediate_size": 1856, "mlp_hidden_act": "relu2", "mlp_bias": False, "ssm_state_size": 128,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4,
        "chunk_size": 128, "time_step_min": 0.001, "time_step_limit": [0.0, float("inf")], "use_conv_bias": True,
        "use_bias": False, "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "layer_norm_epsilon": 1e-05, "tie_word_embeddings": False,
        "residual_in_fp32": False, "sliding_window": None, "moe_latent_size": None}
# an older Nemotron-H config's spellings
LEGACY = {"mamba_n_groups": 4, "mamba_d_conv": 3, "mamba_dt_min": 0.01, "mamba_conv_bias": False, "mamba_chunk_size": 64}


@pytest.mark.parametrize("changes", [{}, LEGACY, {"layers_block_type": ["mamba", "attention", "mlp", "moe"]},
                                     {"hybrid_override_pattern": None, "layer_types": ["moe", "linear_attention"]},
                                     {"hybrid_override_pattern": None}],
                         ids=["published", "legacy-names", "legacy-kinds", "layer-types", "default-kinds"])
def test_config_parses_like_transformers(changes):
    raw = {k: v for k, v in {**NANO, **changes}.items() if v is not None}
    a = NemotronH.parse(raw)
    ref = transformers.NemotronHConfig(**raw)
    assert a.layers_block_type == ref.layers_block_type
    assert a.num_hidden_layers == ref.num_hidden_layers
    for name in ("n_groups", "conv_kernel", "time_step_min", "use_conv_bias", "chunk_size", "n_routed_experts",
                 "moe_shared_expert_intermediate_size", "head_dim", "num_key_value_heads"):
        assert getattr(a, name) == getattr(ref, name), name
    assert a.rms_norm_eps == ref.layer_norm_epsilon and a.tie_word_embeddings is False


@pytest.mark.parametrize("changes, error, field", [
    ({"hybrid_override_pattern": "MEX*"}, ModelFormatError, "hybrid_override_pattern must be"),
    ({"hybrid_override_pattern": None, "layers_block_type": ["mamba2"]}, ModelFormatError, "layers_block_type must"),
    ({"num_experts_per_tok": 129}, ModelFormatError, "num_experts_per_tok 129 exceeds n_routed_experts 128"),
    ({"num_key_value_heads": 5}, ModelFormatError, "num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    ({"n_groups": 7}, ModelFormatError, "mamba_num_heads 64 is not a multiple of n_groups 7"),
    ({"n_group": 3}, ModelFormatError, "n_routed_experts 128 is not a multiple of n_group 3"),
    ({"chunk_size": 0}, ModelFormatError, "chunk_size"),
    ({"mlp_hidden_act": "silu"}, UnsupportedModelError, "mlp_hidden_act 'silu' is not supported"),
    ({"mamba_hidden_act": "relu"}, UnsupportedModelError, "mamba_hidden_act 'relu' is not supported"),
    ({"moe_latent_size": 1024}, UnsupportedModelError, "moe_latent_size is not supported"),
    ({"sliding_window": 4096}, UnsupportedModelError, "sliding_window is not supported"),
])
def test_bad_or_unsupported_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field) as info:
        NemotronH.parse({**NANO, **changes})
    assert "\n" not in str(info.value)

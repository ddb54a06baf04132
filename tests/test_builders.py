"""colibri_core.model.builders: the typed fields shared by the DeepSeek-style families
(the assembly itself, nn.assembly.build_decoder, is proved by every family's oracle tests)."""

import dataclasses
from dataclasses import dataclass

import pytest

from colibri_core.model.config import bounded
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.builders import DeepseekV3Args, DSAArgs, MLAArgs, SigmoidMoEArgs

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2)
MLA = dict(BASE, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=24)


@dataclass(kw_only=True)
class WithDefaults(MLAArgs):
    n_group: int = bounded(1, 1 << 10, default=4)
    first_k_dense_replace: int = bounded(0, 1 << 10, default=2)


def test_families_override_defaults_and_keep_the_checks():
    a = WithDefaults.from_dict(MLA)
    assert (a.n_group, a.topk_group, a.first_k_dense_replace) == (4, 1, 2)
    assert [a.is_moe(i) for i in range(4)] == [False, False, True, True]
    with pytest.raises(ModelFormatError, match="'n_group' = 0 is outside"):
        WithDefaults.from_dict(dict(MLA, n_group=0))
    with pytest.raises(ModelFormatError, match="missing field 'kv_lora_rank'"):
        MLAArgs.from_dict(BASE)


def test_dsa_layer_kinds():
    a = DSAArgs.from_dict(dict(MLA, first_k_dense_replace=9))
    assert not any(a.is_moe(i) for i in range(4)) and not a.shared_indexer(1)
    a = DSAArgs.from_dict(dict(MLA, mlp_layer_types=["sparse", "dense", "dense", "sparse"]))
    assert [a.is_moe(i) for i in range(4)] == [True, False, False, True]
    with pytest.raises(ModelFormatError, match="DSA needs q_lora_rank"):
        DSAArgs.from_dict(dict(MLA, q_lora_rank=None))


@pytest.mark.parametrize("changes,error,match", [
    ({"n_group": 3}, ModelFormatError, "n_routed_experts 8 is not divisible by n_group 3"),
    ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 5}, ModelFormatError, "must be within 1..4"),
    ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func 'softmax'"),
    ({"mlp_layer_types": ["dense"]}, ModelFormatError, "mlp_layer_types must list"),
])
def test_router_checks(changes, error, match):
    with pytest.raises(error, match=match):
        SigmoidMoEArgs.from_dict(dict(BASE, **changes))


def test_deepseek_v3_defaults_are_transformers():
    """DeepseekV3Args (shared by colibri-deepseek and colibri-kimi) defaults every field
    as transformers' DeepseekV3Config does, but two: q_lora_rank (None: a null in
    config.json must mean "no q LoRA", which a default of 1536 would override) and
    num_key_value_heads (None: all heads, the only value MLA accepts)."""
    from transformers import DeepseekV3Config

    reference = DeepseekV3Config()
    defaults = {f.name: f.default for f in dataclasses.fields(DeepseekV3Args)
                if f.default is not dataclasses.MISSING and hasattr(reference, f.name)}
    assert {"n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"} <= set(defaults)
    differ = {name for name, value in defaults.items() if getattr(reference, name) != value}
    assert differ == {"q_lora_rank", "num_key_value_heads"}

"""Hy3's config.json parses as transformers' HYV3Config parses it (its defaults, the
default dense-then-sparse layers, ``num_local_experts``); malformed and unsupported ones
are refused naming the field."""

import pytest
import transformers

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_hunyuan.hy_v3 import HYV3

SMALL = {"model_type": "hy_v3", "architectures": ["HYV3ForCausalLM"], "num_hidden_layers": 4, "num_experts": 16,
         "num_experts_per_tok": 4}


def test_defaults_parse_like_transformers():
    a = HYV3.parse(SMALL)
    ref = transformers.HYV3Config(**SMALL)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "num_shared_experts", "router_scaling_factor", "rms_norm_eps",
              "mlp_layer_types")
    assert [getattr(a, f) for f in fields] == [getattr(ref, f) for f in fields]
    assert a.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert [a.is_moe(i) for i in range(4)] == [False, True, True, True]


def test_num_local_experts_spelling():
    raw = {k: v for k, v in SMALL.items() if k != "num_experts"}
    assert HYV3.parse({**raw, "num_local_experts": 32}).num_experts == 32


@pytest.mark.parametrize("changes, error, field", [
    ({"num_experts_per_tok": 17}, ModelFormatError, "num_experts_per_tok 17 exceeds num_experts 16"),
    ({"num_experts": 0}, ModelFormatError, "num_experts"),
    ({"num_key_value_heads": 5}, ModelFormatError, "num_attention_heads 64 is not a multiple of num_key_value_heads 5"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, UnsupportedModelError, "mlp_bias true is not supported"),
    ({"num_shared_experts": 0}, UnsupportedModelError, "num_shared_experts 0 is not supported"),
    ({"mlp_layer_types": ["dense", "sparse"]}, ModelFormatError, "mlp_layer_types must give one of"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, ModelFormatError, "mlp_layer_types"),
])
def test_malformed_configs_are_refused(changes, error, field):
    with pytest.raises(error, match=field):
        HYV3.parse({**SMALL, **changes})

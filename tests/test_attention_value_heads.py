"""``Attention``'s value heads of their own width (``v_head_dim``) and value scale
(``value_scale``), the options MiMo-V2-Flash needs first, against transformers' own
MiMoV2FlashAttention: a full layer, and a sliding layer with sinks and twice the KV
heads."""

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.nn import Attention, Cache, Linear, Step, build_rope
from colibri_core.nn.weights import Param
from colibri_core.testing import memory_param

torch = pytest.importorskip("torch")
ops = CpuBackend()


param = memory_param


def tensor(module_param) -> Param:
    return param(module_param.detach().numpy())


@pytest.mark.parametrize("layer, scaled", [(0, True), (1, True), (1, False)],
                         ids=["full", "sliding-sinks", "value-scale-dropped"])
def test_narrow_scaled_value_heads_match_mimo_v2_flash_attention(layer, scaled):
    from transformers import MiMoV2FlashConfig
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import (MiMoV2FlashAttention,
                                                                           MiMoV2FlashRotaryEmbedding)

    config = MiMoV2FlashConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16,
                               num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
                               sliding_window=4, attention_bias=True, attention_value_scale=0.6)
    config._attn_implementation = "eager"
    torch.manual_seed(layer)
    reference = MiMoV2FlashAttention(config, layer).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    t = 9
    x = torch.randn(1, t, 32)
    kind = config.layer_types[layer]
    cos, sin = MiMoV2FlashRotaryEmbedding(config)(x, torch.arange(t)[None], kind)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    visible = (j <= i) & ((j > i - 4) if kind == "sliding_attention" else True)
    mask = torch.where(visible, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        expected = reference(x, (cos, sin), mask)[0][0].numpy()

    def lin(m):
        return Linear(tensor(m.weight), None if m.bias is None else tensor(m.bias))

    params = config.rope_parameters[kind]
    sliding = kind == "sliding_attention"
    ours = Attention(layer=0, q=lin(reference.q_proj), k=lin(reference.k_proj), v=lin(reference.v_proj),
                     o=lin(reference.o_proj), n_heads=4, n_kv_heads=2 if sliding else 1, head_dim=24, v_head_dim=16,
                     value_scale=0.6 if scaled else 1.0, rope=build_rope({"rope_parameters": dict(params)}, 24),
                     window=4 if sliding else None, sinks=tensor(reference.sinks) if sliding else None)
    assert ours.rope.rotary_dim == 8
    step = Step(ops, np.arange(t), Cache([ours.new_state(ops, 16)]))
    got = ours(x[0].numpy(), step)
    assert got.shape == expected.shape == (t, 32)
    if scaled:
        np.testing.assert_allclose(got, expected, atol=2e-5)
    else:
        assert np.abs(got - expected).max() > 1e-3


def test_value_heads_of_their_own_width_need_a_separate_gate():
    lin = Linear(param(np.eye(8)))
    with pytest.raises(ValueError, match="needs v_head_dim == head_dim"):
        Attention(layer=0, q=lin, k=lin, v=lin, o=lin, n_heads=1, n_kv_heads=1, head_dim=4, v_head_dim=2, rope=None,
                  output_gate=True)
    with pytest.raises(ValueError, match="v_head_dim must be >= 1"):
        Attention(layer=0, q=lin, k=lin, v=lin, o=lin, n_heads=1, n_kv_heads=1, head_dim=4, v_head_dim=0, rope=None)

"""DeepSeek-V2, V3 and V3.2 on colibri's shared blocks (transformers: models/deepseek_v2,
models/deepseek_v3, models/deepseek_v32). MLA, the DSA indexer, the sigmoid grouped and
softmax grouped routers, the fp8 format, DeepSeek-V3's config defaults
(``colibri_core.model.builders``) and the decoder assembly (``colibri_core.nn.assembly``)
are colibri_core's; this file adds V3.2's index fields and its rope layout, and V2's
config and MoE."""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.builders import DeepseekV3Args, DSAArgs, MLAArgs, MLAMoEFamily, mla_mixer
from colibri_core.model.config import bounded
from colibri_core.model.family import Family
from colibri_core.nn import SoftmaxGroupedTopKRouter, SparseMoE
from colibri_core.nn.assembly import build_decoder


@dataclass(kw_only=True)
class DeepseekV32Args(DeepseekV3Args, DSAArgs):
    """DeepSeek-V3.2: V3's defaults plus the DSA indexer fields."""


class DeepseekV3(MLAMoEFamily):
    name, args = "deepseek-v3", DeepseekV3Args


class DeepseekV32(MLAMoEFamily):
    name, args = "deepseek-v32", DeepseekV32Args
    # V3.2's MLA always uses interleaved rope (transformers has no rope_interleave for it);
    # its indexer uses the half-split layout.
    mixer_options = {"interleave": True}


@dataclass(kw_only=True)
class DeepseekV2Args(MLAArgs):
    """DeepSeek-V2 / V2-Lite (transformers' DeepseekV2Config defaults): MLA as V3's, a
    softmax router, ``greedy`` or ``group_limited_greedy``, whose top-k probabilities are
    scaled by ``routed_scaling_factor`` and never renormalised, shared experts in every
    MoE layer, dense layers before ``first_k_dense_replace``."""

    n_shared_experts: int = bounded(0, 1 << 8, default=2)
    first_k_dense_replace: int = bounded(0, 1 << 10, default=0)
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    mlp_bias: bool = False

    def validate(self, source):
        heads = self.num_attention_heads
        if self.num_key_value_heads not in (None, heads):
            raise ModelFormatError(f"{source}: MLA expands the latent into all {heads} heads; num_key_value_heads "
                                   f"{self.num_key_value_heads} must equal num_attention_heads")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.scoring_func != "softmax":
            raise UnsupportedModelError(f"{source}: scoring_func {self.scoring_func!r} is not supported by deepseek_v2 "
                                        "(only 'softmax')")
        if self.topk_method not in V2_TOPK_METHODS:
            raise UnsupportedModelError(f"{source}: topk_method {self.topk_method!r} is not supported by deepseek_v2 "
                                        f"(only {' and '.join(map(repr, V2_TOPK_METHODS))})")
        if self.norm_topk_prob:
            # DeepSeek's own code would renormalise, transformers' DeepseekV2 never does:
            # no reference to follow
            raise UnsupportedModelError(f"{source}: norm_topk_prob true is not supported by deepseek_v2 (its router "
                                        "scales the top-k probabilities by routed_scaling_factor, never renormalises)")
        if self.moe_layer_freq != 1:
            raise UnsupportedModelError(f"{source}: moe_layer_freq {self.moe_layer_freq} is not supported (only 1)")
        if self.mlp_bias:
            raise UnsupportedModelError(f"{source}: mlp_bias true is not supported by deepseek_v2 (MLPs without biases)")
        experts, group = self.n_routed_experts, self.groups
        if experts % group:
            raise ModelFormatError(f"{source}: n_routed_experts {experts} is not divisible by n_group {group}")
        top_groups = self.topk_group if group > 1 else 1
        if top_groups > group:
            raise ModelFormatError(f"{source}: topk_group {self.topk_group} exceeds n_group {group}")
        if not 1 <= self.num_experts_per_tok <= top_groups * (experts // group):
            raise ModelFormatError(f"{source}: num_experts_per_tok {self.num_experts_per_tok} must be within 1.."
                                   f"{top_groups * (experts // group)} (the experts of topk_group groups)"
                                   if group > 1 else
                                   f"{source}: num_experts_per_tok {self.num_experts_per_tok} must be within 1..{experts}")

    @property
    def groups(self) -> int:
        """Expert groups of the router: n_group for group_limited_greedy, 1 for greedy."""
        return self.n_group if self.topk_method == "group_limited_greedy" else 1


V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def v2_moe_mlp(a: DeepseekV2Args, w):
    """Each layer's MLP at ``prefix.mlp``: a dense SwiGLU before ``first_k_dense_replace``,
    then ``gate`` (the softmax router), routed ``experts`` and ``shared_experts``."""

    def mlp(i: int, prefix: str):
        p = f"{prefix}.mlp"
        hidden, inner, n = a.hidden_size, a.moe_intermediate_size, a.n_routed_experts
        if not a.is_moe(i):
            return w.swiglu(p, hidden, a.intermediate_size)
        group = a.groups
        router = SoftmaxGroupedTopKRouter(w.linear(f"{p}.gate", n, hidden), a.num_experts_per_tok, n_group=group,
                                          topk_group=a.topk_group if group > 1 else 1,
                                          routed_scaling_factor=a.routed_scaling_factor)
        shared = w.swiglu(f"{p}.shared_experts", hidden, inner * a.n_shared_experts) if a.n_shared_experts else None
        return SparseMoE(router, w.swiglu_experts(i, f"{p}.experts", n, hidden, inner), shared=shared)

    return mlp


class DeepseekV2(Family):
    """DeepSeek-V2 and V2-Lite: MLA (interleaved-pair rope, with or without q LoRA) and
    DeepSeek-V2's MoE on ``build_decoder``."""

    name = "deepseek-v2"

    @staticmethod
    def parse(config: dict, source: str = "config.json") -> DeepseekV2Args:
        # transformers' default q_lora_rank when the key is absent; null: no q LoRA (V2-Lite)
        return DeepseekV2Args.from_dict({"q_lora_rank": 1536, **config}, source)

    def build(self, config, w):
        a = self.parse(config, w.config_source)
        return build_decoder(a, w, mla_mixer(a, config, w, interleave=True), v2_moe_mlp(a, w))

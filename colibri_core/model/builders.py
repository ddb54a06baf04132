"""Config fields and blocks shared by the DeepSeek-style MoE families.

DeepSeek-V3/V3.2, Kimi K2, GLM-4.5+ (``glm4_moe``), GLM-4.7-Flash (``glm4_moe_lite``)
and GLM-5 (``glm_moe_dsa``) share one skeleton: pre-norm decoder layers whose MLP is a
dense SwiGLU for the first layers and, after them, a sigmoid group-limited router
(``noaux_tc``) over routed SwiGLU experts plus shared experts. Most of them use MLA
attention, some with the DSA indexer. This module holds that skeleton once:

- typed config fields: ``SigmoidMoEArgs`` (router, experts, dense-layer schedule),
  ``MLAArgs`` (latent attention), ``DSAArgs`` (the lightning indexer), and
  ``DeepseekV3Args`` (DeepSeek-V3's defaults, which Kimi K2 shares);
- declarations of the blocks from their usual tensor names: ``sigmoid_moe``,
  ``mla_attention``, ``lightning_indexer`` (and ``softmax_moe``, the softmax-routed MoE
  of OLMoE and Qwen);
- the per-layer blocks ``colibri_core.nn.assembly.build_decoder`` takes:
  ``sigmoid_moe_mlp`` (dense first, then the MoE) and ``mla_mixer`` (MLA, with DSA when
  the args have index fields).

Families subclass the args to set their defaults and add what is truly theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.model.config import ModelArgs, bounded
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.family import Family
from colibri_core.nn.assembly import LayerBlock, build_decoder
from colibri_core.nn.deltanet import CHUNK_SIZE, GatedDeltaNet, LowRank, conv_weight_2d, neg_exp_flat
from colibri_core.nn.norms import GatedRMSNorm
from colibri_core.nn.dsa import LayerNorm, LightningIndexer, SharedIndexer
from colibri_core.nn.layers import SoftmaxTopKRouter, SparseMoE
from colibri_core.nn.mamba import Mamba2Mixer
from colibri_core.nn.mla import MLAttention, mla_softmax_scale
from colibri_core.nn.rope import RoPE, build_rope
from colibri_core.nn.routers import SigmoidGroupedTopKRouter

# q_a_layernorm / kv_a_layernorm / the indexer's k_norm use the default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


@dataclass(kw_only=True)
class SigmoidMoEArgs(ModelArgs):
    """The decoder skeleton and its sigmoid group-limited MoE. Defaults are
    transformers' generic ones; families override them with their own."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int = bounded(1, 1 << 14)
    num_experts_per_tok: int = 8
    n_shared_experts: int = bounded(0, 1 << 8, default=1)
    n_group: int = bounded(1, 1 << 10, default=1)
    topk_group: int = bounded(1, 1 << 10, default=1)
    routed_scaling_factor: float = bounded(0.0, 1e6, default=1.0)
    norm_topk_prob: bool = True
    first_k_dense_replace: int = bounded(0, 1 << 10, default=1)
    mlp_layer_types: list | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1

    def validate(self, source):
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
            raise UnsupportedModelError(
                f"{source}: router scoring_func {self.scoring_func!r} / topk_method {self.topk_method!r} is not supported; "
                "only DeepSeek-V3's sigmoid 'noaux_tc' router is (DeepSeek-V2's softmax routers are not)")
        if self.moe_layer_freq != 1:
            raise UnsupportedModelError(f"{source}: moe_layer_freq {self.moe_layer_freq} is not supported (only 1)")
        experts, group = self.n_routed_experts, self.n_group
        if experts % group:
            raise ModelFormatError(f"{source}: n_routed_experts {experts} is not divisible by n_group {group}")
        if self.topk_group > group:
            raise ModelFormatError(f"{source}: topk_group {self.topk_group} exceeds n_group {group}")
        if group > 1 and experts // group < 2:
            raise ModelFormatError(f"{source}: groups of one expert cannot be scored (n_routed_experts {experts}, n_group {group})")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * (experts // group):
            raise ModelFormatError(f"{source}: num_experts_per_tok {self.num_experts_per_tok} must be within 1.."
                                   f"{self.topk_group * (experts // group)} (the experts of topk_group groups)")
        kinds = self.mlp_layer_types
        if kinds is not None and (len(kinds) != self.num_hidden_layers or not set(kinds) <= {"dense", "sparse"}):
            raise ModelFormatError(f"{source}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                                   f"{self.num_hidden_layers} layers, got {kinds!r}")

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the MoE (else a dense SwiGLU)."""
        return layer >= self.first_k_dense_replace


@dataclass(kw_only=True)
class MLAArgs(SigmoidMoEArgs):
    """Multi-head latent attention fields (DeepSeek-V3 naming)."""

    kv_lora_rank: int = bounded(1, 1 << 14)
    qk_rope_head_dim: int = bounded(2, 1 << 12)
    qk_nope_head_dim: int = bounded(1, 1 << 12)
    v_head_dim: int = bounded(1, 1 << 12)
    q_lora_rank: int | None = bounded(1, 1 << 16, default=None)
    num_key_value_heads: int | None = None
    rope_interleave: bool = True

    def validate(self, source):
        heads = self.num_attention_heads
        if self.num_key_value_heads not in (None, heads):
            raise ModelFormatError(f"{source}: MLA expands the latent into all {heads} heads; num_key_value_heads "
                                   f"{self.num_key_value_heads} must equal num_attention_heads")
        super().validate(source)


@dataclass(kw_only=True)
class DSAArgs(MLAArgs):
    """MLA plus the DSA lightning indexer (DeepSeek-V3.2 naming). Dense layers come from
    ``mlp_layer_types`` when given, else the first ``first_k_dense_replace`` layers."""

    index_topk: int = bounded(1, 1 << 24, default=2048)
    index_head_dim: int = bounded(1, 1 << 12, default=128)
    index_n_heads: int = bounded(1, 1 << 10, default=64)

    def validate(self, source):
        super().validate(source)
        if self.q_lora_rank is None:
            raise ModelFormatError(f"{source}: DSA needs q_lora_rank (the indexer reads the q LoRA activation)")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ModelFormatError(f"{source}: qk_rope_head_dim {self.qk_rope_head_dim} exceeds index_head_dim {self.index_head_dim}")

    def is_moe(self, layer: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer] == "sparse"
        return layer >= min(self.first_k_dense_replace, self.num_hidden_layers)

    def shared_indexer(self, layer: int) -> bool:
        """Whether ``layer`` reuses the previous full indexer's selection (GLM-5) instead
        of running its own indexer. DeepSeek-V3.2: never."""
        return False


@dataclass(kw_only=True)
class DeepseekV3Args(MLAArgs):
    """DeepSeek-V3's defaults (transformers' DeepseekV3Config) on the shared MLA fields;
    Kimi K2's text model is this architecture too."""

    n_group: int = bounded(1, 1 << 10, default=8)
    topk_group: int = bounded(1, 1 << 10, default=4)
    routed_scaling_factor: float = bounded(0.0, 1e6, default=2.5)
    first_k_dense_replace: int = bounded(0, 1 << 10, default=3)


def softmax_moe(w, layer: int, p: str, n_experts: int, top_k: int, norm_topk_prob: bool, hidden: int, inner: int,
                **shared) -> SparseMoE:
    """The softmax top-k MoE at ``p`` (OLMoE, Qwen): ``gate`` and routed experts
    ``experts`` streamed by the store; ``shared`` (``shared``, ``shared_gate``) goes to
    ``SparseMoE``."""
    router = SoftmaxTopKRouter(w.linear(f"{p}.gate", n_experts, hidden), top_k, norm_topk_prob)
    return SparseMoE(router, w.swiglu_experts(layer, f"{p}.experts", n_experts, hidden, inner), **shared)


def sigmoid_moe(a: SigmoidMoEArgs, w, layer: int, p: str, activation=None) -> SparseMoE:
    """The MoE block at ``p``: ``gate`` (+ ``gate.e_score_correction_bias``), routed
    experts ``experts`` streamed by the store (per expert or fused, as
    ``Weights.swiglu_experts`` reads them), ``shared_experts``; ``activation``: the
    experts' (routed and shared) ``GatedActivation``, SiLU-SwiGLU when None."""
    hidden, inner, n = a.hidden_size, a.moe_intermediate_size, a.n_routed_experts
    experts = w.swiglu_experts(layer, f"{p}.experts", n, hidden, inner, activation)
    router = SigmoidGroupedTopKRouter(
        w.linear(f"{p}.gate", n, hidden), a.num_experts_per_tok, bias=w.optional(f"{p}.gate.e_score_correction_bias", (n,)),
        n_group=a.n_group, topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob,
        routed_scaling_factor=a.routed_scaling_factor)
    shared = w.swiglu(f"{p}.shared_experts", hidden, inner * a.n_shared_experts, activation) if a.n_shared_experts else None
    return SparseMoE(router, experts, shared=shared)


def lightning_indexer(a: DSAArgs, w, p: str, rope: RoPE, *, rope_interleave: bool) -> LightningIndexer:
    """The DSA indexer at ``p`` (``wq_b``, ``wk``, ``k_norm`` with bias, ``weights_proj``)."""
    d = a.index_head_dim
    return LightningIndexer(
        wq_b=w.linear(f"{p}.wq_b", a.index_n_heads * d, a.q_lora_rank), wk=w.linear(f"{p}.wk", d, a.hidden_size),
        k_norm=LayerNorm(w.param(f"{p}.k_norm.weight", (d,)), w.param(f"{p}.k_norm.bias", (d,)), LATENT_NORM_EPS),
        weights_proj=w.linear(f"{p}.weights_proj", a.index_n_heads, a.hidden_size), n_heads=a.index_n_heads,
        head_dim=d, rope_dim=a.qk_rope_head_dim, rope=rope, topk=a.index_topk, rope_interleave=rope_interleave)


def mla_attention(a: MLAArgs, w, layer: int, s: str, rope: RoPE, scale: float, *, interleave: bool,
                  indexer=None) -> MLAttention:
    """MLA at ``s`` (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``)."""
    hidden, heads, bias = a.hidden_size, a.num_attention_heads, a.attention_bias
    dn, dr, dv, rank = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    if a.q_lora_rank is None:
        q = dict(q=w.linear(f"{s}.q_proj", heads * (dn + dr), hidden))
    else:
        q = dict(q_a=w.linear(f"{s}.q_a_proj", a.q_lora_rank, hidden, bias=bias),
                 q_a_norm=w.rms_norm(f"{s}.q_a_layernorm", a.q_lora_rank, LATENT_NORM_EPS),
                 q_b=w.linear(f"{s}.q_b_proj", heads * (dn + dr), a.q_lora_rank))
    return MLAttention(
        layer=layer, **q,
        kv_a=w.linear(f"{s}.kv_a_proj_with_mqa", rank + dr, hidden, bias=bias),
        kv_a_norm=w.rms_norm(f"{s}.kv_a_layernorm", rank, LATENT_NORM_EPS),
        kv_b=w.linear(f"{s}.kv_b_proj", heads * (dn + dv), rank),
        o=w.linear(f"{s}.o_proj", hidden, heads * dv, bias=bias),
        n_heads=heads, kv_lora_rank=rank, nope_dim=dn, rope_dim=dr, v_dim=dv, rope=rope, scale=scale,
        rope_interleave=interleave, indexer=indexer,
    )


def sigmoid_moe_mlp(a: SigmoidMoEArgs, w, activation=None) -> LayerBlock:
    """The MLP of each layer at ``prefix.mlp``: ``sigmoid_moe`` where ``a.is_moe(i)``,
    else a dense SwiGLU of ``intermediate_size``; ``activation``: all their
    ``GatedActivation`` (SiLU-SwiGLU when None)."""

    def mlp(i: int, prefix: str):
        p = f"{prefix}.mlp"
        if a.is_moe(i):
            return sigmoid_moe(a, w, i, p, activation)
        return w.swiglu(p, a.hidden_size, a.intermediate_size, activation)

    return mlp


def mla_mixer(a: MLAArgs, config: dict, w, *, interleave: bool | None = None,
              indexer_interleave: bool = False) -> LayerBlock:
    """MLA at ``prefix.self_attn`` in every layer (``interleave``: interleaved-pair rope,
    default ``a.rope_interleave``); with ``DSAArgs``, a lightning indexer per layer
    (``indexer_interleave``: rotate its rope features as interleaved pairs) or, where
    ``a.shared_indexer(i)``, the previous full indexer's selection."""
    src = w.config_source
    dr = a.qk_rope_head_dim
    rope = build_rope(config, dr, src)
    scale = mla_softmax_scale(config, a.qk_nope_head_dim + dr, src)
    interleave = a.rope_interleave if interleave is None else interleave

    def attention(i: int, prefix: str) -> MLAttention:
        s = f"{prefix}.self_attn"
        indexer = None
        if isinstance(a, DSAArgs):
            indexer = SharedIndexer() if a.shared_indexer(i) else lightning_indexer(
                a, w, f"{s}.indexer", rope, rope_interleave=indexer_interleave)
        return mla_attention(a, w, i, s, rope, scale, interleave=interleave, indexer=indexer)

    return attention


def kda(w, layer: int, s: str, *, heads: int, head_dim: int, hidden: int, conv_kernel: int, eps: float,
        a_log_shape: tuple[int, ...], gate_lower_bound: float | None = None) -> GatedDeltaNet:
    """Kimi Delta Attention at ``s`` (Kimi Linear, GLM-5 Next): a GatedDeltaNet with a
    per-channel decay, read as saved (``q_conv1d``.., the forget gate beside the
    projections) or in transformers' memory layout (``conv1d`` stacking q, k, v;
    ``forget_gate.*``). ``a_log_shape``: how the family stores A_log (h values)."""
    h, d = heads, head_dim
    dim = h * d
    gate = f"{s}.forget_gate" if w.has(f"{s}.forget_gate.A_log") else s
    if w.has(f"{s}.conv1d.weight"):
        conv = w.param(f"{s}.conv1d.weight", (3 * dim, 1, conv_kernel), conv_weight_2d)
    else:
        conv = [w.param(f"{s}.{part}_conv1d.weight", (dim, 1, conv_kernel), conv_weight_2d) for part in "qkv"]
    projections = [
        w.linear(f"{s}.q_proj", dim, hidden), w.linear(f"{s}.k_proj", dim, hidden), w.linear(f"{s}.v_proj", dim, hidden),
        LowRank(w.linear(f"{s}.g_a_proj", d, hidden), w.linear(f"{s}.g_b_proj", dim, d)),  # z: the output gate
        w.linear(f"{s}.b_proj", h, hidden),  # beta
        LowRank(w.linear(f"{gate}.f_a_proj", d, hidden), w.linear(f"{gate}.f_b_proj", dim, d)),  # a: the decay
    ]
    return GatedDeltaNet(
        layer=layer, projections=projections, conv_weight=conv,
        a_neg=w.param(f"{gate}.A_log", a_log_shape, neg_exp_flat), dt_bias=w.param(f"{gate}.dt_bias", (dim,)),
        norm=GatedRMSNorm(w.param(f"{s}.o_norm.weight", (d,)), eps, activation="sigmoid"),
        out=w.linear(f"{s}.o_proj", hidden, dim),
        n_k_heads=h, n_v_heads=h, k_head_dim=d, v_head_dim=d, chunk_size=CHUNK_SIZE, gate_per_channel=True,
        gate_lower_bound=gate_lower_bound)


def mamba2(w, layer: int, s: str, *, hidden: int, heads: int, head_dim: int, groups: int, state_size: int,
           conv_kernel: int, eps: float, chunk_size: int, conv_bias: bool, proj_bias: bool,
           dt_limit: tuple[float, float]) -> Mamba2Mixer:
    """A Mamba-2 mixer at ``s`` under transformers' names (Nemotron-H's ``mixer``, Granite
    4's ``mamba``): ``in_proj``, ``conv1d`` (C, 1, K), ``dt_bias``, ``A_log``, ``D``, the
    gated norm ``norm``, ``out_proj``; ``proj_bias``: in_proj and out_proj have biases."""
    inner, conv_dim = heads * head_dim, heads * head_dim + 2 * groups * state_size
    return Mamba2Mixer(
        layer=layer, in_proj=w.linear(f"{s}.in_proj", inner + conv_dim + heads, hidden, bias=proj_bias),
        conv_weight=w.param(f"{s}.conv1d.weight", (conv_dim, 1, conv_kernel), conv_weight_2d),
        conv_bias=w.param(f"{s}.conv1d.bias", (conv_dim,)) if conv_bias else None,
        dt_bias=w.param(f"{s}.dt_bias", (heads,)), a_neg=w.param(f"{s}.A_log", (heads,), neg_exp_flat),
        d=w.param(f"{s}.D", (heads,)), norm_weight=w.param(f"{s}.norm.weight", (inner,)),
        out_proj=w.linear(f"{s}.out_proj", hidden, inner, bias=proj_bias), n_heads=heads, head_dim=head_dim,
        n_groups=groups, state_size=state_size, eps=eps, chunk_size=chunk_size, dt_limit=dt_limit)


class MLAMoEFamily(Family):
    """A family whose layers are MLA (``mla_mixer``) then the sigmoid-routed MoE
    (``sigmoid_moe_mlp``) on ``build_decoder``: DeepSeek-V3 and V3.2, GLM-4.7-Flash,
    GLM-5. A subclass names its config class (``args``) and, where its rope differs,
    ``mla_mixer``'s options (``mixer_options``)."""

    args: type = DeepseekV3Args
    mixer_options: dict = {}

    def build(self, config, w):
        a = self.args.from_dict(config, w.config_source)
        return build_decoder(a, w, mla_mixer(a, config, w, **self.mixer_options), sigmoid_moe_mlp(a, w))

"""GLM-5 Next (model_type ``glm5_next``; transformers: models/glm5_next, its text model).

A hybrid on colibri's shared blocks:

- ``layer_types``: "linear_attention" layers are Kimi Delta Attention (``GatedDeltaNet``
  with a per-channel decay) whose decay is bounded below (``linear_lower_bound``:
  g = lb * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)); softplus as in KDA when null),
  short q/k/v convolutions, sigmoid-gated output norm; "indexed_attention" layers are
  NoPE MLA (``qk_rope_head_dim`` 0) with GLM-5 Next's pooled DSA indexer
  (``nn.dsa.PooledIndexer``: ``index_kpool`` tokens per pool, the incomplete last pool
  always attended) or, where ``indexer_types`` says "shared", the previous layer's
  selection;
- MLPs: ``mlp_layer_types`` (3 dense layers first by default), DeepSeek-V3's sigmoid
  router, SwiGLU with gate and up clamped at ``swiglu_limit`` (dense, routed and shared);
- manifold hyper-connections (``nn.hyper``): ``hc_mult`` residual streams, collapsed by
  their mean before the final norm.

Only the text model runs; the vision tower is never read, and prompts holding the image
or video placeholder are refused (without media transformers embeds a generated
placeholder as its own row, as colibri does).
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.compute.backend import GatedActivation
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import bounded
from colibri_core.model.family import Family
from colibri_core.nn import Linear, MLAttention
from colibri_core.nn.assembly import Names, build_decoder
from colibri_core.model.builders import SigmoidMoEArgs, kda, sigmoid_moe_mlp
from colibri_core.nn.dsa import LayerNorm, PooledIndexer, SharedIndexer
from colibri_core.nn.hyper import HyperHead, hyper_connection

from colibri_glm.model import indexer_kinds

INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm: nn.LayerNorm(eps=1e-6)
MEDIA_TOKENS = {"image_token_id": "image", "video_token_id": "video"}
LINEAR_ATTN_CONFIG = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                      "short_conv_kernel_size": "linear_conv_kernel_dim"}


@dataclass(kw_only=True)
class Glm5NextArgs(SigmoidMoEArgs):
    """Glm5NextTextConfig's fields (its defaults); ``validate`` derives the per-layer
    schedules as transformers' ``__post_init__`` does."""

    n_routed_experts: int = bounded(1, 1 << 14, default=288)
    routed_scaling_factor: float = bounded(0.0, 1e6, default=2.5)
    num_key_value_heads: int | None = None
    kv_lora_rank: int = bounded(1, 1 << 14, default=512)
    q_lora_rank: int | None = bounded(1, 1 << 16, default=1536)
    qk_rope_head_dim: int = bounded(0, 1 << 12, default=0)
    qk_nope_head_dim: int = bounded(1, 1 << 12, default=256)
    v_head_dim: int = bounded(1, 1 << 12, default=256)
    index_topk: int = bounded(1, 1 << 24, default=2048)
    index_head_dim: int = bounded(1, 1 << 12, default=128)
    index_n_heads: int = bounded(1, 1 << 10, default=32)
    index_kpool: int = bounded(1, 1 << 12, default=16)
    index_kpool_always_select_tail: bool = True
    layer_types: list | None = None
    indexer_types: list | None = None
    index_topk_pattern: str | list | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    swiglu_limit: float = bounded(0.0, 1e9, default=10.0)
    linear_head_dim: int = bounded(1, 1 << 12, default=128)
    linear_num_heads: int = bounded(1, 1 << 12, default=64)
    linear_conv_kernel_dim: int = bounded(1, 1 << 8, default=4)
    hc_mult: int = bounded(1, 64, default=4)
    hc_eps: float = bounded(0.0, 1.0, default=1e-6)
    hc_sinkhorn_iters: int = bounded(1, 1 << 10, default=20)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576

    def validate(self, source):
        super().validate(source)
        n, heads = self.num_hidden_layers, self.num_attention_heads
        if self.num_key_value_heads not in (None, heads):
            raise ModelFormatError(f"{source}: num_key_value_heads {self.num_key_value_heads} must equal "
                                   f"num_attention_heads {heads} (MLA)")
        if self.qk_rope_head_dim:
            raise UnsupportedModelError(f"{source}: qk_rope_head_dim {self.qk_rope_head_dim}: GLM-5 Next's attention "
                                        "is NoPE (transformers requires 0)")
        if self.q_lora_rank is None:
            raise ModelFormatError(f"{source}: q_lora_rank is required (the DSA indexer reads the q LoRA activation)")
        if self.index_topk % self.index_kpool:
            raise ModelFormatError(f"{source}: index_topk {self.index_topk} is not divisible by index_kpool {self.index_kpool}")
        if not self.index_kpool_always_select_tail:
            raise UnsupportedModelError(f"{source}: index_kpool_always_select_tail false is not supported (queries "
                                        "would not see their own incomplete pool)")
        kinds = self.layer_types
        if kinds is None:
            kinds = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
        kinds = ["indexed_attention" if k == "full_attention" else k for k in kinds]
        if len(kinds) != n or not set(kinds) <= {"linear_attention", "indexed_attention"}:
            raise ModelFormatError(f"{source}: layer_types must give 'linear_attention' or 'indexed_attention' for each "
                                   f"of the {n} layers, got {self.layer_types!r}")
        self.layer_types = kinds
        mlp = self.mlp_layer_types
        if mlp is None:
            mlp = ["dense"] * min(3, n) + ["sparse"] * (n - min(3, n))
        if len(mlp) != n or not set(mlp) <= {"dense", "sparse"}:
            raise ModelFormatError(f"{source}: mlp_layer_types must list 'dense' or 'sparse' for each of the {n} layers, "
                                   f"got {self.mlp_layer_types!r}")
        self.mlp_layer_types = mlp
        self.indexer_types = indexer_kinds(self, source)
        for i, kind in enumerate(self.indexer_types):
            if self.layer_types[i] == "indexed_attention" and kind == "shared" and (
                    i == 0 or self.layer_types[i - 1] != "indexed_attention" or self.indexer_types[i - 1] != "full"):
                raise ModelFormatError(f"{source}: indexer_types: layer {i} is 'shared' but layer {i - 1} is not a full "
                                       "indexed-attention layer (transformers hands a shared layer the selection of the "
                                       "layer right before it)")

    def is_moe(self, layer):
        return self.mlp_layer_types[layer] == "sparse"


class Glm5Next(Family):
    name = "glm5-next"

    def build(self, config, w):
        src = w.config_source
        text = config.get("text_config")
        if text is None:  # a flat (text-only) checkpoint: the text fields at the top level
            text, where = config, src
        elif not isinstance(text, dict):
            raise ModelFormatError(f"{src}: text_config must be an object")
        else:
            where = f"{src}: text_config"
        a = Glm5NextArgs.from_dict(text, where)
        lower = _lower_bound(text, a, where)
        if "tie_word_embeddings" in config:  # transformers ties by the top-level flag
            a.tie_word_embeddings = bool(config["tie_word_embeddings"])
        prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in w.checkpoint else "model."
        names = Names(model=prefix)
        hidden = a.hidden_size

        def mixer(i, p):
            s = f"{p}.self_attn"
            return _kda(a, w, i, s, lower) if a.layer_types[i] == "linear_attention" else _attention(a, w, i, s)

        hc = dict(hidden=hidden, n_streams=a.hc_mult, sinkhorn_iters=a.hc_sinkhorn_iters, eps=a.hc_eps,
                  norm_eps=a.rms_norm_eps)

        def hyper(i, p):
            return hyper_connection(w, p, "attn", **hc), hyper_connection(w, p, "ffn", **hc)

        # the text model is all colibri runs: a prompt holding a media placeholder is refused
        refused = {config[key]: f"GLM-5 Next's {what} placeholder: colibri runs the text model only; image and video "
                                "input are not supported" for key, what in MEDIA_TOKENS.items() if isinstance(config.get(key), int)}
        return build_decoder(a, w, mixer, sigmoid_moe_mlp(a, w, GatedActivation(limit=a.swiglu_limit)), names,
                             refused_tokens=refused, hyper=hyper, hyper_head=HyperHead(a.hc_mult))


def _lower_bound(text: dict, a: Glm5NextArgs, source) -> float | None:
    """``linear_lower_bound`` as transformers reads it: null means the softplus decay;
    ``linear_attn_config`` (Kimi's spelling) overrides it and the head sizes."""
    lower = text.get("linear_lower_bound", -5.0)
    extra = text.get("linear_attn_config")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ModelFormatError(f"{source}: linear_attn_config must be an object")
        for key, field in LINEAR_ATTN_CONFIG.items():
            if key in extra:
                value = extra[key]
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ModelFormatError(f"{source}: linear_attn_config.{key} must be a positive integer, got {value!r}")
                setattr(a, field, value)
        lower = extra.get("gate_lower_bound", lower)
        if extra.get("safe_gate", True) and lower is None:
            lower = -5.0
    if lower is not None and (isinstance(lower, bool) or not isinstance(lower, (int, float))):
        raise ModelFormatError(f"{source}: linear_lower_bound must be a number or null, got {lower!r}")
    return None if lower is None else float(lower)


def _kda(a: Glm5NextArgs, w, layer: int, s: str, lower: float | None):
    return kda(w, layer, s, heads=a.linear_num_heads, head_dim=a.linear_head_dim, hidden=a.hidden_size,
               conv_kernel=a.linear_conv_kernel_dim, eps=a.rms_norm_eps, a_log_shape=(a.linear_num_heads,),
               gate_lower_bound=lower)


def _attention(a: Glm5NextArgs, w, layer: int, s: str) -> MLAttention:
    """NoPE MLA at ``s`` with its pooled indexer (or the previous layer's selection). Its
    latent norms use ``rms_norm_eps`` (DeepSeek's use 1e-6)."""
    hidden, heads, bias, eps = a.hidden_size, a.num_attention_heads, a.attention_bias, a.rms_norm_eps
    dn, dv, rank, qr = a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank, a.q_lora_rank
    if a.indexer_types[layer] == "shared":
        indexer = SharedIndexer()
    else:
        p, d = f"{s}.indexer", a.index_head_dim
        gate = w.param(f"{p}.index_kpool_compress_gate", (d, hidden))
        gate.role = "linear"
        indexer = PooledIndexer(
            wq_b=w.linear(f"{p}.wq_b", a.index_n_heads * d, qr), wk=w.linear(f"{p}.wk", d, hidden),
            k_norm=LayerNorm(w.param(f"{p}.k_norm.weight", (d,)), w.param(f"{p}.k_norm.bias", (d,)), INDEXER_NORM_EPS),
            weights_proj=w.linear(f"{p}.weights_proj", a.index_n_heads, hidden), compress_gate=Linear(gate),
            compress_ape=w.param(f"{p}.index_kpool_compress_ape", (a.index_kpool, d)), n_heads=a.index_n_heads,
            head_dim=d, topk=a.index_topk, pool=a.index_kpool)
    return MLAttention(
        layer=layer, q_a=w.linear(f"{s}.q_a_proj", qr, hidden, bias=bias), q_a_norm=w.rms_norm(f"{s}.q_a_layernorm", qr, eps),
        q_b=w.linear(f"{s}.q_b_proj", heads * dn, qr), kv_a=w.linear(f"{s}.kv_a_proj_with_mqa", rank, hidden, bias=bias),
        kv_a_norm=w.rms_norm(f"{s}.kv_a_layernorm", rank, eps), kv_b=w.linear(f"{s}.kv_b_proj", heads * (dn + dv), rank),
        o=w.linear(f"{s}.o_proj", hidden, heads * dv, bias=bias), n_heads=heads, kv_lora_rank=rank, nope_dim=dn,
        rope_dim=0, v_dim=dv, rope=None, scale=dn**-0.5, indexer=indexer)

"""DeepSeek-V4 on colibri's shared blocks (transformers: models/deepseek_v4).

The blocks are colibri_core's: the attention with its sliding window, sinks, HCA / CSA
compressors, indexer and grouped output projection (``nn.compressed``), the
hyper-connections (``nn.hyper``), the sqrt-softplus and hash routers (``nn.routers``),
the clamped SwiGLU (``GatedActivation``) and the decoder assembly. This file reads the
config (with transformers' defaults and its legacy spellings) and declares the tensors
under the names transformers 5.23 saves them (the original checkpoints' spelling:
``attn.wq_a``, ``ffn.experts.{e}.w1``, ``hc_attn_fn``, ``head``...). DeepSeek's published
shards spell a few differently (no ``model.`` prefix, ``embed``, ``hc_head_fn``,
``attn.kv_norm``) and store the weights in fp8 / fp4 with ``<m>.scale`` (formats
``fp8-e4m3-b128`` and ``fp4-e2m1-g32``); both layouts are read.

The multi-token-prediction layers (``load(mtp=True)``; ``nn.mtp.DEEPSEEK_V4_MTP``) are
read as vLLM's ``deepseek_v4_mtp`` and DeepSeek's ``inference/model.py`` (``MTPBlock``)
build them: ``mtp.{j}.`` in DeepSeek's spelling (transformers drops them on load),
``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``hc_head_{fn,base,scale}`` and ``norm``
around a V4 block of layer number ``num_hidden_layers + j`` whose attention is a sliding
layer's (no compressor: vLLM gives MTP layers compress ratio 1, DeepSeek's configs 0)
and whose MoE is routed by scores (hash routing is for layers below the hash layers'
count). The layer reads the main model's streams before ``hc_head``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_core.compute.backend import GatedActivation
from colibri_core.compute.host import ROUTER_SCORINGS
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs, bounded
from colibri_core.model.family import Family
from colibri_core.nn.assembly import Names, build_decoder
from colibri_core.nn.compressed import (CompressedAttention, CompressedIndexer, WindowCompressor, permute_columns,
                                        permute_rows, rope_first)
from colibri_core.nn.hyper import HeadNorm, HyperDecoderLayer, hyper_connection, hyper_head
from colibri_core.nn.layers import Embedding, Linear, RMSNorm, RoutedExperts, SparseMoE, SwiGLU
from colibri_core.nn.mtp import DEEPSEEK_V4_MTP, StreamMTPLayer
from colibri_core.nn.rope import build_rope
from colibri_core.nn.routers import HashRouter, ScoredTopKRouter

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # legacy per-layer compress_ratios
FP8_BLOCK = 128  # the rows one fp8 block scale covers in DeepSeek's checkpoints


def head_order(dim: int, rope_dim: int) -> np.ndarray:
    """colibri's channel order of a V4 head (``rope_first``: its last ``rope_dim`` channels,
    de-interleaved, first), with the other channels ordered so that each 128-row block
    of a projection permuted by it is one stored block: the rest of the rope channels'
    block, then the blocks before it. An fp8 projection then keeps its block scales and
    stays packed (``formats.base.permute_rows``); dot products and norms do not depend
    on the order of the channels that are not rotated."""
    order = rope_first(dim, rope_dim)
    if dim % FP8_BLOCK or rope_dim > FP8_BLOCK:
        return order  # whole heads per block (any order keeps blocks whole), or rope wider than a block
    start = dim - FP8_BLOCK
    return np.concatenate([order[:rope_dim], np.arange(start, dim - rope_dim), np.arange(start)])


def rows_of(order: np.ndarray, blocks: int) -> np.ndarray:
    """The row order of ``blocks`` stacked heads (or series), each in ``order``."""
    return np.concatenate([b * len(order) + order for b in range(blocks)])


@dataclass(kw_only=True)
class DeepseekV4Args(ModelArgs):
    """transformers' DeepseekV4Config fields and defaults (V4-Flash's)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = bounded(2, 1 << 12, default=512)
    q_lora_rank: int = bounded(1, 1 << 16, default=1024)
    num_experts_per_tok: int = bounded(1, 1 << 10, default=6)
    n_routed_experts: int = bounded(1, 1 << 14, default=256)
    n_shared_experts: int = bounded(0, 1 << 8, default=1)
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = bounded(0.0, 1e6, default=1.5)
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    layer_types: list | None = None
    compress_rates: dict | None = None
    compress_rope_theta: float = 160000.0
    hc_mult: int = bounded(1, 64, default=4)
    hc_sinkhorn_iters: int = bounded(1, 1000, default=20)
    hc_eps: float = bounded(0.0, 1.0, default=1e-6)
    mlp_layer_types: list | None = None
    swiglu_limit: float = bounded(0.0, 1e9, default=10.0)
    sliding_window: int = bounded(1, 1 << 24, default=128)
    o_groups: int = bounded(1, 1 << 10, default=8)
    o_lora_rank: int = bounded(1, 1 << 16, default=1024)
    index_n_heads: int = bounded(1, 1 << 10, default=64)
    index_head_dim: int = bounded(2, 1 << 12, default=128)
    index_topk: int = bounded(1, 1 << 24, default=512)
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    partial_rotary_factor: float | None = bounded(0.0, 1.0, default=None)
    mlp_bias: bool = False
    # legacy spellings transformers folds in (older V4 configs)
    compress_ratios: list | None = None
    compress_rate_csa: int | None = bounded(1, 1 << 16, default=None)
    compress_rate_hca: int | None = bounded(1, 1 << 16, default=None)
    num_hash_layers: int | None = bounded(0, 1 << 10, default=None)
    qk_rope_head_dim: int | None = bounded(2, 1 << 12, default=None)

    def validate(self, source):
        n = self.num_hidden_layers
        if self.num_key_value_heads != 1:
            raise UnsupportedModelError(f"{source}: num_key_value_heads {self.num_key_value_heads} is not supported "
                                        "(DeepSeek-V4's attention has one shared KV head)")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.scoring_func not in ROUTER_SCORINGS:
            raise UnsupportedModelError(f"{source}: scoring_func {self.scoring_func!r} is not supported "
                                        f"(supported: {', '.join(ROUTER_SCORINGS)})")
        rates = dict(self.compress_rates or {CSA: 4, HCA: 128})
        if self.compress_rate_csa is not None:
            rates[CSA] = self.compress_rate_csa
        if self.compress_rate_hca is not None:
            rates[HCA] = self.compress_rate_hca
        for kind in (CSA, HCA):
            rate = rates.get(kind)
            if isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= 1 << 16:
                raise ModelFormatError(f"{source}: compress_rates[{kind!r}] must be an integer in 1..65536, got {rate!r}")
        self.compress_rates = rates
        kinds = self.layer_types
        if kinds is None and self.compress_ratios is not None:
            bad = [r for r in self.compress_ratios if r not in RATIO_TYPES]
            if bad:
                raise ModelFormatError(f"{source}: compress_ratios entries must be 0, 4 or 128, got {bad[0]!r}")
            kinds = [RATIO_TYPES[r] for r in self.compress_ratios]
        if kinds is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
            kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        kinds = list(kinds[:n])
        if len(kinds) != n or not set(kinds) <= set(LAYER_TYPES):
            raise ModelFormatError(f"{source}: layer_types must list one of {', '.join(LAYER_TYPES)} for each of the "
                                   f"{n} layers, got {self.layer_types!r}")
        self.layer_types = kinds
        mlps = self.mlp_layer_types
        if mlps is None:
            hashed = 3 if self.num_hash_layers is None else self.num_hash_layers
            mlps = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        mlps = list(mlps[:n])
        if len(mlps) != n or not set(mlps) <= {"hash_moe", "moe"}:
            raise ModelFormatError(f"{source}: mlp_layer_types must list 'hash_moe' or 'moe' for each of the {n} layers, "
                                   f"got {self.mlp_layer_types!r}")
        self.mlp_layer_types = mlps
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = (self.qk_rope_head_dim / self.head_dim if self.qk_rope_head_dim is not None
                                          else 64 / 512)
        rope_dim = int(self.head_dim * self.partial_rotary_factor)
        if rope_dim < 2 or rope_dim % 2:
            raise ModelFormatError(f"{source}: the rotary dimension {rope_dim} (head_dim {self.head_dim} x "
                                   f"partial_rotary_factor {self.partial_rotary_factor}) must be even and at least 2")
        if CSA in kinds and rope_dim > self.index_head_dim:
            raise ModelFormatError(f"{source}: the rotary dimension {rope_dim} exceeds index_head_dim {self.index_head_dim}")
        self.rope_dim = rope_dim
        if self.num_attention_heads % self.o_groups:
            raise ModelFormatError(f"{source}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                                   f"o_groups {self.o_groups}")
        self.require_at_most(source, "num_experts_per_tok", "n_routed_experts")

    def rope_settings(self, source) -> dict[str, dict]:
        """{"main": ..., "compress": ...} rope parameters, as transformers derives them."""
        params = self.rope_parameters or {}
        if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
            return {"main": dict(params["main"]), "compress": dict(params["compress"])}
        scaling = {k: v for k, v in params.items() if k not in ("main", "compress")}
        compress = {**scaling, "rope_theta": self.compress_rope_theta}
        compress.setdefault("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":  # V4 does not scale cos / sin by yarn's mscale
            compress.setdefault("attention_factor", 1.0)
        return {"main": {"rope_type": "default", "rope_theta": self.rope_theta}, "compress": compress}


class DeepseekV4(Family):
    name = "deepseek-v4"

    def build(self, config, w):
        a = DeepseekV4Args.from_dict(config, w.config_source)
        src = w.config_source
        ropes = {kind: build_rope({"rope_parameters": p, "max_position_embeddings": a.max_position_embeddings},
                                  a.head_dim, src, partial_rotary_factor=a.partial_rotary_factor)
                 for kind, p in a.rope_settings(src).items()}
        hidden, eps, rd = a.hidden_size, a.rms_norm_eps, a.rope_dim
        d, di, heads = a.head_dim, a.index_head_dim, a.num_attention_heads
        heads_order, index_order = head_order(d, rd), head_order(di, rd)

        def linear(name, out, inp, rows=None):
            # rows: the output channels reordered at load, the weight still packed (Param.row_order)
            p = w.param(f"{name}.weight", (out, inp), row_order=rows)
            p.role = "linear"
            return Linear(p)

        def norm(name, dim, transform=None):
            return RMSNorm(w.param(f"{name}.weight", (dim,), transform), eps)

        def compressor(p, dim, order, rate, overlap, rope):
            series = 2 if overlap else 1
            return WindowCompressor(
                kv=linear(f"{p}.wkv", series * dim, hidden, rows_of(order, series)),
                gate=linear(f"{p}.wgate", series * dim, hidden, rows_of(order, series)),
                bias=w.param(f"{p}.ape", (rate, series * dim), permute_columns(order)),
                norm=norm(f"{p}.norm", dim, permute_rows(order, 1)), dim=dim, rate=rate, overlap=overlap, rope=rope)

        def kv_norm_name(s):
            # transformers saves "attn.norm"; DeepSeek's shards name it "attn.kv_norm"
            if not w.has(f"{s}.norm.weight") and w.has(f"{s}.kv_norm.weight"):
                return f"{s}.kv_norm"
            return f"{s}.norm"

        def mixer(i, prefix):
            s = f"{prefix}.attn"
            kind = a.layer_types[i] if i < a.num_hidden_layers else SLIDING  # an MTP layer's: sliding
            rope = ropes["main" if kind == SLIDING else "compress"]
            comp = index = None
            if kind != SLIDING:
                rate = a.compress_rates[kind]
                comp = compressor(f"{s}.compressor", d, heads_order, rate, kind == CSA, rope)
                if kind == CSA:
                    index = CompressedIndexer(
                        compressor=compressor(f"{s}.indexer.compressor", di, index_order, rate, True, rope),
                        q_b=linear(f"{s}.indexer.wq_b", a.index_n_heads * di, a.q_lora_rank,
                                   rows_of(index_order, a.index_n_heads)),
                        weights_proj=linear(f"{s}.indexer.weights_proj", a.index_n_heads, hidden),
                        n_heads=a.index_n_heads, head_dim=di, topk=a.index_topk, rope=rope)
            group_in = heads * d // a.o_groups
            return CompressedAttention(
                layer=i, q_a=linear(f"{s}.wq_a", a.q_lora_rank, hidden), q_a_norm=norm(f"{s}.q_norm", a.q_lora_rank),
                q_b=linear(f"{s}.wq_b", heads * d, a.q_lora_rank, rows_of(heads_order, heads)),
                kv=linear(f"{s}.wkv", d, hidden, heads_order),
                kv_norm=norm(kv_norm_name(s), d, permute_rows(heads_order, 1)),
                o_a=w.param(f"{s}.wo_a.weight", (a.o_groups * a.o_lora_rank, group_in), permute_columns(heads_order)),
                o_b=linear(f"{s}.wo_b", hidden, a.o_groups * a.o_lora_rank), sinks=w.param(f"{s}.attn_sink", (heads,)),
                n_heads=heads, head_dim=d, rope=rope, window=a.sliding_window, o_groups=a.o_groups, eps=eps,
                compressor=comp, indexer=index)

        act = GatedActivation(limit=a.swiglu_limit)

        def mlp(i, prefix):
            p, inner, n = f"{prefix}.ffn", a.moe_intermediate_size, a.n_routed_experts
            experts = RoutedExperts(w.expert_layer(i, n, {
                "gate": (f"{p}.experts.{{e}}.w1.weight", (inner, hidden)),
                "up": (f"{p}.experts.{{e}}.w3.weight", (inner, hidden)),
                "down": (f"{p}.experts.{{e}}.w2.weight", (hidden, inner))}, activation=act))
            gate = linear(f"{p}.gate", n, hidden)
            if i < a.num_hidden_layers and a.mlp_layer_types[i] == "hash_moe":  # an MTP layer's: scored
                router = HashRouter(gate, w.param(f"{p}.gate.tid2eid", (a.vocab_size, a.num_experts_per_tok)),
                                    scoring=a.scoring_func, routed_scaling_factor=a.routed_scaling_factor)
            else:
                router = ScoredTopKRouter(gate, a.num_experts_per_tok, scoring=a.scoring_func,
                                          bias=w.optional(f"{p}.gate.bias", (n,)),
                                          routed_scaling_factor=a.routed_scaling_factor)
            # transformers' shared expert is one MLP of moe_intermediate_size, clamped too
            shared = SwiGLU(*(Linear(w.param(f"{p}.shared_experts.{k}.weight", shape),
                                     w.param(f"{p}.shared_experts.{k}.bias", shape[:1]) if a.mlp_bias else None)
                              for k, shape in (("w1", (inner, hidden)), ("w3", (inner, hidden)), ("w2", (hidden, inner)))),
                            act)
            for lin in (shared.gate, shared.up, shared.down):
                lin.weight.role = "linear"
            return SparseMoE(router, experts, shared=shared)

        hc = dict(hidden=hidden, n_streams=a.hc_mult, sinkhorn_iters=a.hc_sinkhorn_iters, eps=a.hc_eps, norm_eps=eps)
        names = Names(lm_head="head")
        if not w.has("model.embed_tokens.weight") and w.has("embed.weight"):
            # DeepSeek's published shards: no "model." prefix; "embed", "norm" and
            # "hc_head_{fn,base,scale}" at the top (transformers renames them at load)
            names = Names(model="", lm_head="head")
            w.aliases["embed_tokens.weight"] = "embed.weight"
        for i in range(a.num_hidden_layers):  # the layer norms under the checkpoint's names
            p = names.layer(i)
            w.aliases[f"{p}.input_layernorm.weight"] = f"{p}.attn_norm.weight"
            w.aliases[f"{p}.post_attention_layernorm.weight"] = f"{p}.ffn_norm.weight"

        def mtp(lm):
            """The MTP layers asked for (the first: ``inspect_model``), on the main model's
            streams before its hc_head, which the model then hands on (``hidden_before_norm``)."""
            layout, n = w.mtp_layout, a.num_hidden_layers
            if layout is not DEEPSEEK_V4_MTP:
                raise UnsupportedModelError(f"{src}: DeepSeek-V4's multi-token-prediction layers are read in their own "
                                            f"layout (mtp.{{j}}.), not {getattr(layout, 'name', layout)!r}")
            if a.compress_ratios is not None and len(a.compress_ratios) > n and a.compress_ratios[n] != 0:
                raise UnsupportedModelError(f"{src}: compress_ratios[{n}] = {a.compress_ratios[n]} gives the "
                                            "multi-token-prediction layer a compressor, which vLLM does not build "
                                            "(its attention is a sliding layer's); colibri reads it only so")
            embed, head = Embedding(lm.embed.weight, lm.embed.embedded_as), lm.lm_head
            lm.hidden_before_norm = True
            layers = []
            for j in range(w.mtp_layers):
                i = n + j
                own, p = layout.prefixes(names.layer(i), j)
                attn_norm, ffn_norm = layout.block_norms
                block = HyperDecoderLayer(hyper_connection(w, p, "attn", **hc), norm(f"{p}.{attn_norm}", hidden),
                                          mixer(i, p), hyper_connection(w, p, "ffn", **hc),
                                          norm(f"{p}.{ffn_norm}", hidden), mlp(i, p))
                collapse = hyper_head(w, f"{own}.", hidden=hidden, n_streams=a.hc_mult, eps=a.hc_eps, norm_eps=eps,
                                      weighted=True)
                layers.append(StreamMTPLayer(
                    i, embed, norm(f"{own}.{layout.embed_norm}", hidden), norm(f"{own}.{layout.hidden_norm}", hidden),
                    linear(f"{own}.{layout.projection}", hidden, hidden),
                    linear(f"{own}.{layout.hidden_projection}", hidden, hidden), block,
                    HeadNorm(collapse, norm(f"{own}.{layout.head_norm}", hidden)), head,
                    prefixes=tuple(dict.fromkeys((f"{own}.", f"{p}.")))))
            return layers

        return build_decoder(
            a, w, mixer, mlp, names,
            hyper=lambda i, p: (hyper_connection(w, p, "attn", **hc), hyper_connection(w, p, "ffn", **hc)),
            hyper_head=hyper_head(w, names.model, hidden=hidden, n_streams=a.hc_mult, eps=a.hc_eps, norm_eps=eps,
                                  weighted=True), mtp=mtp)

"""Shared neural-network building blocks for families."""

from .cache import Cache, KVCache
from .layers import (
    Attention,
    CausalLM,
    DecoderLayer,
    Embedding,
    Linear,
    RMSNorm,
    RoutedExperts,
    SoftmaxTopKRouter,
    SparseMoE,
    Step,
    SwiGLU,
)
from .dsa import LayerNorm, LightningIndexer, SharedIndexer
from .mla import MLACache, MLAttention, mla_softmax_scale
from .rope import RoPE, build_rope
from .routers import SigmoidGroupedTopKRouter
from .weights import ExpertDecl, Param, Weights

__all__ = [
    "Attention", "Cache", "CausalLM", "DecoderLayer", "Embedding", "ExpertDecl", "KVCache", "Linear", "Param",
    "RMSNorm", "RoPE", "RoutedExperts", "SoftmaxTopKRouter", "SparseMoE", "Step", "SwiGLU", "Weights", "build_rope",
    # MLA, DSA and the sigmoid grouped router (DeepSeek V3/V3.2, Kimi K2, GLM)
    "LayerNorm", "LightningIndexer", "MLACache", "MLAttention", "SharedIndexer", "SigmoidGroupedTopKRouter",
    "mla_softmax_scale",
]

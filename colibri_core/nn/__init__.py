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
from .rope import RoPE, build_rope
from .weights import ExpertDecl, Param, Weights

__all__ = [
    "Attention", "Cache", "CausalLM", "DecoderLayer", "Embedding", "ExpertDecl", "KVCache", "Linear", "Param",
    "RMSNorm", "RoPE", "RoutedExperts", "SoftmaxTopKRouter", "SparseMoE", "Step", "SwiGLU", "Weights", "build_rope",
]

"""Shared neural-network building blocks for families."""

from .cache import Cache, KVCache, RecurrentState
from .deltanet import GatedDeltaNet
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
from .norms import GatedRMSNorm
from .rope import RoPE, build_rope, rope_parameters
from .weights import ExpertDecl, Param, Weights

__all__ = [
    "Attention", "Cache", "CausalLM", "DecoderLayer", "Embedding", "ExpertDecl", "GatedDeltaNet", "GatedRMSNorm",
    "KVCache", "Linear", "Param", "RMSNorm", "RecurrentState", "RoPE", "RoutedExperts", "SoftmaxTopKRouter",
    "SparseMoE", "Step", "SwiGLU", "Weights", "build_rope", "rope_parameters",
]

"""Shared neural-network building blocks for families."""

from .cache import Cache, KVCache, RecurrentState
from .deltanet import GatedDeltaNet
from .dsa import LayerNorm, LightningIndexer, SharedIndexer
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
from .mla import MLACache, MLAttention, mla_softmax_scale
from .norms import GatedRMSNorm
from .rope import RoPE, build_rope, rope_parameters
from .routers import SigmoidGroupedTopKRouter
from .weights import ExpertDecl, Param, Weights

__all__ = [
    "Attention", "Cache", "CausalLM", "DecoderLayer", "Embedding", "ExpertDecl", "KVCache", "Linear", "Param",
    "RMSNorm", "RoPE", "RoutedExperts", "SoftmaxTopKRouter", "SparseMoE", "Step", "SwiGLU", "Weights", "build_rope",
    "rope_parameters",
    # linear attention (Qwen3-Next / Qwen3.5 hybrids)
    "GatedDeltaNet", "GatedRMSNorm", "RecurrentState",
    # MLA, DSA and the sigmoid grouped router (DeepSeek V3/V3.2, Kimi K2, GLM)
    "LayerNorm", "LightningIndexer", "MLACache", "MLAttention", "SharedIndexer", "SigmoidGroupedTopKRouter",
    "mla_softmax_scale",
]

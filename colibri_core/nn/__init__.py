"""Shared neural-network building blocks for families."""

from colibri_core.compute.backend import GatedActivation, UngatedActivation
from colibri_core.nn.cache import Cache, KVCache, RecurrentState, SlidingKVCache
from colibri_core.nn.deltanet import GatedDeltaNet, LowRank
from colibri_core.nn.compressed import CompressedAttention, CompressedIndexer, WindowCompressor
from colibri_core.nn.dsa import LayerNorm, LightningIndexer, SharedIndexer
from colibri_core.nn.hyper import HyperConnection, HyperDecoderLayer, HyperHead
from colibri_core.nn.layers import (
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
    UngatedMLP,
)
from colibri_core.nn.lightning import LightningAttention, lightning_slopes
from colibri_core.nn.mamba import Mamba2Mixer
from colibri_core.nn.mamba1 import Mamba1Mixer
from colibri_core.nn.mla import MLACache, MLAttention, mla_softmax_scale
from colibri_core.nn.norms import GatedRMSNorm
from colibri_core.nn.rope import RoPE, build_rope, rope_parameters
from colibri_core.nn.shortconv import GatedShortConv
from colibri_core.nn.routers import (HashRouter, ScoredTopKRouter, SigmoidGroupedTopKRouter, SigmoidTopKRouter,
                                     SoftmaxGroupedTopKRouter, SparseMixerRouter)
from colibri_core.nn.chunked import temperature_tuning
from colibri_core.nn.weights import ExpertDecl, ExpertMatrices, Param, Weights

__all__ = [
    "Attention", "Cache", "CausalLM", "DecoderLayer", "Embedding", "ExpertDecl", "KVCache", "Linear", "Param",
    "RMSNorm", "RoPE", "RoutedExperts", "SoftmaxTopKRouter", "SparseMoE", "Step", "SwiGLU", "Weights", "build_rope",
    "rope_parameters",
    # linear attention (Qwen3-Next / Qwen3.5 hybrids, Kimi Linear's KDA); LFM2's gated short convolution
    "GatedShortConv",
    "GatedDeltaNet", "GatedRMSNorm", "LowRank", "RecurrentState",
    # MLA, DSA and the sigmoid grouped router (DeepSeek V3/V3.2, Kimi K2, GLM)
    "LayerNorm", "LightningIndexer", "MLACache", "MLAttention", "SharedIndexer", "SigmoidGroupedTopKRouter",
    "mla_softmax_scale",
    # softmax routers: DeepSeek-V2's (greedy or group-limited, scaled), ERNIE 4.5's (a choice bias)
    "SoftmaxGroupedTopKRouter",
    # Phi-MoE's sparsemixer (top 2, eval mode)
    "SparseMixerRouter",
    # sliding-window attention with sinks, experts with biases and another activation (gpt-oss)
    "ExpertMatrices", "GatedActivation", "SlidingKVCache",
    # DeepSeek-V4's attention (sliding window, sinks, CSA / HCA compressed entries) and routers
    "CompressedAttention", "CompressedIndexer", "HashRouter", "ScoredTopKRouter", "WindowCompressor",
    # manifold hyper-connections (DeepSeek-V4, GLM-5 Next)
    "HyperConnection", "HyperDecoderLayer", "HyperHead",
    # Mamba-2 and squared-ReLU MLPs and experts without a gate (Nemotron-H, Granite 4)
    "Mamba2Mixer", "UngatedActivation", "UngatedMLP",
    # Mamba (v1), its per-channel selective scan (Jamba)
    "Mamba1Mixer",
    # lightning attention: linear attention with a fixed decay per head (MiniMax-Text-01 / M1)
    "LightningAttention", "lightning_slopes",
    # Llama 4: its router (sigmoid of the top logits, weighting the experts' inputs:
    # SparseMoE(weight_inputs=True)) and its NoPE layers' attention temperature
    # (Attention's query_scale; chunked attention is Attention's chunk)
    "SigmoidTopKRouter", "temperature_tuning",
]

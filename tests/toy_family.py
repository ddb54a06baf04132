"""A third-party family defined outside any installed distribution: a tiny MoE with
plain attention (no q/k norms) on the core's shared blocks, and a checkpoint writer."""

from dataclasses import dataclass

import numpy as np

from colibri_core import hookimpl
from colibri_core.model.config import ModelArgs
from colibri_core.model.family import Family
from colibri_core.nn import (
    Attention, CausalLM, DecoderLayer, Embedding, Linear, RoutedExperts, SoftmaxTopKRouter, SparseMoE, build_rope,
)
from colibri_core.plugins.registry import FamilySpec
from colibri_core.io.safetensors import write_safetensors

MODEL_TYPE = "toy_moe"


@dataclass
class ToyArgs(ModelArgs):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    max_position_embeddings: int = 64


class ToyFamily(Family):
    name = "toy"

    def build(self, config, w):
        a = ToyArgs.from_dict(config)
        h, heads = a.hidden_size, a.num_attention_heads
        d = h // heads
        rope = build_rope(config, d)
        layers = []
        for i in range(a.num_hidden_layers):
            p = f"layers.{i}"
            attn = Attention(layer=i, q=w.linear(f"{p}.q", h, h), k=w.linear(f"{p}.k", h, h), v=w.linear(f"{p}.v", h, h),
                             o=w.linear(f"{p}.o", h, h), n_heads=heads, n_kv_heads=heads, head_dim=d, rope=rope)
            experts = w.expert_layer(i, a.num_experts, {
                "gate": (f"{p}.experts.{{e}}.w1", (a.intermediate_size, h)),
                "up": (f"{p}.experts.{{e}}.w3", (a.intermediate_size, h)),
                "down": (f"{p}.experts.{{e}}.w2", (h, a.intermediate_size)),
            })
            moe = SparseMoE(SoftmaxTopKRouter(w.linear(f"{p}.router", a.num_experts, h), a.num_experts_per_tok, True),
                            RoutedExperts(experts))
            layers.append(DecoderLayer(w.rms_norm(f"{p}.norm1", h, 1e-6), attn, w.rms_norm(f"{p}.norm2", h, 1e-6), moe))
        embed = Embedding(w.param("embed.weight", (a.vocab_size, h)))
        return CausalLM(embed=embed, layers=layers, norm=w.rms_norm("norm", h, 1e-6), lm_head=Linear(embed.weight),
                        vocab_size=a.vocab_size, max_context=a.max_position_embeddings)


class ToyPlugin:
    """Registered in-process by the tests; nothing is installed."""

    @hookimpl
    def colibri_register_families(self, register):
        register(FamilySpec("toy", (MODEL_TYPE,), f"{__name__}:ToyFamily", description="test-only toy MoE"))


def write_toy_model(path, *, layers=2, hidden=16, heads=2, experts=4, top_k=2, inter=8, vocab=32, seed=0):
    import json

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t = {"embed.weight": rng.standard_normal((vocab, hidden), dtype=np.float32), "norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"layers.{i}"
        for n in "qkvo":
            t[f"{p}.{n}.weight"] = rng.standard_normal((hidden, hidden), dtype=np.float32) * 0.3
        t[f"{p}.norm1.weight"] = np.ones(hidden, np.float32)
        t[f"{p}.norm2.weight"] = np.ones(hidden, np.float32)
        t[f"{p}.router.weight"] = rng.standard_normal((experts, hidden), dtype=np.float32)
        for e in range(experts):
            t[f"{p}.experts.{e}.w1.weight"] = rng.standard_normal((inter, hidden), dtype=np.float32) * 0.3
            t[f"{p}.experts.{e}.w3.weight"] = rng.standard_normal((inter, hidden), dtype=np.float32) * 0.3
            t[f"{p}.experts.{e}.w2.weight"] = rng.standard_normal((hidden, inter), dtype=np.float32) * 0.3
    # the family names matrices without ".weight" for experts: rename to match
    t = {k.replace(".w1.weight", ".w1").replace(".w2.weight", ".w2").replace(".w3.weight", ".w3"): v for k, v in t.items()}
    write_safetensors(path / "model.safetensors", t)
    config = {"model_type": MODEL_TYPE, "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_experts": experts, "num_experts_per_tok": top_k,
              "intermediate_size": inter, "max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(config))
    return path

"""Tiny MoE models for checks of the engine on whole models (the batched engine's checks
in the conformance kit, colibri's scheduler tests), built once per session.

- "olmoe" (attention, softmax router), "deepseek_v3" (MLA), "deepseek_v32" (MLA and the
  DSA indexer, sparse from the fifth position), "qwen3_next" (Gated DeltaNet and gated
  attention): random float32 models saved by transformers, perturbed so that
  constant-initialised tensors matter; they need torch and transformers.
- "demo_int4": colibri's demo model (OLMoE-shaped, built without transformers)
  converted to int4 experts and int8 dense weights: the packed products and, under
  ``DEMO.default_budget``, experts streamed from disk.

Each needs its family to load (colibri-olmoe, colibri-deepseek, colibri-qwen). A model
whose family or builder is not installed is a pytest skip that says what to install.
"""

from __future__ import annotations

import importlib.util
import threading

import numpy as np

from colibri_core.cli.demo import DemoSpec

VOCAB = 128  # of the transformers models; every prompt id below it fits the demo's too
DEMO = DemoSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                intermediate_size=32, tokenizer_vocab=300, shard_bytes=60_000, cached_experts_per_layer=2)


def _olmoe():
    from transformers import OlmoeConfig

    return "OlmoeForCausalLM", OlmoeConfig(vocab_size=VOCAB, eos_token_id=None, hidden_size=32, intermediate_size=16,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                           num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1)


DEEPSEEK = dict(vocab_size=VOCAB, eos_token_id=None, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                max_position_embeddings=128, initializer_range=0.1)


def _deepseek_v3():
    from transformers import DeepseekV3Config

    return "DeepseekV3ForCausalLM", DeepseekV3Config(**DEEPSEEK)


def _deepseek_v32():  # 4 keys chosen by the indexer: sparse from the fifth position
    from transformers import DeepseekV32Config

    return "DeepseekV32ForCausalLM", DeepseekV32Config(**DEEPSEEK, index_n_heads=16, index_head_dim=16, index_topk=4)


def _qwen3_next():
    from transformers import Qwen3NextConfig

    return "Qwen3NextForCausalLM", Qwen3NextConfig(
        vocab_size=VOCAB, eos_token_id=None, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=256, initializer_range=0.1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
        shared_expert_intermediate_size=24, num_hidden_layers=4, intermediate_size=48, mlp_only_layers=[0])


TRANSFORMERS_MODELS = {"olmoe": _olmoe, "deepseek_v3": _deepseek_v3, "deepseek_v32": _deepseek_v32,
                       "qwen3_next": _qwen3_next}
MODEL_TYPES = {"olmoe": "olmoe", "deepseek_v3": "deepseek_v3", "deepseek_v32": "deepseek_v32",
               "qwen3_next": "qwen3_next", "demo_int4": "olmoe"}
NAMES = tuple(MODEL_TYPES)

_built: dict = {}
_lock = threading.Lock()


def missing(name: str) -> str | None:
    """Why model ``name`` cannot be built or loaded here, or None."""
    from colibri_core.plugins.discovery import get_registry
    from colibri_core.plugins.known import install_hint

    model_type = MODEL_TYPES[name]
    if model_type not in get_registry().model_types:
        return f"no installed family runs {model_type!r}: {install_hint(model_type)}"
    if name in TRANSFORMERS_MODELS:
        absent = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
        if absent:
            return f"the tiny {name} model is built with transformers: pip install {' '.join(absent)}"
    return None


def model_dir(name: str, tmp_path_factory):
    """The directory of tiny model ``name``, built on first use (a pytest skip with the
    reason where it cannot be built or loaded here)."""
    import pytest

    reason = missing(name)
    if reason is not None:
        pytest.skip(reason)
    with _lock:
        if name not in _built:
            _built[name] = _build(name, tmp_path_factory.mktemp(name))
        return _built[name]


def _build(name: str, root):
    if name == "demo_int4":
        from colibri_core.cli.convert import convert
        from colibri_core.cli.demo import ensure_demo_model

        src = ensure_demo_model(root / "bf16", DEMO)
        convert(src, root / "int4", experts="int4", dense="int8")
        return root / "int4"
    import torch
    import transformers

    torch.manual_seed(0)
    cls, config = TRANSFORMERS_MODELS[name]()
    config._attn_implementation = "eager"
    model = getattr(transformers, cls)(config).eval().to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root)
    return root


def prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of 3 to 39 ids below ``VOCAB``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]

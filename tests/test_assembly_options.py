"""``nn.assembly.build_decoder``'s layer shapes beyond the pre-norm one, against numpy:
``pre_norms=False`` (OLMo 2's and FlexOlmo's layers: no input norms declared or applied,
the branches' outputs through ``post``'s blocks before the residual: x +
post_attn(mixer(x)), then h + post_mlp(mlp(h))) and ``parallel`` with ``make_norm``
(Cohere's: x + mixer(norm(x)) + mlp(norm(x)), one norm per layer, of the family's kind).
(Every other option is proved by the families' oracle tests.)"""

import json
from dataclasses import dataclass

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.formats.base import FormatResolver
from colibri_core.io.checkpoint import Checkpoint
from colibri_core.io.safetensors import write_safetensors
from colibri_core.nn import LayerNorm
from colibri_core.nn.assembly import build_decoder
from colibri_core.nn.weights import Weights
from colibri_core.plugins.discovery import get_registry

H, V, LAYERS, EPS = 8, 16, 2, 1e-6


@dataclass
class Args:
    vocab_size: int = V
    hidden_size: int = H
    num_hidden_layers: int = LAYERS
    max_position_embeddings: int = 32
    rms_norm_eps: float = EPS
    tie_word_embeddings: bool = False


class Mixer:
    """A token mixer without state: a linear map of each row."""

    def __init__(self, linear):
        self.linear = linear

    def new_state(self, backend, max_len):
        return None

    def __call__(self, x, step):
        return self.linear(x, step)


def rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(EPS)) * w


def layer_norm(x, w):
    centred = x - np.mean(x, axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + np.float32(EPS)) * w


@pytest.fixture
def checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((V, H)), "model.norm.weight": 1 + rng.standard_normal(H) / 4,
               "lm_head.weight": rng.standard_normal((V, H))}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        tensors |= {f"{p}.mix.weight": rng.standard_normal((H, H)) / 3, f"{p}.ff.weight": rng.standard_normal((H, H)) / 3,
                    f"{p}.input_layernorm.weight": 1 + rng.standard_normal(H) / 4,
                    f"{p}.post_attention_layernorm.weight": 1 + rng.standard_normal(H) / 4,
                    f"{p}.post_feedforward_layernorm.weight": 1 + rng.standard_normal(H) / 4}
    tensors = {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "test"}))
    return tmp_path, tensors


def test_without_pre_norms_the_branches_are_normalised_after(checkpoint):
    path, t = checkpoint
    cpu = CpuBackend()
    with Checkpoint(path) as ck:
        w = Weights(ck, FormatResolver(get_registry(), ck, {}))
        lm = build_decoder(Args(), w, lambda i, p: Mixer(w.linear(f"{p}.mix", H, H)), lambda i, p: w.linear(f"{p}.ff", H, H),
                           post=lambda i, p: (w.rms_norm(f"{p}.post_attention_layernorm", H, EPS),
                                              w.rms_norm(f"{p}.post_feedforward_layernorm", H, EPS)),
                           pre_norms=False)
        assert not [n for n in w.params if "input_layernorm" in n]
        w.load_dense(w.resolver, cpu)
        ids = np.array([3, 1, 4, 1, 5])
        logits = lm.forward(ids, lm.new_cache(cpu), cpu, all_logits=True)
    x = t["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        h = x + rms(x @ t[f"{p}.mix.weight"].T, t[f"{p}.post_attention_layernorm.weight"])
        x = h + rms(h @ t[f"{p}.ff.weight"].T, t[f"{p}.post_feedforward_layernorm.weight"])
    expected = rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_parallel_layers_add_both_branches_of_one_norm(checkpoint):
    path, t = checkpoint
    cpu = CpuBackend()
    with Checkpoint(path) as ck:
        w = Weights(ck, FormatResolver(get_registry(), ck, {}))
        lm = build_decoder(Args(), w, lambda i, p: Mixer(w.linear(f"{p}.mix", H, H)), lambda i, p: w.linear(f"{p}.ff", H, H),
                           parallel=True, make_norm=lambda p: LayerNorm(w.param(f"{p}.weight", (H,)), None, EPS))
        assert not [n for n in w.params if "post_" in n]
        w.load_dense(w.resolver, cpu)
        ids = np.array([2, 7, 1, 8])
        logits = lm.forward(ids, lm.new_cache(cpu), cpu, all_logits=True)
    x = t["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        normed = layer_norm(x, t[f"{p}.input_layernorm.weight"])
        x = x + normed @ t[f"{p}.mix.weight"].T + normed @ t[f"{p}.ff.weight"].T
    expected = layer_norm(x, t["model.norm.weight"]) @ t["lm_head.weight"].T
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_parallel_layers_refuse_post_norms(checkpoint):
    path, _ = checkpoint
    with Checkpoint(path) as ck:
        w = Weights(ck, FormatResolver(get_registry(), ck, {}))
        with pytest.raises(ValueError, match="parallel layers do not combine"):
            build_decoder(Args(), w, None, None, parallel=True, post=lambda i, p: (None, None))


def test_hyper_connections_need_pre_norms(checkpoint):
    path, _ = checkpoint
    with Checkpoint(path) as ck:
        w = Weights(ck, FormatResolver(get_registry(), ck, {}))
        with pytest.raises(ValueError, match="hyper-connections need the layers' pre-norms"):
            build_decoder(Args(), w, None, None, hyper=lambda i, p: (None, None), hyper_head=object(), pre_norms=False)

"""Write a synthetic OLMoE-shaped checkpoint whose routing looks like a trained model's.

Random N(0, 0.02) weights make every token pick the same few experts, which flatters
every cache. Here the residual stream is dominated by each token's own embedding, and
the routers are scaled so their softmax is selective: different tokens pick different
experts (over 64 tokens nearly every expert of a layer is used, and consecutive tokens
share few experts). ``--skew S`` adds a per-expert bias of -S * log(rank) through a
direction all embeddings share, so some experts are hot (Zipf-like popularity, S=1
being Zipf's law) — what makes a routing history and a pinned set worth having.

``--residual-mix M`` sets how much each layer's output (attention's o_proj, the experts'
down_proj: weights N(0, (M / sqrt(fan-in))^2)) changes the residual stream, and so how
predictable the next MoE layer's routing is from the hidden state before it (what
``--prefetch`` predicts from). The default 0.02 leaves the embedding dominant: prefetch
precision ~99%; trained MoEs are nearer 75-80%. ``benchmarks/prefetch_calibrate.py``
measures precision and recall on a written checkpoint, to choose M for a target.

Shards are written one at a time (memory bounded by one shard), bf16, with an index.

    python benchmarks/synthetic_olmoe.py --out /data/olmoe-syn --layers 12 --hidden 1024 \\
        --intermediate 512 --experts 64 --top-k 8 --vocab 8192 --skew 1.0
    python benchmarks/synthetic_olmoe.py --out /data/olmoe-full --full-size   # OLMoE-1B-7B shape, 13.8 GB
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from colibri_core.formats.base import f32_to_bf16
from colibri_core.io.safetensors import write_safetensors

FULL_SIZE = dict(hidden=2048, layers=16, heads=16, experts=64, top_k=8, intermediate=1024, vocab=50304)


def tensor_plan(a):
    h, e, i = a.hidden, a.experts, a.intermediate
    yield "model.embed_tokens.weight", (a.vocab, h)
    for layer in range(a.layers):
        p = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"{p}.self_attn.{proj}.weight", (h, h)
        for norm in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm"):
            yield f"{p}.{norm}.weight", (h,)
        yield f"{p}.mlp.gate.weight", (e, h)
        for x in range(e):
            yield f"{p}.mlp.experts.{x}.gate_proj.weight", (i, h)
            yield f"{p}.mlp.experts.{x}.up_proj.weight", (i, h)
            yield f"{p}.mlp.experts.{x}.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (a.vocab, h)


class Generator:
    """Draws each tensor; routers and embeddings share the 'common' direction."""

    BETA = 1.0  # weight of the shared direction in every embedding (in units of sqrt(hidden))
    ROUTER_LOGIT_STD = 2.5  # spread of the token-dependent part of router logits

    def __init__(self, a):
        self.a = a
        self.rng = np.random.default_rng(a.seed)
        common = self.rng.standard_normal(a.hidden).astype(np.float32)
        self.common = common / np.linalg.norm(common)

    def draw(self, name: str, shape) -> np.ndarray:
        a, rng = self.a, self.rng
        h = a.hidden
        if len(shape) == 1:
            return np.ones(shape, dtype=np.float32)
        if name.endswith("embed_tokens.weight"):
            emb = rng.standard_normal(shape, dtype=np.float32)
            emb += np.float32(self.BETA * np.sqrt(h)) * self.common  # shared direction: carries the skew
            return emb
        if name.endswith("mlp.gate.weight"):
            # token-dependent part: logits with std ROUTER_LOGIT_STD for a normalised input
            x_norm = np.sqrt(h / (1 + self.BETA**2))  # |x . u| scale for unit-RMS x and unit-variance u
            router = rng.standard_normal(shape, dtype=np.float32) * np.float32(self.ROUTER_LOGIT_STD / x_norm)
            # orthogonal to the shared direction, so only --skew biases experts
            router -= np.outer(router @ self.common, self.common).astype(np.float32)
            if a.skew > 0:
                ranks = rng.permutation(shape[0]) + 1
                bias = -a.skew * np.log(ranks)  # Zipf-like: softmax(bias) ~ rank^-skew
                along = self.BETA * np.sqrt(h) / np.sqrt(1 + self.BETA**2)  # x . common for every token
                router += (bias / along).astype(np.float32)[:, None] * self.common[None, :]
            return router
        if "o_proj" in name or "down_proj" in name:
            # small writes into the residual stream keep each token's embedding dominant (and
            # the next layer's routing predictable); --residual-mix makes them larger
            return rng.standard_normal(shape, dtype=np.float32) * np.float32(a.residual_mix / np.sqrt(shape[1]))
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / np.sqrt(shape[1]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--full-size", action="store_true", help="the OLMoE-1B-7B shape (13.8 GB in bf16)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of expert popularity (0: none)")
    parser.add_argument("--residual-mix", type=float, default=0.02,
                        help="scale of each layer's writes into the residual stream (larger: next-layer routing "
                             "less predictable; see benchmarks/prefetch_calibrate.py)")
    parser.add_argument("--shard-gb", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    if not a.residual_mix > 0:
        parser.error(f"--residual-mix must be above 0, got {a.residual_mix}")
    if a.full_size:
        for k, v in FULL_SIZE.items():
            setattr(a, k, v)
    a.out.mkdir(parents=True, exist_ok=False)
    gen = Generator(a)
    shard_bytes = int(a.shard_gb * 1e9)
    total_bytes = sum(2 * int(np.prod(s)) for _, s in tensor_plan(a))
    n_shards_est = max(1, -(-total_bytes // shard_bytes))
    weight_map, pending, size, index, written = {}, [], 0, 0, 0

    def flush():
        nonlocal pending, size, index
        name = f"model-{index + 1:05d}.safetensors"
        write_safetensors(a.out / name, pending, metadata={"format": "pt"})
        for tensor, _ in pending:
            weight_map[tensor] = name
        pending, size, index = [], 0, index + 1
        print(f"  wrote {name} ({written / 1e9:.2f} of {total_bytes / 1e9:.2f} GB)", file=sys.stderr, flush=True)

    for name, shape in tensor_plan(a):
        data = f32_to_bf16(gen.draw(name, shape))
        if pending and size + data.nbytes > shard_bytes:
            flush()
        pending.append((name, ("BF16", data)))
        size += data.nbytes
        written += data.nbytes
    flush()
    renamed = {}
    for i in range(index):
        old, new = f"model-{i + 1:05d}.safetensors", f"model-{i + 1:05d}-of-{index:05d}.safetensors"
        os.replace(a.out / old, a.out / new)
        renamed[old] = new
    (a.out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": written}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}, indent=1))
    config = {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": a.vocab, "hidden_size": a.hidden,
        "intermediate_size": a.intermediate, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
        "num_key_value_heads": a.heads, "num_experts": a.experts, "num_experts_per_tok": a.top_k,
        "norm_topk_prob": False, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "hidden_act": "silu",
        "tie_word_embeddings": False, "eos_token_id": None, "torch_dtype": "bfloat16",
        "colibri_synthetic": {"skew": a.skew, "seed": a.seed, "residual_mix": a.residual_mix},
    }
    (a.out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"{a.out}: {written / 1e9:.2f} GB in {index} shards (estimated {n_shards_est})", file=sys.stderr)


if __name__ == "__main__":
    main()

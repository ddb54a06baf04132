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

The mix alone cannot make routing both spread and hard to predict: past M ~ 1.5 the
accumulated writes lead the residual stream, precision levels off near 74% and the
tokens all route alike (coverage falls from 93% to 31%; docs/benchmarks.md).
``--write-gain G`` is the knob for that: each MoE layer's experts write (down_proj) into
a subspace of their own, which no embedding, no attention and no other layer's write touches, and the
next MoE layer's router reads that subspace with gain G. What the prefetcher sees (the
hidden state after attention, before the experts run) holds none of it, so the next
layer's routing is part token (predictable), part this layer's write (not), in a ratio
set by G, while the residual stream stays led by each token's embedding (routing stays
spread). G = 0 (the default) writes exactly the checkpoint without the knob; about G ~ 1
the write moves the next router's logits about as much as the token does.

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


def write_rank(a) -> int:
    """Dimensions of each MoE layer's write subspace: together they take at most half the hidden size."""
    return min(Generator.WRITE_RANK, (a.hidden // 2) // max(1, a.layers - 1))


class Generator:
    """Draws each tensor; routers and embeddings share the 'common' direction."""

    BETA = 1.0  # weight of the shared direction in every embedding (in units of sqrt(hidden))
    ROUTER_LOGIT_STD = 2.5  # spread of the token-dependent part of router logits
    WRITE_RANK = 64  # dimensions of each MoE layer's own write subspace (--write-gain)

    def __init__(self, a):
        self.a = a
        self.rng = np.random.default_rng(a.seed)
        common = self.rng.standard_normal(a.hidden).astype(np.float32)
        self.common = common / np.linalg.norm(common)
        self.writes = self._write_subspaces() if a.write_gain > 0 else None
        # every write subspace side by side, (hidden, (layers - 1) x rank)
        self._all_writes = None if self.writes is None else self.writes.transpose(1, 0, 2).reshape(a.hidden, -1)

    def _write_subspaces(self) -> np.ndarray:
        """(layers - 1, hidden, rank) orthonormal bases, mutually orthogonal and orthogonal to
        the shared direction: layer L's experts write into writes[L], router L + 1 reads it.
        From a generator of their own, so the other tensors are drawn as without the knob."""
        a = self.a
        rank = write_rank(a)
        rng = np.random.default_rng([a.seed, 1])
        basis = np.linalg.qr(np.concatenate(
            [self.common[:, None], rng.standard_normal((a.hidden, rank * (a.layers - 1)))], axis=1))[0]
        return basis[:, 1:].T.reshape(a.layers - 1, rank, a.hidden).transpose(0, 2, 1).astype(np.float32)

    def _outside_writes(self, x: np.ndarray) -> np.ndarray:
        """x's rows with their parts in every write subspace taken out."""
        if self._all_writes is None:
            return x
        return x - (x @ self._all_writes) @ self._all_writes.T

    def draw(self, name: str, shape) -> np.ndarray:
        a, rng = self.a, self.rng
        h = a.hidden
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if len(shape) == 1:
            return np.ones(shape, dtype=np.float32)
        if name.endswith("embed_tokens.weight"):
            emb = self._outside_writes(rng.standard_normal(shape, dtype=np.float32))
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
            if self.writes is not None and layer > 0:
                router += self._reads_previous_write(layer, shape)
            return router
        if self.writes is not None and "down_proj" in name and layer < a.layers - 1:
            # into this layer's own subspace, with the norm the full-width write would have
            basis = self.writes[layer]
            rank = basis.shape[1]
            inner = rng.standard_normal((rank, shape[1]), dtype=np.float32)
            return basis @ (inner * np.float32(a.residual_mix / np.sqrt(shape[1]) * np.sqrt(h / rank)))
        if self.writes is not None and "o_proj" in name:
            # attention writes outside every write subspace: a router amplifies only its own
            # subspace, so anything else there (attention's context averages) would concentrate routing
            return self._outside_writes(self._small_write(shape).T).T
        if "o_proj" in name or "down_proj" in name:
            # small writes into the residual stream keep each token's embedding dominant (and
            # the next layer's routing predictable); --residual-mix makes them larger
            return self._small_write(shape)
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / np.sqrt(shape[1]))

    def _small_write(self, shape) -> np.ndarray:
        return self.rng.standard_normal(shape, dtype=np.float32) * np.float32(self.a.residual_mix / np.sqrt(shape[1]))

    def _reads_previous_write(self, layer: int, shape) -> np.ndarray:
        """Router rows over layer - 1's write subspace. A write coordinate there has std about
        mix * sqrt(E[silu(z)^2]) * sqrt(hidden / rank) (times the routing weights' norm) before
        the norm divides by the residual's RMS, sqrt(1 + BETA^2): scaled so that such a write
        moves the logits by G x ROUTER_LOGIT_STD."""
        a = self.a
        basis = self.writes[layer - 1]
        rank = basis.shape[1]
        write_coord = a.residual_mix * np.sqrt(0.355) * np.sqrt(a.hidden / rank) / np.sqrt(1 + self.BETA**2)
        weights = np.random.default_rng([a.seed, 2, layer]).standard_normal((shape[0], rank)).astype(np.float32)
        weights *= np.float32(a.write_gain * self.ROUTER_LOGIT_STD / (write_coord * np.sqrt(rank)))
        return weights @ basis.T


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
    parser.add_argument("--write-gain", type=float, default=0.0,
                        help="how much the next MoE layer's router reads this layer's expert writes, which the "
                             "prefetcher cannot see (0: off; larger: routing less predictable, still spread)")
    parser.add_argument("--shard-gb", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    if not a.residual_mix > 0:
        parser.error(f"--residual-mix must be above 0, got {a.residual_mix}")
    if not a.write_gain >= 0:
        parser.error(f"--write-gain must be 0 or more, got {a.write_gain}")
    if a.full_size:
        for k, v in FULL_SIZE.items():
            setattr(a, k, v)
    if a.write_gain > 0 and write_rank(a) < 1:
        parser.error(f"--write-gain needs --hidden of at least 2 x (layers - 1) = {2 * (a.layers - 1)}, "
                     f"got {a.hidden}")
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
        "colibri_synthetic": {"skew": a.skew, "seed": a.seed, "residual_mix": a.residual_mix,
                              "write_gain": a.write_gain},
    }
    (a.out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"{a.out}: {written / 1e9:.2f} GB in {index} shards (estimated {n_shards_est})", file=sys.stderr)


if __name__ == "__main__":
    main()

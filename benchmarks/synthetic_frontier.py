"""Write a frontier-shaped synthetic checkpoint: DeepSeek-V3 / GLM-5 geometry per layer, a few layers.

Each layer is a DeepSeek-V3 layer (transformers' ``deepseek_v3``): hidden 7168, MLA
attention (q_lora_rank 1536, kv_lora_rank 512, 128 heads, rope 64 + nope 128, v 128), 256
routed experts top-8 (sigmoid router, 8 groups, top-4 groups) plus one shared expert,
expert intermediate 2048. Only the layer count is small (``--moe-layers``, default 3:
about 38 GB; each layer is 11.5 GB), so a streaming benchmark reads experts of the real
size from a checkpoint of the real layout: linear weights (experts, shared expert,
attention projections) are float8 e4m3 with 128 x 128 float32 block scales in
``<name>_scale_inv``, as DeepSeek-V3's Hugging Face checkpoints ship them (colibri's
``fp8-e4m3-b128`` format computes them natively); embeddings, norms and the router are
bf16, the router's ``e_score_correction_bias`` float32.

Routing looks trained (as ``synthetic_olmoe.py``): the residual stream is led by each
token's embedding and the routers are selective. ``--residual-mix M`` sets how much each
layer's output (attention's ``o_proj``, the experts' ``down_proj``: weights
N(0, (M / sqrt(fan-in))^2)) changes the residual stream, and so how predictable the next
MoE layer's routing is (``benchmarks/prefetch_calibrate.py`` measures it; trained MoEs
are near 75-80%).

Written tensor by tensor (a tensor in memory at a time, large ones in row chunks: never a
layer), into ``.NAME.partial-PID`` beside the output, renamed into place when complete;
progress on stderr.

    python benchmarks/synthetic_frontier.py --out /data/frontier-syn --residual-mix 0.5
    python benchmarks/synthetic_frontier.py --out /tmp/tiny --tiny     # a few MB, for tests
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

E4M3_MAX = 448.0
BLOCK = 128
ROW_CHUNK = 1024  # rows drawn at once (a multiple of BLOCK): bounds memory for the large tensors
ROUTER_LOGIT_STD = 2.5  # spread of router logits for a normalised input

FULL = dict(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, experts=256, top_k=8, n_group=8, topk_group=4, shared_experts=1, moe_intermediate=2048,
            intermediate=18432, vocab=129280)
TINY = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            experts=16, top_k=4, n_group=4, topk_group=2, shared_experts=1, moe_intermediate=32, intermediate=96,
            vocab=256)


# -- what is written -------------------------------------------------------------------------
def tensor_plan(a):
    """(name, shape, kind) in file order; kind: "fp8" (with a ``_scale_inv`` after it),
    "bf16", "norm" (bf16 ones) or "bias" (float32 zeros). An expert's matrices and their
    scales lie together, so colibri reads an expert in one request."""
    h, heads = a.hidden, a.heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    yield "model.embed_tokens.weight", (a.vocab, h), "bf16"
    for layer in range(a.dense_layers + a.moe_layers):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", (h,), "norm"
        yield f"{p}.self_attn.q_a_proj.weight", (a.q_lora_rank, h), "fp8"
        yield f"{p}.self_attn.q_a_layernorm.weight", (a.q_lora_rank,), "norm"
        yield f"{p}.self_attn.q_b_proj.weight", (heads * qk, a.q_lora_rank), "fp8"
        yield f"{p}.self_attn.kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, h), "fp8"
        yield f"{p}.self_attn.kv_a_layernorm.weight", (a.kv_lora_rank,), "norm"
        yield f"{p}.self_attn.kv_b_proj.weight", (heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank), "fp8"
        yield f"{p}.self_attn.o_proj.weight", (h, heads * a.v_head_dim), "fp8"
        yield f"{p}.post_attention_layernorm.weight", (h,), "norm"
        if layer < a.dense_layers:
            yield from _swiglu(f"{p}.mlp", h, a.intermediate)
            continue
        yield f"{p}.mlp.gate.weight", (a.experts, h), "bf16"
        yield f"{p}.mlp.gate.e_score_correction_bias", (a.experts,), "bias"
        if a.shared_experts:
            yield from _swiglu(f"{p}.mlp.shared_experts", h, a.moe_intermediate * a.shared_experts)
        for e in range(a.experts):
            yield from _swiglu(f"{p}.mlp.experts.{e}", h, a.moe_intermediate)
    yield "model.norm.weight", (h,), "norm"
    yield "lm_head.weight", (a.vocab, h), "bf16"


def _swiglu(p, hidden, inner):
    yield f"{p}.gate_proj.weight", (inner, hidden), "fp8"
    yield f"{p}.up_proj.weight", (inner, hidden), "fp8"
    yield f"{p}.down_proj.weight", (hidden, inner), "fp8"


def scale_shape(shape):
    return (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))


def specs(plan):
    """(name, safetensors dtype, shape, kind) of every stored tensor, scales included."""
    for name, shape, kind in plan:
        if kind == "fp8":
            yield name, "F8_E4M3", shape, kind
            yield name + "_scale_inv", "F32", scale_shape(shape), "scale"
        elif kind == "bias":
            yield name, "F32", shape, kind
        else:
            yield name, "BF16", shape, kind


def nbytes(dtype, shape):
    return {"F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype] * math.prod(shape)


def config(a) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": a.vocab,
        "hidden_size": a.hidden, "intermediate_size": a.intermediate, "moe_intermediate_size": a.moe_intermediate,
        "num_hidden_layers": a.dense_layers + a.moe_layers, "num_attention_heads": a.heads,
        "num_key_value_heads": a.heads, "n_shared_experts": a.shared_experts, "n_routed_experts": a.experts,
        "num_experts_per_tok": a.top_k, "n_group": a.n_group, "topk_group": a.topk_group, "topk_method": "noaux_tc",
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": a.dense_layers,
        "moe_layer_freq": 1, "kv_lora_rank": a.kv_lora_rank, "q_lora_rank": a.q_lora_rank,
        "qk_rope_head_dim": a.qk_rope_head_dim, "qk_nope_head_dim": a.qk_nope_head_dim, "v_head_dim": a.v_head_dim,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "rope_interleave": True,
        "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": None, "bos_token_id": None,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [BLOCK, BLOCK]},
        "colibri_synthetic": {"generator": "synthetic_frontier", "residual_mix": a.residual_mix, "seed": a.seed},
    }


# -- drawing --------------------------------------------------------------------------------
def std_of(a, name, shape) -> float:
    if name.endswith("embed_tokens.weight"):
        return 1.0  # unit-RMS embeddings lead the residual stream
    if name.endswith("mlp.gate.weight"):
        return ROUTER_LOGIT_STD / math.sqrt(shape[1])  # the routers' input is RMS-normalised
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        return a.residual_mix / math.sqrt(shape[1])  # writes into the residual stream
    return 1.0 / math.sqrt(shape[1])


def work(plan):
    """(name, shape, kind, first row, rows) pieces in file order: large tensors in row
    chunks, so memory holds a few chunks, never a layer."""
    for name, shape, kind in plan:
        if len(shape) == 1:
            yield name, shape, kind, 0, shape[0]
            continue
        for start in range(0, shape[0], ROW_CHUNK):
            yield name, shape, kind, start, min(ROW_CHUNK, shape[0] - start)


def draw(a, name, shape, kind, start, rows):
    """One piece as stored bytes (and, for fp8, its rows of block scales). Each piece has
    its own generator, seeded by (seed, tensor, first row): the bytes do not depend on
    how many threads draw them, nor in which order."""
    import torch

    if kind == "norm":
        return np.full(shape, 0x3F80, dtype=np.uint16).view(np.uint8), None  # bf16 1.0
    if kind == "bias":
        return np.zeros(shape, dtype=np.float32).view(np.uint8), None
    key = hashlib.blake2b(f"{a.seed}:{name}:{start}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    x = torch.randn((rows, shape[1]), generator=gen, dtype=torch.float32)
    std = std_of(a, name, shape)
    if kind == "bf16":
        return (x * std).to(torch.bfloat16).view(torch.uint16).numpy().view(np.uint8), None
    return quantize(torch, x, std)


def drawn_in_order(a, pieces, threads: int):
    """``draw`` of each piece, in order, ``threads`` at a time, at most 2 x threads ahead."""
    import torch

    if threads <= 1:
        for piece in pieces:
            yield draw(a, *piece)
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # parallel over pieces, not inside them
    try:
        with ThreadPoolExecutor(threads) as pool:  # torch releases the GIL in randn and the casts
            ahead = deque()
            for piece in pieces:
                ahead.append(pool.submit(draw, a, *piece))
                if len(ahead) >= 2 * threads:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
    finally:
        torch.set_num_threads(before)


def quantize(torch, x, std):
    """(rows, cols) N(0, 1) float32, weight = x * std -> (e4m3 bytes, block scales) with
    each block's largest magnitude at 448 (as DeepSeek's fp8 cast)."""
    rows, cols = x.shape
    r, c = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    padded = x if (rows % BLOCK == 0 and cols % BLOCK == 0) else torch.nn.functional.pad(
        x, (0, c * BLOCK - cols, 0, r * BLOCK - rows))
    blocks = padded.view(r, BLOCK, c, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    q = (blocks * (E4M3_MAX / amax)[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(r * BLOCK, c * BLOCK)[:rows, :cols].contiguous()
    scale = (amax / E4M3_MAX * std).numpy()  # the std folds into the scale: value * scale = x * std
    return q.view(torch.uint8).numpy().reshape(-1).view(np.uint8), scale


# -- writing --------------------------------------------------------------------------------
class ShardWriter:
    """One safetensors file, header first, then each tensor's bytes as they come."""

    def __init__(self, path: Path, entries):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        self.sizes = []
        for name, dtype, shape in entries:
            size = nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.sizes.append((name, size))
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(blob)) + blob)
        self.index, self.done = 0, 0

    def write(self, data: np.ndarray) -> None:
        self.file.write(memoryview(np.ascontiguousarray(data).reshape(-1)))
        self.done += data.nbytes

    def end_tensor(self) -> None:
        name, size = self.sizes[self.index]
        if self.done != size:
            raise AssertionError(f"{name}: wrote {self.done} bytes, declared {size}")
        self.index, self.done = self.index + 1, 0

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def plan_shards(entries, shard_bytes):
    """Split (name, dtype, shape, kind) entries into shards of about ``shard_bytes``, never
    separating an fp8 weight from its scales."""
    shards, current, size = [], [], 0
    for entry in entries:
        n = nbytes(entry[1], entry[2])
        if current and size + n > shard_bytes and entry[3] != "scale":
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += n
    if current:
        shards.append(current)
    return shards


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.started, self.shown = total, 0, time.monotonic(), 0.0
        self.tty = sys.stderr.isatty()

    def add(self, n: int, what: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if now - self.shown < (0.5 if self.tty else 10.0) and self.done < self.total:
            return
        self.shown = now
        rate = self.done / max(now - self.started, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0
        line = (f"{self.done / 1e9:7.2f} / {self.total / 1e9:.2f} GB ({self.done / self.total:4.0%}), "
                f"{rate / 1e6:6.1f} MB/s, {eta:5.0f} s left  {what}")
        print(("\r" + line + "\x1b[K") if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def write(a) -> Path:
    out = a.out
    if out.exists():
        raise SystemExit(f"{out}: already exists (choose another --out or remove it)")
    plan = list(tensor_plan(a))
    entries = list(specs(plan))
    total = sum(nbytes(d, s) for _, d, s, _ in entries)
    shards = plan_shards(entries, int(a.shard_gb * 1e9))
    print(f"{out}: {a.dense_layers} dense + {a.moe_layers} MoE layers, hidden {a.hidden}, {a.experts} experts "
          f"top-{a.top_k}, {total / 1e9:.2f} GB in {len(shards)} shards, residual mix {a.residual_mix}",
          file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    partial.mkdir()
    pieces = drawn_in_order(a, work(plan), a.threads)
    try:
        progress = Progress(total)
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            writer = ShardWriter(partial / file, [(n, d, s) for n, d, s, _ in shard])
            try:
                for name, dtype, shape, kind in shard:
                    weight_map[name] = file
                    if kind == "scale":  # the rows of scales drawn with its weight's pieces
                        data = np.concatenate(scales, axis=0).astype(np.float32).view(np.uint8)
                        writer.write(data)
                        progress.add(data.nbytes, name)
                    else:
                        scales = []
                        rows = shape[0] if len(shape) == 2 else 1
                        for _ in range(-(-rows // ROW_CHUNK)):
                            data, scale = next(pieces)
                            writer.write(data)
                            progress.add(data.nbytes, name)
                            if scale is not None:
                                scales.append(scale)
                    writer.end_tensor()
            finally:
                writer.close()
        progress.finish()
        (partial / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (partial / "config.json").write_text(json.dumps(config(a), indent=2))
        os.replace(partial, out)
    except BaseException:
        pieces.close()  # stops the drawing threads
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(f"{out}: {total / 1e9:.2f} GB written", file=sys.stderr)
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--moe-layers", type=int, default=3, help="MoE layers (each 11.5 GB at the full geometry)")
    p.add_argument("--dense-layers", type=int, default=0, help="dense layers before them (first_k_dense_replace)")
    p.add_argument("--residual-mix", type=float, default=0.02,
                   help="scale of each layer's writes into the residual stream (larger: next-layer routing less "
                        "predictable; benchmarks/prefetch_calibrate.py measures it)")
    p.add_argument("--tiny", action="store_true", help="a tiny geometry of the same layout (tests)")
    for key, value in FULL.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads drawing pieces (same bytes for any)")
    a = p.parse_args(argv)
    base = TINY if a.tiny else FULL
    for key, value in base.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if not a.residual_mix > 0:
        p.error(f"--residual-mix must be above 0, got {a.residual_mix}")
    if a.moe_layers < 1 or a.dense_layers < 0:
        p.error("--moe-layers must be at least 1 and --dense-layers at least 0")
    if a.experts % a.n_group or a.topk_group > a.n_group or a.top_k > a.experts // a.n_group * a.topk_group:
        p.error(f"--experts {a.experts} in --n-group {a.n_group} groups, --topk-group {a.topk_group} "
                f"cannot give --top-k {a.top_k}")
    if a.threads < 1:
        p.error("--threads must be at least 1")
    if not a.shard_gb > 0:
        p.error("--shard-gb must be above 0")
    return a


def main(argv=None):
    write(parse(argv))


if __name__ == "__main__":
    main()

"""Writing a tiny DeepSeek-V4 in the layout of DeepSeek's published shards, for tests.

``v4_native_rewrite()`` is an ``OracleCase.rewrite`` hook: it renames the checkpoint
transformers saved to the published spelling (no ``model.`` prefix; ``embed``, ``norm``,
``hc_head_{fn,base,scale}``, ``attn.kv_norm``), stores the dense projections DeepSeek
ships in fp8 (``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, the indexer's ``wq_b``, the
shared experts; an MTP layer's ``e_proj`` and ``h_proj``) as float8_e4m3fn with ``<m>.scale`` F8_E8M0 128 x 128 block scales and the
routed experts as fp4: ``<m>.weight`` I8 (rows, cols / 2), element 2j in the low nibble,
with ``<m>.scale`` F8_E8M0 (rows, cols / 32). config.json gets DeepSeek-V4-Flash's
``quantization_config`` and its top-level ``expert_dtype: fp4``. The reference copy holds
the dequantised float32 weights under transformers' names.

Written from the published description (transformers' ``Fp8Quantize`` with ue8m0 scales,
DeepSeek's ``inference/convert.py``), independently of colibri's decoders.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from colibri_core.testing.rewrite import rewrite_checkpoint

E4M3_MAX = 448.0
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": [128, 128]}
FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$"
                 r"|^mtp\.\d+\.[eh]_proj\.weight$")  # and an MTP layer's e_proj / h_proj (vLLM's deepseek_v4_mtp)
FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def published_name(name: str) -> str:
    """transformers' saved name -> the name in DeepSeek's shards."""
    name = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(name, name)
    name = re.sub(r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name)
    name = re.sub(r"^model\.layers\.", "layers.", name)
    return re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", name)


def quantize_fp8_ue8m0(w: np.ndarray, block: int = 128):
    """float32 (rows, cols) -> (e4m3fn bytes (rows, cols), ue8m0 exponents (ceil(rows/128),
    ceil(cols/128)), the float32 weight they stand for). As transformers' ``Fp8Quantize``
    with ``scale_fmt: ue8m0``: each block's scale is amax / 448 rounded up to a power of two."""
    import torch

    rows, cols = w.shape
    r, c = -(-rows // block), -(-cols // block)
    padded = np.zeros((r * block, c * block), dtype=np.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(r, block, c, block)
    amax = np.abs(blocks).max(axis=(1, 3))
    exponent = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / E4M3_MAX)), 0).astype(np.int64)
    scale = np.ldexp(np.float32(1.0), exponent).astype(np.float32)
    q = torch.from_numpy(np.ascontiguousarray(blocks / scale[:, None, :, None])).to(torch.float8_e4m3fn)
    dequantised = (q.float().numpy() * scale[:, None, :, None]).reshape(r * block, c * block)[:rows, :cols]
    codes = q.view(torch.uint8).numpy().reshape(r * block, c * block)[:rows, :cols]
    return np.ascontiguousarray(codes), (exponent + 127).astype(np.uint8), np.ascontiguousarray(dequantised)


def quantize_fp4(w: np.ndarray):
    """float32 (rows, cols), cols a multiple of 32 -> (I8 (rows, cols / 2): element 2j low
    nibble, 2j + 1 high; ue8m0 exponents (rows, cols / 32); the float32 weight they stand
    for). Each group's scale is amax / 6 rounded up to a power of two (nothing clips)."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32).astype(np.float32)
    amax = np.abs(groups).max(axis=-1)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 6.0)), 0).astype(np.int64)
    scale = np.ldexp(np.float32(1.0), exponent).astype(np.float32)[..., None]
    magnitude = np.abs(np.abs(groups / scale)[..., None] - E2M1).argmin(axis=-1)
    code = (magnitude | np.where(groups < 0, 8, 0)).astype(np.uint8).reshape(rows, cols)
    dequantised = (np.where(groups < 0, -1.0, 1.0) * E2M1[magnitude] * scale).astype(np.float32).reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, (exponent + 127).astype(np.uint8), dequantised


def v4_native_rewrite(expert_dtype_at_top: bool = True):
    """An ``OracleCase.rewrite`` hook writing the published layout. ``expert_dtype_at_top``:
    V4's spelling (config.json's top level); False puts it in quantization_config (V4.1)."""

    def quantise(tensors):
        stored, dequantised, names = {}, {}, []
        for name, t in tensors.items():
            new = published_name(name)
            module = new[: -len(".weight")]
            if FP8.search(name):
                codes, exponents, dequantised[name] = quantize_fp8_ue8m0(t)
                stored[new], stored[module + ".scale"] = ("F8_E4M3", codes), ("F8_E8M0", exponents)
                names.append(name)
            elif FP4.search(name):
                stored[new], exponents, dequantised[name] = quantize_fp4(t)
                stored[module + ".scale"] = ("F8_E8M0", exponents)
                names.append(name)
            else:
                stored[new] = dequantised[name] = t
        return stored, dequantised, names

    def config():
        qc = dict(QUANTIZATION_CONFIG)
        if not expert_dtype_at_top:
            qc["expert_dtype"] = "fp4"
        return qc

    def rewrite(path):
        path = Path(path)
        reference = rewrite_checkpoint(path, quantise, config)
        if expert_dtype_at_top:
            import json

            data = json.loads((path / "config.json").read_text())
            data["expert_dtype"] = "fp4"
            (path / "config.json").write_text(json.dumps(data, indent=2))
        return reference

    return rewrite
